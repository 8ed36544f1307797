#!/usr/bin/env bash
# Tokenise a raw dataset into Megatron indexed datasets, from configs/datasets/NAME.yaml plus overrides:
#   bash examples/data/preprocess_data.sh deepscaler
#   bash examples/data/preprocess_data.sh deepscaler input=./dataset/deepscaler.json \
#       tokenizer_name_or_path=./model_from_hf/qwen25-7b output_prefix=./dataset/data workers=2
# Relative paths are relative to the current directory (run it from the repo root, as the configs assume).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    echo "usage: bash examples/data/preprocess_data.sh NAME [key=value ...]   (NAME: one of" \
        "$(cd "$ROOT/configs/datasets" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' '))"
    [[ $# -lt 1 ]] && exit 2 || exit 0
fi
NAME="$1"; shift
CONFIG="$ROOT/configs/datasets/$NAME.yaml"
if [[ ! -f "$CONFIG" ]]; then
    echo "error: no dataset config $CONFIG; known: $(cd "$ROOT/configs/datasets" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')" >&2
    exit 2
fi
PY="python"
[[ -x "$ROOT/.venv/bin/python" ]] && PY="$ROOT/.venv/bin/python"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m mindrl.cli.preprocess --config "$CONFIG" "$@"
