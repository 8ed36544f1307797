"""GGUF model file -> HF safetensors checkpoint (fp32, tokenizer, chat template), dequantised by transformers with the
optional `gguf` + `accelerate` packages (`pip install 'mindrl[gguf]'`). The file is checked before transformers runs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass

from mindrl.checkpoint.hf_io import CheckpointError

# The extra that brings the optional packages (setup.py extras_require["gguf"]).
EXTRA_HINT = "pip install 'mindrl[gguf]' (or: pip install gguf==0.19.0 accelerate==1.15.0)"
# GGUF architectures (general.architecture) converted and checked against megatron: the HF class they become.
ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# Tensor types dequantised to fp32 (gguf-py's numpy kernels): plain floats, the legacy block quants and the K-quants.
# The i-quants, ternary and FP4 types are refused: untested here, and some have no dequantiser.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
MAGIC = b"GGUF"


@dataclass
class GGUFInfo:
    architecture: str
    tensor_types: dict[str, int]  # GGML type name -> number of tensors
    num_tensors: int


def require_packages() -> None:
    """Raise a CheckpointError naming the optional packages that are missing and how to install them."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise CheckpointError(f"reading a GGUF file needs {' and '.join(missing)} (not installed): {EXTRA_HINT}")


def inspect_gguf(path: str) -> GGUFInfo:
    """Read the header of a GGUF file: its architecture and tensor types. Raises a CheckpointError on a file that is
    missing, not GGUF, truncated or corrupt, of an unsupported architecture, or holding an unsupported quantisation."""
    require_packages()
    import gguf

    if not os.path.isfile(path):
        raise CheckpointError(f"GGUF file {path!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError / struct.error / IndexError ... on a damaged file
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from e
    field = reader.fields.get("general.architecture")
    if field is None:
        raise CheckpointError(f"{path}: GGUF metadata has no 'general.architecture'")
    arch = field.contents()
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    types: dict[str, int] = {}
    bad: dict[str, str] = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        types[name] = types.get(name, 0) + 1
        if name not in SUPPORTED_TYPES:
            bad.setdefault(name, t.name)
    if bad:
        which = ", ".join(f"{q} (e.g. tensor {n!r})" for q, n in sorted(bad.items()))
        raise CheckpointError(
            f"{path}: unsupported quantisation {which}; supported tensor types: {', '.join(SUPPORTED_TYPES)}"
        )
    return GGUFInfo(architecture=arch, tensor_types=types, num_tensors=len(reader.tensors))


def _shortest_float(x: float) -> float:
    """GGUF stores floats as fp32: 1e-5 comes back as 9.999999747e-06. The shortest decimal that rounds to the same
    fp32 restores the value the model was published with."""
    import numpy as np

    return float(str(np.float32(x)))


def gguf_to_hf(gguf_file: str, save_dir: str, overwrite: bool = False) -> dict:
    """Dequantise `gguf_file` into an fp32 HF checkpoint in `save_dir` (written to `save_dir.partial`, then renamed).
    Returns a small summary: architecture, tensor types, parameter count, seconds."""
    import torch
    import transformers

    t0 = time.perf_counter()
    info = inspect_gguf(gguf_file)
    if os.path.isdir(save_dir) and os.listdir(save_dir) and not overwrite:
        raise CheckpointError(f"output directory {save_dir!r} is not empty; pass --overwrite to replace it")
    src_dir, name = os.path.split(os.path.abspath(gguf_file))
    try:
        quantised = transformers.AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{gguf_file}: transformers could not load it ({type(e).__name__}: {e})") from e
    config = quantised.config
    # The loaded model is marked "quantised with gguf" and refuses save_pretrained; the same weights in a plain model
    # of the same config save normally.
    del config.quantization_config
    config.rms_norm_eps = _shortest_float(config.rms_norm_eps)
    config._name_or_path = ""
    cls = getattr(transformers, ARCHITECTURES[info.architecture])
    model = cls(config)
    result = model.load_state_dict(quantised.state_dict(), strict=True)
    if result.missing_keys or result.unexpected_keys:  # strict=True raises first; kept for clarity
        raise CheckpointError(f"{gguf_file}: tensors do not match {cls.__name__}: {result}")
    del quantised
    if getattr(config, "max_position_embeddings", None):
        tokenizer.model_max_length = config.max_position_embeddings
    partial = save_dir.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        if not os.path.isfile(os.path.join(partial, "chat_template.jinja")) and not tokenizer.chat_template:
            raise CheckpointError(f"{gguf_file}: holds no chat template (tokenizer.chat_template metadata)")
        with open(os.path.join(partial, "gguf_source.json"), "w") as f:
            json.dump({"gguf_file": name, "architecture": info.architecture, "tensor_types": info.tensor_types}, f)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if os.path.isdir(save_dir):
        shutil.rmtree(save_dir)
    os.replace(partial, save_dir)
    return {
        "architecture": cls.__name__,
        "tensor_types": info.tensor_types,
        "num_params": sum(p.numel() for p in model.parameters()),
        "seconds": time.perf_counter() - t0,
    }
