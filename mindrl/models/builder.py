"""Build this rank's pipeline stage of the actor / reference `GPTModel`, or of the critic (the same trunk with a scalar
value head), once megatron's parallel state is initialised (`mindrl.launch.init_model_parallel`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from mindrl.config.settings import RecomputeSettings
from mindrl.models.attention import MLASDPAttention, SDPAttention
from mindrl.models.fused import SwiGLU, install_fused_rope, rms_norm, stats_dtype
from mindrl.models.hf_config import ModelSpec
from mindrl.models.mla import MLASelfAttentionTP
from mindrl.models.moe import install_fp64_routing, install_router_padding_fix
from mindrl.models.recompute import recompute_activations, transformer_config_keys
from mindrl.platform.detect import current_platform

ROLES = ("actor", "critic")


class RMSNorm(torch.nn.Module):
    """HF-exact RMSNorm (statistics in fp32, weight applied in the input dtype) that works with
    sequence parallelism: its weight is marked so that finalize_model_grads all-reduces it over TP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel
        self.fused = current_platform().eager_fused_rms_norm
        self.device_kernel = current_platform().device_rms_norm

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.fused:  # same values; a backward in five passes where torch would decompose the op (CPU)
            return rms_norm(hidden_states, self.weight, self.eps)
        if self.device_kernel:  # the device's fused kernel: keeps its input and 1/rms, not an fp32 copy
            return current_platform().rms_norm(hidden_states, self.weight, self.eps)
        x = torch.nn.functional.rms_norm(hidden_states.to(stats_dtype(hidden_states)), self.weight.shape, eps=self.eps)
        return self.weight * x.to(hidden_states.dtype)


class ValueHead(torch.nn.Module):
    """hidden -> 1 scalar per token; replicated over TP (its input is gathered first under SP).

    Stands in for GPTModel.output_layer, so it takes the same call signature."""

    def __init__(self, config):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        if config.perform_initialization:
            torch.nn.init.normal_(self.weight, std=config.init_method_std)
        self.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight), None


def layer_spec(config, sdpa: bool = True) -> ModuleSpec:
    """Megatron's local (no Transformer Engine) layer spec with mindrl's SP-capable RMSNorm (also the per-head q/k norm
    with config.qk_layernorm); core attention as one
    fused SDPA call (sdpa=False keeps megatron's DotProductAttention, the reference for parity tests); the MLP's
    SwiGLU as mindrl's fused module when config.use_te_activation_func is set (see build_model). With
    config.num_moe_experts, the layers that config.moe_layer_freq marks hold megatron's MoE layer (router + one MLP
    per expert) in place of the dense MLP."""
    dense = _one_layer_spec(config, None, sdpa)
    num_layers = get_num_layers_to_build(config)
    if config.num_moe_experts:
        moe = _one_layer_spec(config, config.num_moe_experts, sdpa)
        offset = get_transformer_layer_offset(config)
        pattern = config.moe_layer_freq
        layers = [moe if pattern[offset + i] else dense for i in range(num_layers)]
    else:
        layers = [dense] * num_layers
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm),
    )


def _one_layer_spec(config, num_experts: int | None, sdpa: bool) -> ModuleSpec:
    mla = getattr(config, "multi_latent_attention", False)
    layer = get_gpt_layer_local_spec(
        normalization="RMSNorm", num_experts=num_experts, moe_grouped_gemm=False, multi_latent_attention=mla
    )
    attention = layer.submodules.self_attention.submodules
    if mla:  # megatron's DotProductAttention takes no separate key / value widths
        layer.submodules.self_attention.module = MLASelfAttentionTP
        attention.core_attention = MLASDPAttention
    elif sdpa:
        attention.core_attention = SDPAttention
    mlps = [layer.submodules.mlp.submodules.experts.submodules] if num_experts else [layer.submodules.mlp.submodules]
    if num_experts and config.moe_shared_expert_intermediate_size:
        mlps.append(layer.submodules.mlp.submodules.shared_experts.submodules)
    if config.use_te_activation_func:  # the MLP calls this module in place of its glu (no TE module in a local spec)
        for mlp in mlps:
            mlp.activation_func = SwiGLU
    layer.submodules.input_layernorm = RMSNorm
    layer.submodules.pre_mlp_layernorm = RMSNorm
    if mla:  # the RMSNorms over the query and key/value latents (replicated over TP)
        attention.q_layernorm = RMSNorm if config.q_lora_rank else attention.q_layernorm
        attention.kv_layernorm = RMSNorm
    elif config.qk_layernorm:  # Qwen3: over each head's kv_channels; megatron sums their grads over TP by name
        layer.submodules.self_attention.submodules.q_layernorm = RMSNorm
        layer.submodules.self_attention.submodules.k_layernorm = RMSNorm
    return layer


def build_model(
    spec: ModelSpec,
    role: str = "actor",
    dtype: str | torch.dtype | None = None,
    sequence_parallel: bool = False,
    perform_initialization: bool = True,
    recompute: RecomputeSettings | None = None,
    layers_per_stage: Sequence[int] | None = None,
    **config_overrides,
) -> GPTModel:
    """This rank's stage of the model. role "actor" (also the reference) or "critic" (value head). recompute:
    activation recomputation in training (None: none); layers_per_stage: each pipeline stage's layer count
    (MindSpeed-RL's num_layer_list; None: num_layers / PP each); config_overrides: TransformerConfig keys."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {ROLES}")
    config_overrides = {**transformer_config_keys(recompute), **config_overrides}
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    # The config checks these rules when it knows the model; SFT and code-built settings learn it only here.
    problems = recompute.recompute_problems(spec.num_layers // pp) if recompute is not None else []
    if problems:
        raise ValueError(
            f"activation recomputation for {spec.num_layers} layers over {pp} pipeline stage(s): "
            + "; ".join(f"{key} {message}" for key, message in problems)
        )
    # RoPE through megatron's fusion hook: Transformer Engine's kernel where installed, else mindrl's one-pass form
    # (docs/performance.md); apply_rope_fusion=False keeps the unfused reference.
    if config_overrides.setdefault("apply_rope_fusion", True):
        install_fused_rope()
    # SwiGLU: on CPU mindrl's eager fused function as the MLP's activation module (layer_spec; megatron calls such a
    # module when use_te_activation_func is set), elsewhere megatron's bias_activation_fusion. A caller that passes
    # either flag decides alone: both False keeps megatron's unfused glu, the reference for parity tests.
    if "use_te_activation_func" not in config_overrides and "bias_activation_fusion" not in config_overrides:
        eager = current_platform().eager_fused_swiglu
        config_overrides.update(use_te_activation_func=eager, bias_activation_fusion=not eager)
    elif config_overrides.get("use_te_activation_func"):
        config_overrides.setdefault("bias_activation_fusion", False)  # megatron refuses both
    # Context parallelism from the parallel state: megatron's rotary table then keeps this rank's chunks.
    config_overrides.setdefault("context_parallel_size", ps.get_context_parallel_world_size())
    if spec.is_moe:  # each rank builds its EP rank's experts only
        config_overrides.setdefault("expert_model_parallel_size", ps.get_expert_model_parallel_world_size())
    if layers_per_stage is not None:
        config_overrides["pipeline_model_parallel_layout"] = pipeline_layout(layers_per_stage, pp, spec.num_layers)
    config = spec.transformer_config(
        tp,
        pp,
        dtype=dtype,
        sequence_parallel=sequence_parallel,
        perform_initialization=perform_initialization,
        **config_overrides,
    )
    if config.num_moe_experts:
        install_fp64_routing()
        install_router_padding_fix()
    critic = role == "critic"
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings and not critic,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
    )
    if critic and model.post_process:
        model.output_layer = ValueHead(config)
    if recompute is not None and recompute.recompute_activation_function:
        recompute_activations(model)
    if not perform_initialization:
        mark_tensor_parallel_weights(model)
    model.mindrl_role = role
    # Built on the host (use_cpu_initialization: the same initial weights on every platform), computed on this
    # rank's device: megatron's DDP puts its grad buffers there and every collective of nccl / hccl needs it.
    return model.to(current_platform().device())


def pipeline_layout(layers_per_stage: Sequence[int], pp: int, num_layers: int) -> list[list[str]]:
    """megatron's pipeline_model_parallel_layout for stages of these layer counts: the embedding on the first, the
    output layer and loss on the last."""
    counts = [int(n) for n in layers_per_stage]
    if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"layers per pipeline stage {counts}: need PP={pp} counts >= 1 summing to {num_layers}")
    stages = [["decoder"] * n for n in counts]
    stages[0].insert(0, "embedding")
    stages[-1].append("loss")
    return stages


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Megatron marks a TP-sharded weight (`tensor_model_parallel`, `partition_dim`) only while it initialises
    it; a model built to be loaded from a checkpoint would otherwise count each shard as a replicated copy,
    and the grad norm (and so gradient clipping) would see only TP rank 0's shards."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    for module in model.modules():
        if isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            weight.tensor_model_parallel = True
            weight.partition_dim = dim
            weight.partition_stride = 1
