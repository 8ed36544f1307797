#!/usr/bin/env bash
# Offline DPO on a CPU-only machine: the tiny Qwen2 on the quickstart task's preference pairs (chosen = the larger
# number, rejected = the smaller or a digit not asked), about a minute after the README's set-up.
#   bash examples/rlhf/train_dpo_cpu.sh
# Steps:
#   1. the tiny Qwen2 + tokenizer (unless OUT/hf exists) and the preference pairs (tools/make_preference_data.py)
#   2. preprocess them (AlpacaStylePairwiseHandler, the qwen template)
#   3. the policy's start: LOAD (default OUT/ckpt/actor_sft, the quickstart's SFT save, else the base model
#      converted here); the frozen reference: REF_MODEL (default: the same checkpoint)
#   4. mindrl-train-dpo (configs/dpo_tiny_cpu.yaml): prints `DPO held-out reward accuracy: X, margin Y`
# Environment: OUT (default ./outputs/quickstart: the model and SFT save), RLHF (default ./outputs/rlhf: data and the
# DPO checkpoint), RUN_DIR (default ./outputs/dpo_tiny_cpu), LOAD, REF_MODEL, DPO_ITERS (default: the config's, 100),
# PREF_FTX (the SFT term's weight, default 0), PREF_ARGS (more tools/make_preference_data.py flags).
# The last line is `run dir: PATH`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
case "${1:-}" in -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; "") ;;
    *) echo "usage: bash examples/rlhf/train_dpo_cpu.sh [--help]" >&2; exit 2;; esac
RUN_DIR="${RUN_DIR:-./outputs/dpo_tiny_cpu}"
source examples/rlhf/prepare_pairs.sh
prepare_pairs 3

echo "== 3/3 DPO from $LOAD (reference: ${REF_MODEL:-the same checkpoint})"
DPO_ARGS=(megatron_training.data_path="$RLHF/data/pref" megatron_training.tokenizer_name_or_path="$OUT/hf"
    megatron_training.load="$LOAD" megatron_training.save="$RLHF/ckpt/dpo" megatron_training.run_dir="$RUN_DIR")
[[ -n "${REF_MODEL:-}" ]] && DPO_ARGS+=(++megatron_training.ref_model="$REF_MODEL")
[[ -n "${PREF_FTX:-}" ]] && DPO_ARGS+=(++megatron_training.pref_ftx="$PREF_FTX")
[[ -n "${DPO_ITERS:-}" ]] && DPO_ARGS+=(megatron_training.train_iters="$DPO_ITERS")
"$PY" -m mindrl.cli.train_dpo --config-name dpo_tiny_cpu "${DPO_ARGS[@]}" | grep -v "^run dir: "
echo "DPO checkpoint: $RLHF/ckpt/dpo (actor_config.load; mindrl-convert mcore2hf exports it)"
echo "run dir: $RUN_DIR"
