"""Parameter counts of the models mindrl builds (megatron-core `GPTModel` with mindrl's local layer spec, see
`mindrl.models.builder`), per tensor-parallel rank and pipeline stage, from the config's architecture alone."""

from __future__ import annotations

from dataclasses import dataclass

from mindrl.config.model import ModelArchConfig


class PlanError(ValueError):
    """The planner cannot estimate this config; the message names the key that is missing."""


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank holds: its share of the embedding, of its stage's layers, the final norm and the
    output layer (the LM head, its tied copy on the last stage under PP, or the critic's value head)."""

    embedding: int
    layers: int
    final_norm: int
    output: int
    experts: int = 0
    """Of `layers`, the routed experts' weights (a MoE model): their grads reduce, and a distributed optimizer
    shards their state, over the expert data-parallel ranks (DP x CP / EP) instead of DP."""

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.final_norm + self.output


def _vocab(arch: ModelArchConfig) -> int:
    if not arch.padded_vocab_size:
        raise PlanError(f"model.{arch.name}.padded_vocab_size is not set: the planner needs the vocabulary size")
    return int(arch.padded_vocab_size)


def expert_params(arch: ModelArchConfig, tp: int, ep: int) -> int:
    """One MoE layer's routed experts on one TP x EP rank: num_experts / EP SwiGLU experts of moe_ffn_hidden_size,
    each split over TP as the dense MLP (0 for a dense model)."""
    if not arch.is_moe:
        return 0
    h, f = int(arch.hidden_size), arch.expert_ffn_size
    return int(arch.num_experts) // ep * ((2 * f // tp) * h + h * (f // tp))


def layer_params(arch: ModelArchConfig, tp: int, ep: int = 1) -> int:
    """One transformer layer on one TP rank: two RMSNorm weights (replicated), the column-parallel QKV
    projection (query heads + 2 x KV heads of head_dim = kv_channels, with its bias if add_qkv_bias), the q and k
    RMSNorms over head_dim with qk_layernorm (replicated), the row-parallel output projection, the column-parallel
    gate+up projection (2 x ffn) and the row-parallel down projection (no linear biases). A MoE model's layer has
    instead of that MLP its router (num_experts x hidden, replicated) and its EP rank's experts (`expert_params`)."""
    h, d, f = int(arch.hidden_size), arch.head_dim, arch.ffn_size
    qkv_out = (int(arch.num_attention_heads) + 2 * arch.num_kv_heads) * d // tp
    qkv = qkv_out * h + (qkv_out if arch.add_qkv_bias else 0)
    proj = h * int(arch.num_attention_heads) * d // tp
    mlp = (2 * f // tp) * h + h * (f // tp)
    if arch.is_moe:
        mlp = int(arch.num_experts) * h + expert_params(arch, tp, ep)
    qk_norm = 2 * d if arch.qk_layernorm else 0
    return 2 * h + qkv + qk_norm + proj + mlp


def adapter_params(arch: ModelArchConfig, targets: list[str] | None, r: int, tp: int, pp: int = 1) -> int:
    """LoRA adapters one TP rank of a pipeline stage holds (`mindrl.models.lora`): per layer and target, A (r x in)
    and B (out x r), each split over TP where the base layer splits that side (column-parallel: B's rows; row-parallel:
    A's columns), whole on every rank otherwise."""
    if not targets:
        return 0
    h, d, f = int(arch.hidden_size), arch.head_dim, arch.ffn_size
    q, qkv = int(arch.num_attention_heads) * d, (int(arch.num_attention_heads) + 2 * arch.num_kv_heads) * d
    per_target = {
        "linear_qkv": r * h + qkv // tp * r,
        "linear_proj": r * (q // tp) + h * r,
        "linear_fc1": r * h + 2 * f // tp * r,
        "linear_fc2": r * (f // tp) + h * r,
    }
    return int(arch.num_layers) // pp * sum(per_target[t] for t in targets)


def stage_layers(arch: ModelArchConfig, pp: int, pp_rank: int) -> int:
    """The real layers of pipeline stage `pp_rank`: num_layers / PP, less its noop_layers (MindSpeed's identity
    layers, which pad num_layers to a multiple of PP and hold nothing)."""
    per = int(arch.num_layers) // pp
    first = pp_rank * per
    return per - sum(first <= i < first + per for i in arch.noop_layer_indices)


def stage_params(arch: ModelArchConfig, role: str, tp: int, pp: int, pp_rank: int, ep: int = 1) -> StageParams:
    """What one TP (x EP) rank of pipeline stage `pp_rank` holds. role: 'actor' (also the reference and the rollout
    engine) or 'critic' (the trunk with a 1 x hidden value head, replicated over TP, instead of the LM head)."""
    h, v = int(arch.hidden_size), _vocab(arch)
    first, last = pp_rank == 0, pp_rank == pp - 1
    tied = not arch.untie_embeddings_and_output_weights and role != "critic"
    if role == "critic":
        output = h if last else 0
    elif not last or (tied and pp == 1):  # tied at PP=1: the head reuses the embedding
        output = 0
    else:
        output = v // tp * h  # untied head, or the tied copy megatron keeps on the last stage
    return StageParams(
        embedding=v // tp * h if first else 0,
        layers=stage_layers(arch, pp, pp_rank) * layer_params(arch, tp, ep),
        final_norm=h if last else 0,
        output=output,
        experts=stage_layers(arch, pp, pp_rank) * expert_params(arch, tp, ep),
    )


def total_params(arch: ModelArchConfig, role: str = "actor") -> int:
    """The whole model's parameters (TP = PP = 1)."""
    return stage_params(arch, role, 1, 1, 0).total
