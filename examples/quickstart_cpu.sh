#!/usr/bin/env bash
# The main job on a CPU-only machine, end to end with a tiny model (about a minute after setup):
#   1. set up .venv                          4. check megatron logits == HF logits at TP1xPP2
#   2. make a tiny Qwen2 model + tokenizer   5. convert back to HF (bit-exact with the original)
#   3. HF -> megatron checkpoint at TP2xPP2  6. preprocess a DeepScaleR-style dataset with its tokenizer
# Outputs go to $OUT (default ./outputs/quickstart). The PPO trainer is not in the tree yet.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup_env.sh
PY="$ROOT/.venv/bin/python"
OUT="${OUT:-./outputs/quickstart}"
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false

echo "== tiny model"
"$PY" tools/make_tiny_model.py --out "$OUT/hf"
echo "== hf2mcore TP2 PP2"
"$PY" -m mindrl.cli.convert hf2mcore --hf-dir "$OUT/hf" --save-dir "$OUT/mcore" --tp 2 --pp 2 --overwrite
echo "== check (loaded at TP1 PP2: dist_checkpointing reshards)"
"$PY" -m mindrl.cli.convert check --hf-dir "$OUT/hf" --load-dir "$OUT/mcore" --tp 1 --pp 2
echo "== mcore2hf"
"$PY" -m mindrl.cli.convert mcore2hf --load-dir "$OUT/mcore" --save-dir "$OUT/hf_roundtrip" --overwrite
"$PY" - "$OUT/hf" "$OUT/hf_roundtrip" <<'PYEOF'
import sys, torch
from safetensors.torch import load_file
a, b = (load_file(f"{d}/model.safetensors") for d in sys.argv[1:])
same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
print(f"round trip bit-exact: {same} ({len(a)} tensors)")
sys.exit(0 if same else 1)
PYEOF
echo "== preprocess a DeepScaleR-style dataset"
"$PY" - "$OUT/deepscaler.json" <<'PYEOF'
import json, random, sys
rng = random.Random(0)
rows = []
for i in range(200):
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    rows.append({"problem": f"What is {a} + {b}?", "answer": str(a + b), "solution": f"{a} + {b} = {a + b}"})
json.dump(rows, open(sys.argv[1], "w"))
PYEOF
bash examples/data/preprocess_data.sh deepscaler input="$OUT/deepscaler.json" \
    tokenizer_name_or_path="$OUT/hf" output_prefix="$OUT/data/deepscaler" workers=2
echo "quickstart done: outputs in $OUT"
