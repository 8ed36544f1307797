"""LoRA adapters as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors), the form `peft` loads
onto the base HF model, and back: mindrl's whole (TP=1) adapter matrices by megatron name <-> PEFT's per-projection
tensors (`mindrl.models.lora.full_to_peft` / `peft_to_full`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from mindrl.checkpoint.hf_io import CheckpointError
from mindrl.models.hf_config import ModelSpec
from mindrl.models.lora import LoRAError, adapter_mapping, adapter_names, adapter_shape, full_to_peft, peft_to_full

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# megatron target -> the HF modules PEFT adapts for it
HF_MODULES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
_PREFIX = "base_model.model."
# adapter_config.json keys that change what the adapter computes beyond y = W x + (alpha / r) B A x on the target
# projections of every layer: such an adapter has no place in mindrl's layers.
_UNSUPPORTED = {
    "modules_to_save": "fully trained copies of whole modules are not LoRA adapters",
    "layers_to_transform": "adapters on some layers only; mindrl adapts every layer",
    "fan_in_fan_out": "transposed (Conv1D) weights are not megatron's linears",
    "lora_bias": "a bias on lora_B is not mindrl's LoRA",
    "target_parameters": "adapters on raw parameters (MoE experts) are not implemented",
    "layer_replication": "replicated layers change the model",
    "trainable_token_indices": "trained embedding rows are not LoRA adapters",
}


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter read from a PEFT directory: its settings and whole matrices by megatron name."""

    lora_r: int
    lora_alpha: float
    lora_target_modules: list[str]
    tensors: dict[str, torch.Tensor]


def save_peft_adapter(
    out_dir: str,
    spec: ModelSpec,
    tensors: dict[str, torch.Tensor],
    r: int,
    alpha: float,
    targets: list[str],
    base_model: str | None = None,
) -> None:
    """Write the adapters (whole matrices by global megatron name, every one of `targets` in every layer) as a PEFT
    LoRA directory for `base_model` (its name or path, recorded in the config)."""
    from safetensors.torch import save_file

    missing = sorted(set(adapter_names(spec, targets)) - set(tensors))
    if missing:
        raise LoRAError(f"adapters missing for {missing[:3]} ({len(missing)} in all)")
    state = {}
    for name in adapter_names(spec, targets):
        for hf, t in full_to_peft(spec, name, tensors[name]):
            state[_PREFIX + hf] = t.detach().to("cpu").clone()  # a fused A is one tensor in each projection
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "target_modules": sorted(m for t in targets for m in HF_MODULES[t]),
        "inference_mode": True,
    }
    with open(os.path.join(out_dir, CONFIG), "w") as f:
        json.dump(config, f, indent=2)


def load_peft_adapter(path: str, spec: ModelSpec) -> PeftAdapter:
    """A PEFT LoRA directory as mindrl's adapters. Refused, naming the file and what is wrong: another PEFT method,
    rsLoRA / DoRA / adapter biases (other math), per-module ranks, a projection adapted without the others of its
    fused megatron linear, and q/k/v (gate/up) adapters with different A's."""
    from safetensors.torch import load_file

    cfg_path, w_path = os.path.join(path, CONFIG), os.path.join(path, WEIGHTS)
    for p in (cfg_path, w_path):
        if not os.path.isfile(p):
            raise CheckpointError(f"{p} is missing: not a PEFT adapter directory")
    with open(cfg_path) as f:
        cfg = json.load(f)
    problems = []
    if cfg.get("peft_type") != "LORA":
        problems.append(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_rslora") or cfg.get("use_dora") or cfg.get("bias", "none") != "none":
        problems.append("rsLoRA, DoRA and adapter biases are not mindrl's LoRA (scale alpha / r, no bias)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        problems.append("per-module ranks or alphas (rank_pattern / alpha_pattern) are not supported")
    for key, why in _UNSUPPORTED.items():
        if cfg.get(key):
            problems.append(f"{key} {cfg[key]!r}: {why}")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            problems.append(f"{key} {cfg.get(key)!r} is not a positive number")
    modules = cfg.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    targets = [t for t, hf in HF_MODULES.items() if set(hf) <= set(modules)]
    partial = [m for t, hf in HF_MODULES.items() if t not in targets for m in hf if m in modules]
    unknown = [m for m in modules if not any(m in hf for hf in HF_MODULES.values())]
    if partial:
        problems.append(f"{partial} adapted without the other projections of their fused megatron linear")
    if unknown:
        problems.append(f"target_modules {unknown} are not among {sorted(m for h in HF_MODULES.values() for m in h)}")
    if problems:
        raise CheckpointError(f"{cfg_path}: " + "; ".join(problems))
    r = int(cfg["r"])
    state = {k.removeprefix(_PREFIX).replace(".default.", "."): v for k, v in load_file(w_path).items()}
    tensors, used = {}, set()
    for name in adapter_names(spec, targets):
        mapping, matrix = adapter_mapping(spec, name)
        absent = [n for n in mapping.hf_names if n not in state]
        if absent:
            raise CheckpointError(f"{w_path}: {absent[0]} is missing (every layer's adapted projections are needed)")
        for n, want in zip(mapping.hf_names, _peft_shapes(spec, name, r)):
            if tuple(state[n].shape) != want:
                raise CheckpointError(f"{w_path}: {n} has shape {tuple(state[n].shape)}, but r = {r} "
                                      f"({cfg_path}) and the model imply {want}")  # fmt: skip
        used.update(mapping.hf_names)
        try:
            tensors[name] = peft_to_full(spec, name, [state[n] for n in mapping.hf_names], source=f"{w_path}: ")
        except LoRAError as e:
            raise CheckpointError(str(e)) from None
    extra = sorted(set(state) - used)
    if extra:
        raise CheckpointError(f"{w_path}: tensors that are not LoRA adapters of {targets}: {extra[:4]}"
                              f"{f' ({len(extra)} in all)' if len(extra) > 4 else ''}")  # fmt: skip
    return PeftAdapter(r, float(cfg["lora_alpha"]), targets, tensors)


def _peft_shapes(spec: ModelSpec, mcore_name: str, r: int) -> list[tuple[int, ...]]:
    """The shapes of the PEFT tensors of one megatron adapter matrix (in adapter_mapping's hf_names order)."""
    full = torch.empty(adapter_shape(spec, mcore_name, r), device="meta")
    return [tuple(t.shape) for _, t in full_to_peft(spec, mcore_name, full)]
