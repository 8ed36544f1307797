#!/usr/bin/env bash
# Thin wrapper: bash ckpt_convert/hf2mcore.sh [mindrl-convert hf2mcore options]   (see --help)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"; [[ -x "$PY" ]] || PY=python
exec "$PY" -m mindrl.cli.convert hf2mcore "$@"
