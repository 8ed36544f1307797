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


def attention_params(arch: ModelArchConfig, tp: int) -> int:
    """One layer's attention on one TP rank. Standard: the column-parallel QKV projection (query heads + 2 x KV heads
    of head_dim = kv_channels, with its bias if add_qkv_bias), the q and k RMSNorms over head_dim with qk_layernorm
    (replicated), the row-parallel output projection. MLA (megatron's MLASelfAttention, every projection column-
    parallel): the query down projection (hidden -> q_lora_rank) and its RMSNorm, the up projection (q_lora_rank ->
    heads x (qk_head_dim + qk_pos_emb_head_dim); or one hidden -> that projection without q_lora_rank), the key/value
    down projection (hidden -> kv_lora_rank + qk_pos_emb_head_dim) and its RMSNorm over kv_lora_rank, the up
    projection (kv_lora_rank -> heads x (qk_head_dim + v_head_dim)), the output projection (heads x v_head_dim ->
    hidden)."""
    h, a = int(arch.hidden_size), int(arch.num_attention_heads)
    if arch.multi_latent_attention:
        q_head, rope, v = arch.head_dim, int(arch.qk_pos_emb_head_dim), int(arch.v_head_dim)
        kv_rank, q_rank = int(arch.kv_lora_rank), int(arch.q_lora_rank or 0)
        q = (h * q_rank // tp + q_rank + q_rank * a * q_head // tp) if q_rank else h * a * q_head // tp
        kv = h * (kv_rank + rope) // tp + kv_rank + kv_rank * a * (int(arch.qk_head_dim) + v) // tp
        return q + kv + h * a * v // tp
    d = arch.head_dim
    qkv_out = (a + 2 * arch.num_kv_heads) * d // tp
    qkv = qkv_out * h + (qkv_out if arch.add_qkv_bias else 0)
    qk_norm = 2 * d if arch.qk_layernorm else 0
    return qkv + qk_norm + h * a * d // tp


def layer_params(arch: ModelArchConfig, tp: int, ep: int = 1, moe: bool | None = None) -> int:
    """One transformer layer on one TP rank: two RMSNorm weights (replicated), the attention (`attention_params`), the
    column-parallel gate+up projection (2 x ffn) and the row-parallel down projection (no linear biases). A MoE layer
    (moe; None: whether the model is a MoE model) has instead of that MLP its router (num_experts x hidden,
    replicated; DeepSeek-V3's correction bias is a buffer, not a parameter), its EP rank's experts (`expert_params`)
    and the shared expert (a SwiGLU of shared_expert_ffn_size split over TP as the dense MLP)."""
    h, f = int(arch.hidden_size), arch.ffn_size
    mlp = (2 * f // tp) * h + h * (f // tp)
    if arch.is_moe if moe is None else moe:
        fs = arch.shared_expert_ffn_size
        mlp = int(arch.num_experts) * h + expert_params(arch, tp, ep) + (2 * fs // tp) * h + h * (fs // tp)
    return 2 * h + attention_params(arch, tp) + mlp


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


def stage_layer_indices(arch: ModelArchConfig, pp: int, pp_rank: int, counts: list[int] | None = None) -> list[int]:
    """The global indices of pipeline stage `pp_rank`'s real layers: num_layers / PP of them (counts: each stage's
    layer count, num_layer_list's uneven split), less its noop_layers (MindSpeed's identity layers, which pad
    num_layers to a multiple of PP and hold nothing)."""
    counts = counts or [int(arch.num_layers) // pp] * pp
    first = sum(counts[:pp_rank])
    noop = set(arch.noop_layer_indices)
    return [i for i in range(first, first + counts[pp_rank]) if i not in noop]


def stage_layers(arch: ModelArchConfig, pp: int, pp_rank: int, counts: list[int] | None = None) -> int:
    """The number of real layers of pipeline stage `pp_rank` (`stage_layer_indices`)."""
    return len(stage_layer_indices(arch, pp, pp_rank, counts))


def stage_params(
    arch: ModelArchConfig, role: str, tp: int, pp: int, pp_rank: int, ep: int = 1, counts: list[int] | None = None
) -> StageParams:
    """What one TP (x EP) rank of pipeline stage `pp_rank` holds. role: 'actor' (also the reference and the rollout
    engine) or 'critic' (the trunk with a 1 x hidden value head, replicated over TP, instead of the LM head); counts:
    the stages' layer counts of an uneven split (num_layer_list)."""
    h, v = int(arch.hidden_size), _vocab(arch)
    first, last = pp_rank == 0, pp_rank == pp - 1
    layers = stage_layer_indices(arch, pp, pp_rank, counts)
    tied = not arch.untie_embeddings_and_output_weights and role != "critic"
    if role == "critic":
        output = h if last else 0
    elif not last or (tied and pp == 1):  # tied at PP=1: the head reuses the embedding
        output = 0
    else:
        output = v // tp * h  # untied head, or the tied copy megatron keeps on the last stage
    return StageParams(
        embedding=v // tp * h if first else 0,
        layers=sum(layer_params(arch, tp, ep, arch.is_moe_layer(i)) for i in layers),
        final_norm=h if last else 0,
        output=output,
        experts=sum(arch.is_moe_layer(i) for i in layers) * expert_params(arch, tp, ep),
    )


def total_params(arch: ModelArchConfig, role: str = "actor") -> int:
    """The whole model's parameters (TP = PP = 1)."""
    return stage_params(arch, role, 1, 1, 0).total
