#!/usr/bin/env bash
# Thin wrapper: bash ckpt_convert/mcore2hf.sh [mindrl-convert mcore2hf options]   (see --help)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"; [[ -x "$PY" ]] || PY=python
exec "$PY" -m mindrl.cli.convert mcore2hf "$@"
