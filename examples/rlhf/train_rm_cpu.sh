#!/usr/bin/env bash
# Stage 2 of the RLHF pipeline on a CPU-only machine: a reward model on the quickstart task's preference pairs
# (chosen = the larger number, rejected = the smaller), about a minute after setup.
#   bash examples/rlhf/train_rm_cpu.sh
# Steps:
#   1. the tiny Qwen2 + tokenizer (unless OUT/hf exists) and the preference pairs (tools/make_preference_data.py)
#   2. preprocess them (AlpacaStylePairwiseHandler, the qwen template)
#   3. the start: LOAD (default OUT/ckpt/actor_sft, the quickstart's SFT save, else the base model converted here)
#   4. mindrl-train-rm (configs/rm_tiny_cpu.yaml): prints `reward model held-out accuracy: X`
#   5. export: mindrl-convert mcore2hf --orm -> OUT/hf_reward (transformers' Qwen2ForSequenceClassification)
# Environment: OUT (default ./outputs/quickstart: the model and SFT save), RLHF (default ./outputs/rlhf: data and
# the reward checkpoint), LOAD, RM_ITERS (default: the config's), PREF_ARGS (more tools/make_preference_data.py flags,
# e.g. "--format-fraction 0.3"). The last line is `run dir: PATH`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
RUN_DIR="${RUN_DIR:-./outputs/rm_tiny_cpu}"
source examples/rlhf/prepare_pairs.sh
prepare_pairs 4

echo "== 3/4 reward model from $LOAD"
RM_ARGS=(megatron_training.data_path="$RLHF/data/pref" megatron_training.tokenizer_name_or_path="$OUT/hf"
    megatron_training.load="$LOAD" megatron_training.save="$RLHF/ckpt/reward" megatron_training.run_dir="$RUN_DIR")
[[ -n "${RM_ITERS:-}" ]] && RM_ARGS+=(megatron_training.train_iters="$RM_ITERS")
"$PY" -m mindrl.cli.train_rm --config-name rm_tiny_cpu "${RM_ARGS[@]}" | grep -v "^run dir: "

echo "== 4/4 export: HF Qwen2ForSequenceClassification"
"$PY" -m mindrl.cli.convert mcore2hf --orm --load-dir "$RLHF/ckpt/reward" --save-dir "$RLHF/hf_reward" --overwrite
echo "reward checkpoint: $RLHF/ckpt/reward (critic_config.load); HF: $RLHF/hf_reward"
echo "run dir: $RUN_DIR"
