"""LoRA adapters on megatron-core's tensor-parallel linears: y = W x + (alpha / r) B A x, with W frozen and only A, B
trained, sharded as the base layer is (column-parallel: B split on the output; row-parallel: A split on the input).

An adapter is a pair of child modules (`lora_A`, `lora_B`) of the linear it adapts, added to its output by a forward
hook, so the backbone keeps its parameter names (checkpoints and the HF weight map are unchanged) and the adapters can
be switched off for a reference pass on the same weights (`adapters_disabled`). A fused megatron linear has one adapter:
linear_qkv's A is the one A of HF's q_proj / k_proj / v_proj adapters (a PEFT adapter with equal A's), its B their B's
in megatron's query-group layout; linear_fc1 likewise over gate_proj / up_proj."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from mindrl.config.settings import LORA_TARGETS
from mindrl.models.hf_config import ModelSpec
from mindrl.models.weight_map import ParamMapping, param_mapping

TARGETS = LORA_TARGETS
_COLUMN = ("linear_qkv", "linear_fc1")
# Where each target sits in a layer, for its base weight's HF mapping.
_PARENT = {
    "linear_qkv": "self_attention",
    "linear_proj": "self_attention",
    "linear_fc1": "mlp",
    "linear_fc2": "mlp",
}


class LoRAError(ValueError):
    """A LoRA setting or adapter that cannot be applied to this model."""


class LoRAAdapter(torch.nn.Module):
    """The low-rank pair of one parallel linear: lora_A (r x in) and lora_B (out x r), each this TP rank's shard
    where the base layer's matching dimension is split. `enabled` False makes the base layer's output its own."""

    def __init__(
        self, base: torch.nn.Module, r: int, alpha: float, column: bool, dtype: torch.dtype, sequence_parallel: bool
    ) -> None:
        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        out_features = base.weight.shape[0]
        in_features = base.weight.shape[1]
        self.column = column
        self.sequence_parallel = sequence_parallel and tp > 1
        self.scale = alpha / r
        self.enabled = True
        self.gated = False  # linear_fc1 of a gated MLP: B's shard is [gate; up] (set by apply_lora)
        self.lora_A = torch.nn.Linear(in_features, r, bias=False, dtype=dtype, device=base.weight.device)
        self.lora_B = torch.nn.Linear(r, out_features, bias=False, dtype=dtype, device=base.weight.device)
        torch.nn.init.zeros_(self.lora_B.weight)
        # Sharded tensors say so, as megatron's own do: the grad norm counts a replicated tensor once, a shard on
        # every TP rank.
        split = self.lora_B.weight if column else self.lora_A.weight
        if tp > 1:
            split.tensor_model_parallel = True
            split.partition_dim = 0 if column else 1
            split.partition_stride = 1
        if self.sequence_parallel:
            # The whole matrix on every rank, but each rank's gradient covers only its part of the sequence:
            # finalize_model_grads sums such params over TP (as it does the norms').
            (self.lora_A if column else self.lora_B).weight.sequence_parallel = True

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """scale * B A x for this rank's part of the base layer's output."""
        z = torch.nn.functional.linear(x, self.lora_A.weight)
        if self.sequence_parallel:
            # Column: x is this rank's part of the sequence; z is all-gathered r wide, and its gradient, each rank's
            # part from its B shard, reduce-scattered back. Row: z is a partial sum over the full sequence,
            # reduce-scattered to this rank's part, where the base layer's output is.
            if self.column:
                z = gather_from_sequence_parallel_region(z, tensor_parallel_output_grad=True)
            else:
                z = reduce_scatter_to_sequence_parallel_region(z)
        elif self.column:
            # Every rank holds all of A: z's gradient is each rank's part from its B shard, summed here (r wide,
            # where summing x's gradient would be hidden wide).
            z = copy_to_tensor_model_parallel_region(z)
        else:
            # Each rank's A covers its slice of the input: z is a partial sum, completed before B (all of B on every
            # rank, so B's gradient is whole and equal on every rank).
            z = reduce_from_tensor_model_parallel_region(z)
        return torch.nn.functional.linear(z, self.lora_B.weight) * self.scale


def _add_delta(module: torch.nn.Module, args: tuple, kwargs: dict, output):
    adapter = module.lora
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter.delta(x).to(out.dtype), bias


def _sharded_state_dict(module: torch.nn.Module, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
    """The parallel linear's own dist-checkpoint entries, with its adapter's TP split declared: megatron's would save
    the adapter as one replicated tensor, keeping a single rank's shard of the split matrix."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    out = type(module).sharded_state_dict(module, prefix, sharded_offsets, metadata)
    adapter = module.lora
    state = {"lora.lora_A.weight": adapter.lora_A.weight, "lora.lora_B.weight": adapter.lora_B.weight}
    axis = {"lora.lora_B.weight": 0} if adapter.column else {"lora.lora_A.weight": 1}
    sharded = make_sharded_tensors_for_checkpoint(
        state, prefix, axis, sharded_offsets, tp_group=module.tp_group, dp_cp_group=metadata["dp_cp_group"]
    )
    if adapter.gated:  # [gate; up] shards on each rank, as the MLP declares for linear_fc1's weight
        key = f"{prefix}lora.lora_B.weight"
        singleton = metadata.get("singleton_local_shards", False)
        sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets, singleton)
    out.update(sharded)
    return out


def _input_requires_grad(module, args, output):
    # A frozen embedding gives activations that need no grad; activation checkpointing (megatron's autograd
    # Function) then drops the adapters' grads of every layer it wraps. The first stage's hidden states ask for one.
    return output.requires_grad_(True) if torch.is_grad_enabled() else output


def init_adapter_A(name: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """The whole (TP=1) initial A of the adapter with global name `name`: PEFT's default (kaiming-uniform, a=sqrt(5)),
    from a generator seeded by the seed and the name, so every layout starts from the same adapters."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + sum(ord(c) * 31**i for i, c in enumerate(name)) % 2**31)
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) on an (r, in) matrix
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def apply_lora(
    model: torch.nn.Module, r: int, alpha: float, targets: list[str] | tuple[str, ...], seed: int = 1234
) -> list[str]:
    """Freeze `model` (this rank's stage of a GPTModel) and add an adapter to each target linear of its layers.
    Returns the adapted linears' local names. The adapters start as a zero update (B = 0; A seeded per global name,
    the same at every TP / PP layout)."""
    from mindrl.models.wrappers import unwrap

    gpt = unwrap(model)
    config = gpt.config
    if r < 1:
        raise LoRAError(f"lora_r must be >= 1, got {r}")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise LoRAError(f"lora_target_modules {list(targets)}: each must be one of {', '.join(TARGETS)}")
    if config.num_moe_experts:
        raise LoRAError("LoRA on a mixture-of-experts model is not implemented")
    for p in gpt.parameters():
        p.requires_grad_(False)
    offset = get_transformer_layer_offset(config)
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    adapted = []
    for name, module in gpt.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets:
            continue
        column = leaf in _COLUMN
        want = ColumnParallelLinear if column else RowParallelLinear
        if not isinstance(module, want) or (column and module.gather_output):
            raise LoRAError(f"{name} is a {type(module).__name__}; LoRA adapts megatron's {want.__name__} here")
        adapter = LoRAAdapter(module, r, alpha, column, config.params_dtype, config.sequence_parallel)
        full_in = module.weight.shape[1] * (1 if column else tp)
        a = init_adapter_A(_global(name, offset) + ".lora_A.weight", (r, full_in), seed)
        with torch.no_grad():
            adapter.lora_A.weight.copy_(a if column else a.chunk(tp, dim=1)[tp_rank])
        adapter.gated = leaf == "linear_fc1" and config.gated_linear_unit
        module.lora = adapter
        module.register_forward_hook(_add_delta, with_kwargs=True)
        module.sharded_state_dict = functools.partial(_sharded_state_dict, module)
        adapted.append(name)
    if not adapted:
        raise LoRAError(f"no linear of this stage is named {list(targets)}")
    if getattr(gpt, "pre_process", False) and hasattr(gpt, "embedding"):
        gpt.embedding.register_forward_hook(_input_requires_grad)
    return adapted


def _global(local_name: str, offset: int) -> str:
    from mindrl.models.weight_map import global_name

    return global_name(local_name, offset)


def adapters(model: torch.nn.Module) -> Iterator[LoRAAdapter]:
    for module in model.modules():
        if isinstance(module, LoRAAdapter):
            yield module


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The backbone alone inside the block (the shared-backbone reference model), the adapters back after it."""
    found = list(adapters(model))
    before = [a.enabled for a in found]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a, was in zip(found, before):
            a.enabled = was


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of W + scale * B A for each adapted linear, by local megatron weight name (the layout of the
    base weight's shard, so the HF weight map and the reshard take it as they take W): what an inference engine without
    LoRA layers runs. Column-parallel: B's shard times all of A; row-parallel: all of B times A's shard. Computed in
    fp32 and returned in W's dtype; no communication."""
    from mindrl.models.wrappers import unwrap

    return {name: merged_weight(module) for name, module in adapted_linears(unwrap(model)).items()}


def adapted_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Local weight name (`...linear_qkv.weight`) -> the adapted linear, for each linear with an adapter."""
    return {
        f"{name}.weight": module
        for name, module in model.named_modules()
        if isinstance(getattr(module, "lora", None), LoRAAdapter)
    }


@torch.no_grad()
def merged_weight(module: torch.nn.Module) -> torch.Tensor:
    """One adapted linear's W + scale * B A (this rank's shard, W's dtype; computed in fp32): a new tensor."""
    adapter, w = module.lora, module.weight
    # The reshard's merge buffer: W's fp32 copy, B A added into it in place, then (a 16-bit W) the result in W's dtype;
    # with A and B's fp32 copies, what mindrl.plan.memory.merge_buffer_bytes counts.
    merged = w.to(torch.float32, copy=True)
    merged.addmm_(adapter.lora_B.weight.float(), adapter.lora_A.weight.float(), alpha=adapter.scale)
    return merged.to(w.dtype)


def lora_meta(model: torch.nn.Module) -> dict | None:
    """The adapters' settings as a checkpoint records them ({lora_r, lora_alpha, lora_target_modules}), None
    without adapters: what `apply_lora` needs to rebuild the model the checkpoint was saved from."""
    from mindrl.models.wrappers import unwrap

    found = {name.rsplit(".", 1)[0].rsplit(".", 1)[-1]: m.lora for name, m in adapted_linears(unwrap(model)).items()}
    if not found:
        return None
    any_ = next(iter(found.values()))
    r = any_.lora_A.weight.shape[0]
    return {
        "lora_r": r,
        "lora_alpha": any_.scale * r,
        "lora_target_modules": [t for t in TARGETS if t in found],
    }


def is_adapter_param(name: str) -> bool:
    return ".lora.lora_A." in name or ".lora.lora_B." in name


# ------------------------------------------------------------------------- megatron <-> PEFT names and layouts
def adapter_mapping(spec: ModelSpec, mcore_name: str) -> tuple[ParamMapping, str]:
    """(mapping, matrix) of an adapter parameter with a global megatron name such as
    `decoder.layers.3.self_attention.linear_qkv.lora.lora_B.weight`: its HF (PEFT) names, how its TP shards are
    split, and "A" or "B". B of a column-parallel linear follows the base weight's layout and split (query groups,
    gate/up); A of a row-parallel linear is split on its input; the other is whole on every rank."""
    head, sep, tail = mcore_name.partition(".lora.lora_")
    if not sep or tail not in ("A.weight", "B.weight"):
        raise KeyError(f"{mcore_name!r} is not a LoRA adapter parameter")
    matrix = tail[0]
    base = param_mapping(spec, head + ".weight")
    column = head.rsplit(".", 1)[-1] in _COLUMN
    hf = tuple(n.removesuffix(".weight") + f".lora_{matrix}.weight" for n in base.hf_names)
    if matrix == "B":
        split = base.tp_split if column else "replicated"
    else:
        split = "replicated" if column else "row"
    return ParamMapping(mcore_name, hf, split), matrix


def adapter_names(spec: ModelSpec, targets: list[str] | tuple[str, ...]) -> list[str]:
    """Global megatron names of every adapter parameter of the whole model."""
    return [
        f"decoder.layers.{i}.{_PARENT[t]}.{t}.lora.lora_{m}.weight"
        for i in range(spec.num_layers)
        for t in TARGETS
        if t in targets
        for m in "AB"
    ]


def adapter_shape(spec: ModelSpec, mcore_name: str, r: int) -> tuple[int, int]:
    """The whole (TP=1) shape of an adapter matrix: A (r, in), B (out, r) of its base linear."""
    mapping, matrix = adapter_mapping(spec, mcore_name)
    target = mcore_name.partition(".lora.lora_")[0].rsplit(".", 1)[-1]
    q, kv, h, ffn = (
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
        spec.hidden_size,
        spec.ffn_hidden_size,
    )
    out_in = {"linear_qkv": (q + 2 * kv, h), "linear_proj": (h, q), "linear_fc1": (2 * ffn, h), "linear_fc2": (h, ffn)}
    out, inp = out_in[target]
    return (r, inp) if matrix == "A" else (out, r)


def full_to_peft(spec: ModelSpec, mcore_name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A whole (TP=1) adapter matrix -> its PEFT tensors (HF module names, `lora_A.weight` / `lora_B.weight`): a fused
    linear's A repeated for each HF projection, its B split as the base weight is."""
    from mindrl.models.weight_map import full_to_hf

    mapping, matrix = adapter_mapping(spec, mcore_name)
    if matrix == "A":
        return [(n, full) for n in mapping.hf_names]
    base = param_mapping(spec, mcore_name.partition(".lora.lora_")[0] + ".weight")
    return [(n, t) for n, (_, t) in zip(mapping.hf_names, full_to_hf(spec, base, full))]


def peft_to_full(spec: ModelSpec, mcore_name: str, tensors: list[torch.Tensor], source: str = "") -> torch.Tensor:
    """PEFT tensors (in adapter_mapping's hf_names order) -> the whole megatron adapter matrix. A fused linear has one
    A: a PEFT adapter whose q/k/v (gate/up) A's differ cannot load into it and is refused, naming them."""
    from mindrl.models.weight_map import hf_to_full

    mapping, matrix = adapter_mapping(spec, mcore_name)
    if matrix == "A":
        first = tensors[0]
        for n, t in zip(mapping.hf_names[1:], tensors[1:]):
            if not torch.equal(t, first):
                raise LoRAError(
                    f"{source}{n} differs from {mapping.hf_names[0]}: megatron's fused {mcore_name.split('.lora.')[0]} "
                    "has one A for all of its projections, so their adapters must share it"
                )
        return first
    base = param_mapping(spec, mcore_name.partition(".lora.lora_")[0] + ".weight")
    return hf_to_full(spec, base, tensors)
