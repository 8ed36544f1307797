#!/usr/bin/env bash
# The checks mindrl runs on a lent accelerator machine (CUDA torch, no Ray or vLLM), as one script:
#   1. the device tests (tests/*/test_*on_device.py): mcore vs HF logits, logprobs and a PPO update vs a CPU rank,
#      offload/onload, the weight stream and exact resume, on the device;
#   2. tools/bench_update.py --tp 1 on the device: the benchmark model (micro-batches of 16 and 64 rows) and a larger
#      one (~0.67B parameters: hidden 2048, 12 layers) to see where a GPU's MFU is made.
# Missing Python packages (megatron-core, omegaconf, hydra-core, antlr4) are installed from ./.whl when it exists
# (see docs/performance.md, "On a GPU", for how to fetch them). Each step has its own time limit, so one slow step
# does not take the others' results with it (TESTS_LIMIT, BIG_LIMIT: seconds); logs go to $OUT (or ./device_out) and
# to the console. It exits non-zero when any step failed or ran out of time.
#
#   bash tools/device_check.sh [tests|bench|all]      (default all)
#   MINDRL_DEVICE_TESTS_ON_CPU=1 bash tools/device_check.sh tests   # check the script and tests on a CPU host
set -uo pipefail

what="${1:-all}"
case "$what" in tests|bench|all) ;; -h|--help) sed -n "2,13p" "$0"; exit 0 ;; *) echo "unknown step '$what' (tests, bench or all)" >&2; exit 2 ;; esac

out="${OUT:-./device_out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

status=0
step() {  # step NAME SECONDS CMD...: run CMD with a time limit, its output to the console and $out/NAME.log
    local name="$1" limit="$2"
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || status=1
}

"$py" - <<'EOF' 2>&1 | tee "$out/machine.log"
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
with open("/proc/cpuinfo") as f:
    print(next((l.strip() for l in f if l.startswith("model name")), "cpu: unknown"))
EOF

if [ "$what" != bench ]; then
    step tests "${TESTS_LIMIT:-330}" "$py" -m pytest -q -p no:randomly -p no:cacheprovider -s \
        tests/models/test_on_device.py tests/workers/test_train_state_on_device.py
fi
if [ "$what" != tests ]; then
    common=(tools/bench_update.py --tp 1 --iterations 3 --no-profile)
    step bench_mb16 90 "$py" "${common[@]}" --micro-batch-size 16 --json "$out/bench_mb16.json"
    step bench_mb64 90 "$py" "${common[@]}" --micro-batch-size 64 --json "$out/bench_mb64.json"
    big=(--hidden-size 2048 --num-layers 12 --num-heads 16 --num-kv-heads 4 --ffn 5632 --vocab-size 32000)
    step bench_big_mb16 "${BIG_LIMIT:-180}" "$py" "${common[@]}" "${big[@]}" --micro-batch-size 16 \
        --json "$out/bench_big_mb16.json"
fi
exit $status
