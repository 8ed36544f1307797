#!/usr/bin/env bash
# Thin wrapper: bash ckpt_convert/check.sh [mindrl-convert check options]   (see --help)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"; [[ -x "$PY" ]] || PY=python
exec "$PY" -m mindrl.cli.convert check "$@"
