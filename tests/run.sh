#!/usr/bin/env bash
# The test command (README, .ci/run): set up .venv from scratch if needed, then run the whole suite.
#   bash tests/run.sh              # everything, slow tests included (what CI runs)
#   bash tests/run.sh -m "not slow" tests/algorithms   # any pytest arguments
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup_env.sh
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "${@:-tests}"
