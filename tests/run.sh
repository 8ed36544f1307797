#!/usr/bin/env bash
# The test command (README, .ci/run): set up .venv from scratch if needed, then run the whole suite.
#   bash tests/run.sh              # everything, slow tests included (what CI runs)
#   bash tests/run.sh -m "not slow" tests/algorithms   # any pytest arguments
# Two pytest-xdist workers by default: the tests that start processes (rank pools, Ray, servers, trainer runs) form
# two lanes (tests/parallel.py), each run one after another on one worker; the rest run beside them.
# MINDRL_TEST_WORKERS=1 runs everything in one process (easier to read; what a debugger wants).
set -euo pipefail
WORKERS="${MINDRL_TEST_WORKERS:-2}"
[[ "$WORKERS" =~ ^[1-9][0-9]*$ ]] || { echo "error: MINDRL_TEST_WORKERS=$WORKERS must be a positive integer" >&2; exit 2; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup_env.sh
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
XDIST=()
if [[ "$WORKERS" -gt 1 ]]; then XDIST=(-n "$WORKERS" --dist loadgroup); fi
exec .venv/bin/python -m pytest ${XDIST[@]+"${XDIST[@]}"} "${@:-tests}"
