#!/usr/bin/env bash
# The main job on a CPU-only machine: a tiny PPO (or GRPO) run end to end, about 10 minutes after setup.
#   bash examples/quickstart_cpu.sh          # PPO (GAE + critic)
#   bash examples/quickstart_cpu.sh grpo     # GRPO (group-norm advantages, KL loss, no critic)
#   bash examples/quickstart_cpu.sh dapo     # DAPO (GRPO + overlong buffer, dynamic sampling, clip-higher, no KL) on
#                                            # the tiny Qwen3 (QK norm, the qwen3 template), in ./outputs/quickstart_qwen3
#   bash examples/quickstart_cpu.sh retool   # multi-turn GRPO with the code tool (configs/retool_tiny_cpu.yaml):
#                                            # 2-digit products, SFT on tool-use traces, the local sandbox served
#                                            # (mindrl-sandbox --serve) for the run; in ./outputs/quickstart_retool;
#                                            # ~220 CPU s in all (docs/agentic.md)
# Steps:
#   1. set up .venv
#   2. a tiny Qwen2 (Qwen3 for dapo) model + tokenizer, and a synthetic task in DeepScaleR's JSON format (problem, answer)
#   3. preprocess it (the RL split; and the SFT split as instruction data)
#   4. SFT warm start on the disjoint SFT split: learns the \boxed{} answer format, not the task
#   5. convert: HF -> megatron for the SFT start, and a critic (the SFT trunk + a value head, --orm)
#   6. PPO through Ray with vLLM-CPU rollouts, integrated workers, TP2: the acc_for_ppo reward rises
#   7. convert the result back to HF, plot the metrics; the last line is `run dir: PATH`
#   8. the learning check (tools/check_learning.py --run quickstart-ALGO): the reward's mean over the last 10
#      iterations minus that over the first 10 must reach a bound measured over seeds (it holds from 30 iterations
#      on; retool: windows of 5 over its 20 iterations, and its tool calls must happen and succeed); else the
#      script exits 1 with the figures and the bound
#   bash examples/quickstart_cpu.sh [ALGO] --check-only   # step 8 alone, on RUN_DIR (a finished run)
# Assets go to ./outputs/quickstart (configs/ppo_tiny_cpu.yaml and grpo_tiny_cpu.yaml point there), so that
# afterwards `mindrl-train --config-name ppo_tiny_cpu [key=value ...]` runs on its own from the project root.
# Environment (for a short form, e.g. in the tests): OUT (assets), RUN_DIR, SFT_ITERS and ITERS (SFT steps and
# RL iterations; default: the configs' own), MIN_RISE and WINDOW (the learning check's bound and window; default:
# the measured ones, which a run of fewer than 30 iterations need not reach).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ALGO="${1:-ppo}" CHECK_ONLY=""
[[ "$ALGO" == --check-only ]] && ALGO=ppo CHECK_ONLY=1
[[ "${2:-}" == --check-only ]] && CHECK_ONLY=1
case "$ALGO" in ppo|grpo|dapo|retool) ;; -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
    *) echo "usage: bash examples/quickstart_cpu.sh [ppo|grpo|dapo|retool] [--check-only]" >&2; exit 2;; esac
[[ -z "${2:-}" || -n "$CHECK_ONLY" ]] || { echo "usage: bash examples/quickstart_cpu.sh [ppo|grpo|dapo|retool] [--check-only]" >&2; exit 2; }
RUN_DIR="${RUN_DIR:-./outputs/${ALGO}_tiny_cpu}"
check_learning() {  # step 8; its exit status is the script's
    local args=("$RUN_DIR" --run "quickstart-$ALGO")  # retool: also tool calls happen and succeed
    [[ -n "${MIN_RISE:-}" ]] && args+=(--min-rise "$MIN_RISE")
    [[ -n "${WINDOW:-}" ]] && args+=(--window "$WINDOW")
    "${PY:-python3}" tools/check_learning.py "${args[@]}"
}
if [[ -n "$CHECK_ONLY" ]]; then
    [[ -x "$ROOT/.venv/bin/python" ]] && PY="$ROOT/.venv/bin/python"
    check_learning; exit $?
fi
START=$(date +%s)
bash tools/setup_env.sh
PY="$ROOT/.venv/bin/python"
export PATH="$ROOT/.venv/bin:$PATH" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [[ "$ALGO" == dapo ]]; then ARCH=qwen3 TEMPLATE=qwen3 DEFAULT_OUT=./outputs/quickstart_qwen3
elif [[ "$ALGO" == retool ]]; then ARCH=qwen2 TEMPLATE=qwen DEFAULT_OUT=./outputs/quickstart_retool
else ARCH=qwen2 TEMPLATE=qwen DEFAULT_OUT=./outputs/quickstart; fi
OUT="${OUT:-$DEFAULT_OUT}"
mkdir -p "$OUT"

echo "== 1/6 tiny $ARCH model + synthetic task"
if [[ "$ALGO" == retool ]]; then
    "$PY" tools/make_tiny_model.py --out "$OUT/hf" --arch "$ARCH" --tool-tokens >/dev/null
    SANDBOX_PORT="${SANDBOX_PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
    "$PY" tools/make_retool_data.py --out "$OUT/raw" --sandbox-url "http://127.0.0.1:$SANDBOX_PORT/run_code"
else
    "$PY" tools/make_tiny_model.py --out "$OUT/hf" --arch "$ARCH" >/dev/null
    "$PY" tools/make_quickstart_data.py --out "$OUT/raw"
fi

echo "== 2/6 preprocess (RL split: DeepScaleR format; SFT split: instruction data)"
bash examples/data/preprocess_data.sh deepscaler input="$OUT/raw/rl.json" tokenizer_name_or_path="$OUT/hf" \
    output_prefix="$OUT/data/train" prompt_type="$TEMPLATE" workers=1
bash examples/data/preprocess_data.sh deepscaler input="$OUT/raw/sft.json" tokenizer_name_or_path="$OUT/hf" \
    output_prefix="$OUT/data/sft" prompt_type="$TEMPLATE" handler_name=AlpacaStyleInstructionHandler \
    'map_keys={prompt: problem, response: solution}' workers=1

echo "== 3/6 SFT warm start"
"$PY" -m mindrl.cli.convert hf2mcore --hf-dir "$OUT/hf" --save-dir "$OUT/ckpt/base" --tp 1 --pp 1 --overwrite
SFT_ARGS=(megatron_training.data_path="$OUT/data/sft" megatron_training.tokenizer_name_or_path="$OUT/hf"
    megatron_training.load="$OUT/ckpt/base" megatron_training.save="$OUT/ckpt/actor_sft"
    megatron_training.run_dir="$OUT/sft_run")
[[ -n "${SFT_ITERS:-}" ]] && SFT_ARGS+=(megatron_training.train_iters="$SFT_ITERS")
[[ "$ALGO" == retool ]] && SFT_ARGS+=(megatron_training.seq_length=192)  # prompt + a whole tool-use trace
"$PY" -m mindrl.cli.sft --config-name sft_tiny_cpu "${SFT_ARGS[@]}"

echo "== 4/6 convert: SFT -> HF, critic from the SFT trunk (--orm)"
"$PY" -m mindrl.cli.convert mcore2hf --load-dir "$OUT/ckpt/actor_sft" --save-dir "$OUT/hf_sft" --overwrite
if [[ "$ALGO" != retool ]]; then
    "$PY" tools/make_critic_from_lm.py --hf-dir "$OUT/hf_sft" --out "$OUT/hf_critic" >/dev/null
    "$PY" -m mindrl.cli.convert hf2mcore --hf-dir "$OUT/hf_critic" --save-dir "$OUT/ckpt/critic" --tp 2 --pp 1 --orm --overwrite
fi

echo "== 5/6 $ALGO (Ray, vLLM-CPU, integrated workers, TP2)"
rm -rf "$RUN_DIR" "$OUT/ckpt/${ALGO}_actor" "$OUT/ckpt/${ALGO}_critic"
TRAIN_ARGS=(actor_config.load="$OUT/ckpt/actor_sft" actor_config.save="$OUT/ckpt/${ALGO}_actor"
    rl_config.integrated_mode_config.ref_model_load_path="$OUT/ckpt/actor_sft"
    megatron_training.data_path="$OUT/data/train" megatron_training.tokenizer_name_or_path="$OUT/hf_sft"
    rl_config.run_dir="$RUN_DIR")
[[ "$ALGO" == ppo ]] && TRAIN_ARGS+=(critic_config.load="$OUT/ckpt/critic" critic_config.save="$OUT/ckpt/${ALGO}_critic")
[[ -n "${ITERS:-}" ]] && TRAIN_ARGS+=(megatron_training.train_iters="$ITERS")
if [[ "$ALGO" == retool ]]; then  # the code tool's sandbox, for the run only
    TRAIN_ARGS+=(rl_config.tool_config_path="$OUT/raw/tools.yaml")
    "$PY" -m mindrl.cli.sandbox --serve --port "$SANDBOX_PORT" 2>"$OUT/sandbox.log" &
    SANDBOX_PID=$!
    trap 'kill "$SANDBOX_PID" 2>/dev/null || true' EXIT
fi
"$PY" -m mindrl.cli.train --config-name "${ALGO}_tiny_cpu" "${TRAIN_ARGS[@]}" | tee "$OUT/train.log"

echo "== 6/6 back to HF, plot"
"$PY" -m mindrl.cli.convert mcore2hf --load-dir "$OUT/ckpt/${ALGO}_actor" --save-dir "$RUN_DIR/hf" --overwrite
"$PY" tools/plot_metrics.py "$RUN_DIR"

echo "== the learning check"
RC=0; check_learning || RC=$?
echo "quickstart ($ALGO) done in $(( $(date +%s) - START )) s: checkpoints in $OUT/ckpt, HF result in $RUN_DIR/hf"
echo "run dir: $RUN_DIR"
exit "$RC"
