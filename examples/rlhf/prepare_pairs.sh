# Sourced by train_rm_cpu.sh and train_dpo_cpu.sh (not run alone): the shared first steps of a preference-pair run.
# Needs ROOT (the checkout; the caller cd-s there); sets PY, OUT, RLHF and LOAD (the start checkpoint:
# LOAD, else OUT/ckpt/actor_sft, the quickstart's SFT save, else the base model converted here).
# Usage: prepare_pairs N_STEPS (the caller's step count, for the "== i/N" lines).
PY="python"
[[ -x "$ROOT/.venv/bin/python" ]] && PY="$ROOT/.venv/bin/python"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
OUT="${OUT:-./outputs/quickstart}"
RLHF="${RLHF:-./outputs/rlhf}"

prepare_pairs() {
    local steps=$1
    mkdir -p "$OUT" "$RLHF"
    echo "== 1/$steps tiny model + preference pairs"
    [[ -f "$OUT/hf/config.json" ]] || "$PY" tools/make_tiny_model.py --out "$OUT/hf" >/dev/null
    "$PY" tools/make_preference_data.py --out "$RLHF/raw" --rows 2000 --valid-fraction 0.1 ${PREF_ARGS:-}

    echo "== 2/$steps preprocess (pairwise)"
    bash examples/data/preprocess_data.sh pairwise input="$RLHF/raw/pref.json" tokenizer_name_or_path="$OUT/hf" \
        output_prefix="$RLHF/data/pref" prompt_type=qwen workers=1

    LOAD="${LOAD:-$OUT/ckpt/actor_sft}"
    if [[ ! -f "$LOAD/latest_checkpointed_iteration.txt" ]]; then
        LOAD="$OUT/ckpt/base"
        "$PY" -m mindrl.cli.convert hf2mcore --hf-dir "$OUT/hf" --save-dir "$LOAD" --tp 1 --pp 1 --overwrite
    fi
}
