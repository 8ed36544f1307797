"""The HF <-> megatron weight map, the one place for the layout rules: names, fused layouts (QKV by query group,
gate/up, each expert's gate/up) and TP sharding, between HF, megatron *full* (TP=1) and megatron *local* (this TP
rank's shard) tensors."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from mindrl.models.hf_config import ModelSpec

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# One expert's linear in a MoE layer (megatron's SequentialMLP; the index is global at expert parallel size 1).
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_EXPERT_HF = {"linear_fc1": ("gate_proj.weight", "up_proj.weight"), "linear_fc2": ("down_proj.weight",)}
_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
_ROUTER = "mlp.router.weight"
# DeepSeek-V3's MoE layer: the router's correction bias (a megatron buffer, fp32) and the shared expert.
_ROUTER_BIAS = "mlp.router.expert_bias"
_SHARED = {
    "mlp.shared_experts.linear_fc1.weight": (
        "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight",
    ),
    "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_experts.down_proj.weight",),
}
MAPPED_BUFFERS = (_ROUTER_BIAS,)
"""Buffers that are checkpoint weights (layer suffixes): converted and streamed with the parameters."""
# Multi-latent attention (megatron's MLASelfAttention) in place of linear_qkv and the per-head q/k norms.
_MLA_MAP = {
    "self_attention.linear_q_proj.weight": ("self_attn.q_proj.weight",),
    "self_attention.linear_q_down_proj.weight": ("self_attn.q_a_proj.weight",),
    "self_attention.q_layernorm.weight": ("self_attn.q_a_layernorm.weight",),
    "self_attention.linear_q_up_proj.weight": ("self_attn.q_b_proj.weight",),
    "self_attention.linear_kv_down_proj.weight": ("self_attn.kv_a_proj_with_mqa.weight",),
    "self_attention.kv_layernorm.weight": ("self_attn.kv_a_layernorm.weight",),
    "self_attention.linear_kv_up_proj.weight": ("self_attn.kv_b_proj.weight",),
}

# megatron per-layer suffix -> HF per-layer suffixes (under "model.layers.{i}.")
_LAYER_MAP = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
# How a megatron parameter is split over TP ranks.
_TP_SPLIT = {
    "self_attention.linear_qkv.weight": "column",
    "self_attention.linear_qkv.bias": "column",
    "self_attention.linear_proj.weight": "row",
    "mlp.linear_fc1.weight": "gated_column",  # each rank holds [gate_shard; up_shard]
    "mlp.linear_fc2.weight": "row",
    "mlp.shared_experts.linear_fc1.weight": "gated_column",
    "mlp.shared_experts.linear_fc2.weight": "row",
    # MLA: every projection is megatron's ColumnParallelLinear, the down projections' outputs gathered over TP
    "self_attention.linear_q_proj.weight": "column",
    "self_attention.linear_q_down_proj.weight": "column",
    "self_attention.linear_q_up_proj.weight": "column",
    "self_attention.linear_kv_down_proj.weight": "column",
    "self_attention.linear_kv_up_proj.weight": "column",
    "embedding.word_embeddings.weight": "column",
    "output_layer.weight": "column",
}


@dataclass(frozen=True)
class ParamMapping:
    """One megatron parameter and the HF tensors it is made of."""

    mcore_name: str  # global name: layer numbers are global, not per pipeline stage
    hf_names: tuple[str, ...]
    tp_split: str  # "column" | "row" | "gated_column" | "replicated"


def _is_qk_norm(suffix: str) -> bool:
    return suffix in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")


def _attention_suffixes(spec: ModelSpec) -> list[str]:
    """The megatron attention parameters of one layer (layer suffixes), in HF file order."""
    if spec.is_mla:
        q = ["linear_q_down_proj", "q_layernorm", "linear_q_up_proj"] if spec.q_lora_rank else ["linear_q_proj"]
        kv = ["linear_kv_down_proj", "kv_layernorm", "linear_kv_up_proj", "linear_proj"]
        return [f"self_attention.{n}.weight" for n in q + kv]
    out = []
    for suffix in _LAYER_MAP:
        if not suffix.startswith("self_attention."):
            continue
        if (suffix.endswith(".bias") and not spec.qkv_bias) or (_is_qk_norm(suffix) and not spec.qk_layernorm):
            continue
        out.append(suffix)
    return out


def _layer_map(spec: ModelSpec, suffix: str) -> tuple[str, ...] | None:
    """HF per-layer suffixes of a megatron layer suffix of a non-MoE-specific parameter, None if it has none."""
    if spec.is_mla and suffix.startswith("self_attention."):
        if suffix == "self_attention.linear_proj.weight":
            return _LAYER_MAP[suffix]
        return _MLA_MAP.get(suffix) if suffix in _attention_suffixes(spec) else None
    if suffix not in _LAYER_MAP or (_is_qk_norm(suffix) and not spec.qk_layernorm):
        return None
    return _LAYER_MAP[suffix]


def param_mapping(spec: ModelSpec, mcore_name: str) -> ParamMapping:
    """The mapping for a megatron parameter (or mapped buffer, `MAPPED_BUFFERS`) name (with global layer index)."""
    m = _LAYER_RE.match(mcore_name)
    if m and int(m.group(1)) in spec.moe_layers:
        layer, suffix = int(m.group(1)), m.group(2)
        e = _EXPERT_RE.match(suffix)
        if e and int(e.group(1)) < spec.num_experts:
            hf = tuple(f"model.layers.{layer}.mlp.experts.{e.group(1)}.{s}" for s in _EXPERT_HF[e.group(2)])
            return ParamMapping(mcore_name, hf, _TP_SPLIT[f"mlp.{e.group(2)}.weight"])
        if suffix == _ROUTER:
            return ParamMapping(mcore_name, (f"model.layers.{layer}.mlp.gate.weight",), "replicated")
        if suffix == _ROUTER_BIAS and spec.moe_expert_bias:
            return ParamMapping(mcore_name, (f"model.layers.{layer}.mlp.gate.e_score_correction_bias",), "replicated")
        if suffix in _SHARED and spec.moe_shared_expert_ffn:
            hf = tuple(f"model.layers.{layer}.{s}" for s in _SHARED[suffix])
            return ParamMapping(mcore_name, hf, _TP_SPLIT[suffix])
        if suffix in _DENSE_MLP:
            raise KeyError(f"no HF mapping for megatron parameter {mcore_name!r}: layer {layer} is a MoE layer")
    if m:
        layer, suffix = int(m.group(1)), m.group(2)
        hf_suffixes = _layer_map(spec, suffix)
        if hf_suffixes is None:
            raise KeyError(f"no HF mapping for megatron parameter {mcore_name!r}")
        hf = tuple(f"model.layers.{layer}.{s}" for s in hf_suffixes)
        return ParamMapping(mcore_name, hf, _TP_SPLIT.get(suffix, "replicated"))
    if mcore_name == "embedding.word_embeddings.weight":
        return ParamMapping(mcore_name, ("model.embed_tokens.weight",), "column")
    if mcore_name == "decoder.final_layernorm.weight":
        return ParamMapping(mcore_name, ("model.norm.weight",), "replicated")
    if mcore_name == "output_layer.weight":
        if spec.is_value_model:
            return ParamMapping(mcore_name, ("score.weight",), "replicated")
        hf = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        return ParamMapping(mcore_name, (hf,), "column")
    raise KeyError(f"no HF mapping for megatron parameter {mcore_name!r}")


def mcore_param_names(spec: ModelSpec) -> list[str]:
    """All megatron parameter names of the full model (global layer numbering), in HF file order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(spec.num_layers):
        suffixes = ["input_layernorm.weight", *_attention_suffixes(spec), "pre_mlp_layernorm.weight"]
        if i in spec.moe_layers:
            suffixes.append(_ROUTER)
            if spec.moe_expert_bias:
                suffixes.append(_ROUTER_BIAS)
            for e in range(spec.num_experts):
                suffixes += [f"mlp.experts.local_experts.{e}.{fc}.weight" for fc in _EXPERT_HF]
            if spec.moe_shared_expert_ffn:
                suffixes += list(_SHARED)
        else:
            suffixes += list(_DENSE_MLP)
        names += [f"decoder.layers.{i}.{suffix}" for suffix in suffixes]
    names.append("decoder.final_layernorm.weight")
    if spec.is_value_model or not spec.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def expected_hf_names(spec: ModelSpec) -> list[str]:
    """The tensor names an HF checkpoint of this model holds (each exactly once)."""
    out: list[str] = []
    for name in mcore_param_names(spec):
        for hf in param_mapping(spec, name).hf_names:
            if hf not in out:
                out.append(hf)
    return out


def expected_hf_shape(spec: ModelSpec, hf_name: str) -> tuple[int, ...]:
    """The shape the tensor `hf_name` of an HF checkpoint of this model has (unpadded vocabulary)."""
    h, hd, ffn, v = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size, spec.vocab_size
    leaf = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
    if spec.is_mla:
        heads, qk, rope = spec.num_heads, spec.head_dim, spec.qk_rope_head_dim
        mla = {
            "self_attn.q_proj.weight": (heads * qk, h),
            "self_attn.q_a_proj.weight": (spec.q_lora_rank, h),
            "self_attn.q_a_layernorm.weight": (spec.q_lora_rank,),
            "self_attn.q_b_proj.weight": (heads * qk, spec.q_lora_rank),
            "self_attn.kv_a_proj_with_mqa.weight": (spec.kv_lora_rank + rope, h),
            "self_attn.kv_a_layernorm.weight": (spec.kv_lora_rank,),
            "self_attn.kv_b_proj.weight": (heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank),
            "self_attn.o_proj.weight": (h, heads * spec.v_head_dim),
        }
        if leaf in mla:
            return mla[leaf]
    shared = re.match(r"^mlp\.shared_experts\.(.+)$", leaf)
    if shared:
        f_s = spec.moe_shared_expert_ffn
        return {"gate_proj.weight": (f_s, h), "up_proj.weight": (f_s, h), "down_proj.weight": (h, f_s)}[shared.group(1)]
    expert = re.match(r"^mlp\.experts\.\d+\.(.+)$", leaf)
    if expert:  # one expert's SwiGLU, of the experts' own width
        h_e = spec.moe_ffn_hidden_size
        return {"gate_proj.weight": (h_e, h), "up_proj.weight": (h_e, h), "down_proj.weight": (h, h_e)}[expert.group(1)]
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "lm_head.weight": (v, h),
        "score.weight": (1, h),
        "model.norm.weight": (h,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (spec.num_heads * hd, h),
        "self_attn.k_proj.weight": (spec.num_kv_heads * hd, h),
        "self_attn.v_proj.weight": (spec.num_kv_heads * hd, h),
        "self_attn.q_proj.bias": (spec.num_heads * hd,),
        "self_attn.k_proj.bias": (spec.num_kv_heads * hd,),
        "self_attn.v_proj.bias": (spec.num_kv_heads * hd,),
        "self_attn.o_proj.weight": (h, spec.num_heads * hd),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (ffn, h),
        "mlp.up_proj.weight": (ffn, h),
        "mlp.down_proj.weight": (h, ffn),
        "mlp.gate.weight": (spec.num_experts, h),
        "mlp.gate.e_score_correction_bias": (spec.num_experts,),
    }
    return shapes[leaf]


def global_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """Megatron names number layers per pipeline stage and experts per expert-parallel rank; the map uses global
    numbers."""
    m = _LAYER_RE.match(local_name)
    if not m:
        return local_name
    suffix = m.group(2)
    e = _EXPERT_RE.match(suffix)
    if e and expert_offset:
        suffix = f"mlp.experts.local_experts.{int(e.group(1)) + expert_offset}.{e.group(2)}.weight"
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{suffix}"


# ------------------------------------------------------------------------- HF <-> megatron full
def hf_to_full(spec: ModelSpec, mapping: ParamMapping, hf_tensors: list[torch.Tensor]) -> torch.Tensor:
    """HF tensors (in mapping.hf_names order) -> the megatron TP=1 tensor."""
    if mapping.mcore_name.endswith("linear_qkv.weight") or mapping.mcore_name.endswith("linear_qkv.bias"):
        q, k, v = hf_tensors
        groups, per_group, hd = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
        tail = q.shape[1:]
        fused = torch.cat(
            [q.reshape(groups, per_group * hd, *tail), k.reshape(groups, hd, *tail), v.reshape(groups, hd, *tail)],
            dim=1,
        )
        return fused.reshape(groups * (per_group + 2) * hd, *tail)
    if mapping.mcore_name.endswith("linear_fc1.weight"):
        return torch.cat(hf_tensors, dim=0)
    (t,) = hf_tensors
    return t


def full_to_hf(spec: ModelSpec, mapping: ParamMapping, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The megatron TP=1 tensor -> (hf_name, tensor) pairs. Outputs are views where the layout allows."""
    if mapping.mcore_name.endswith("linear_qkv.weight") or mapping.mcore_name.endswith("linear_qkv.bias"):
        groups, per_group, hd = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
        tail = full.shape[1:]
        g = full.reshape(groups, (per_group + 2) * hd, *tail)
        q = g[:, : per_group * hd].reshape(spec.num_heads * hd, *tail)
        k = g[:, per_group * hd : (per_group + 1) * hd].reshape(groups * hd, *tail)
        v = g[:, (per_group + 1) * hd :].reshape(groups * hd, *tail)
        return list(zip(mapping.hf_names, (q, k, v)))
    if mapping.mcore_name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return list(zip(mapping.hf_names, (gate, up)))
    return [(mapping.hf_names[0], full)]


def shards_to_hf(spec: ModelSpec, mapping: ParamMapping, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """All TP ranks' shards (in rank order) -> (hf_name, tensor) pairs: `full_to_hf(local_to_full(...))` with
    each output written once. The two-step form copies QKV twice (the TP concatenation, then the un-fuse
    of the query groups); here each of q, k, v is one concatenation of its rows in every shard. Outputs are
    views of a shard where the layout allows (one shard, a contiguous piece)."""
    if len(shards) == 1 or mapping.tp_split == "replicated":
        return full_to_hf(spec, mapping, shards[0])
    if mapping.mcore_name.endswith("linear_qkv.weight") or mapping.mcore_name.endswith("linear_qkv.bias"):
        groups, per_group, hd = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
        tail = shards[0].shape[1:]
        gs = [s.reshape(groups // len(shards), (per_group + 2) * hd, *tail) for s in shards]
        q = torch.cat([g[:, : per_group * hd] for g in gs]).reshape(spec.num_heads * hd, *tail)
        k = torch.cat([g[:, per_group * hd : (per_group + 1) * hd] for g in gs]).reshape(groups * hd, *tail)
        v = torch.cat([g[:, (per_group + 1) * hd :] for g in gs]).reshape(groups * hd, *tail)
        return list(zip(mapping.hf_names, (q, k, v)))
    if mapping.tp_split == "gated_column":
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return list(zip(mapping.hf_names, (torch.cat(gates), torch.cat(ups))))
    return full_to_hf(spec, mapping, local_to_full(mapping, shards))


# ------------------------------------------------------------------------- megatron full <-> local
def full_to_local(mapping: ParamMapping, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's shard of the megatron TP=1 tensor."""
    if tp_size == 1 or mapping.tp_split == "replicated":
        return full
    if mapping.tp_split == "column":
        return full.chunk(tp_size, dim=0)[tp_rank]
    if mapping.tp_split == "row":
        return full.chunk(tp_size, dim=1)[tp_rank]
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)


def local_to_full(mapping: ParamMapping, shards: list[torch.Tensor]) -> torch.Tensor:
    """All TP ranks' shards (in rank order) -> the megatron TP=1 tensor."""
    if len(shards) == 1 or mapping.tp_split == "replicated":
        return shards[0]
    if mapping.tp_split == "column":
        return torch.cat(shards, dim=0)
    if mapping.tp_split == "row":
        return torch.cat(shards, dim=1)
    gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
    return torch.cat(list(gates) + list(ups), dim=0)


def named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A megatron model's checkpoint weights: its parameters and the buffers that map to HF tensors
    (`MAPPED_BUFFERS`: DeepSeek-V3's router bias)."""
    buffers = [(n, b) for n, b in model.named_buffers() if n.endswith(MAPPED_BUFFERS)]
    return list(model.named_parameters()) + buffers
