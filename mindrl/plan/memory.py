"""Per-device memory formulas: training state (megatron's accounting), activations (Korthikanti et al. 2022,
adapted to these decoders) and the rollout engine's weights and KV cache. Every function returns bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mindrl.config.model import ModelArchConfig
from mindrl.config.settings import RecomputeSettings

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GRAD_BYTES = 4
"""mindrl's DDP reduces gradients in fp32 (grad_reduce_in_fp32): a 4-byte main_grad per parameter."""
KV_BLOCK = 16
"""vLLM's KV-cache block size in tokens: a sequence occupies whole blocks."""


def micro_batch_shape(
    seq: int, rows: int, token_budget: int | None = None, max_rows: int | None = None, packed: bool = False
) -> tuple[int, int]:
    """(s, b) of the largest micro-batch the model runs on (mindrl.workers.rl_model.MicroBatching), for rows of up
    to `seq` tokens: `rows` rows of seq tokens; with a token budget, as many as it holds (at least one, at most
    max_rows): padded, whole rows of seq tokens; packed, the budget's tokens, counted as rows of seq tokens (ceil).
    A packed row attends row by row (mindrl.models.packing.RowAttention), so its attention terms are those of
    padded rows, not of one s x s row."""
    if token_budget is None:
        return seq, rows
    cap = max_rows or token_budget
    if packed:
        return seq, max(1, -(-min(token_budget, cap * seq) // seq))
    return seq, max(1, min(cap, token_budget // seq))


def micro_batches(rows: int, seq: int, shape: tuple[int, int]) -> int:
    """Micro-batches of `shape` (`micro_batch_shape`) that `rows` rows of up to `seq` tokens take, at least."""
    s, b = shape
    return max(1, -(-rows * seq // (s * b)))


def optimizer_bytes_per_param(dtype: str) -> int:
    """Megatron's Adam state per parameter: two fp32 moments, plus an fp32 master copy of 16-bit weights
    (Float16OptimizerWithFloat16Params); fp32 weights are their own master (FP32Optimizer)."""
    return 8 if dtype == "float32" else 12


def optimizer_bytes(params: int, dtype: str, distributed: bool, dp: int) -> int:
    """Optimizer state of one rank; the distributed optimizer shards it over the DP ranks."""
    total = params * optimizer_bytes_per_param(dtype)
    return math.ceil(total / dp) if distributed else total


@dataclass(frozen=True)
class KernelPath:
    """What a platform's kernels keep for backward (the answers of mindrl.platform's Platform classes), for the
    activation terms below."""

    norm: str = "torch"
    """RMSNorm: "torch" (rms_norm under autograd on an fp32 copy), "eager_fused" (mindrl's fused function, CPU) or
    "device" (the device's fused kernel: its e-byte input and an fp32 1/rms per token)."""
    attention_fp32_operands: bool = True
    """A 16-bit model's q, k, v cast to fp32 for the softmax, and the fp32 copies kept (CPU); else the kernel takes
    the 16-bit operands and keeps its softmax in fp32 inside (flash kernels on devices)."""
    attention_grouped_kv: bool = False
    """The kernel reads grouped K/V heads in place (NPU); else it keeps K and V expanded to the query heads."""
    softmax_stats_bytes: int = 4
    """fp32 softmax statistics kept per query token and head: a logsumexp (4), or the NPU kernel's max and sum of
    8 floats each (64)."""
    mask_bytes: int | None = 4
    """Bytes per element of the [b, 1, s, s] padding mask a layer keeps: SDPA's fp32 copy (CPU), None for the
    model's e bytes (CUDA's SDPA converts it to the operands' dtype), 0 where the kernel reads the caller's bool mask
    (NPU)."""
    gemm_attention_max_len: int = 0
    """Sequences up to this length run as batched GEMMs that keep the softmax (CPU, `gemm_attention_max_len`)."""


CPU_PATH = KernelPath(norm="eager_fused")
CUDA_PATH = KernelPath(attention_fp32_operands=False, mask_bytes=None)
NPU_PATH = KernelPath(
    norm="device", attention_fp32_operands=False, attention_grouped_kv=True, softmax_stats_bytes=64, mask_bytes=0
)


def norm_activation_bytes(
    arch: ModelArchConfig, s: int, b: int, tp: int, sp: bool, e: int, fused_norm: bool | str = False
) -> int:
    """One RMSNorm (statistics in fp32, see mindrl.models.builder) and its output (the next linear's input):
    torch's rms_norm under autograd keeps the fp32 input and the normalised e-byte copy, s b h' (4 + 2e) bytes;
    mindrl's eager fused one (fused_norm, on CPU) only the fp32 normalised rows, s b h' (4 + e), and in 16 bits its
    e-byte input and 1/rms in fp32 (its bf16 kernel), as a device's fused kernel (fused_norm="device") does:
    s b (2 e h' + 4)."""
    h = int(arch.hidden_size)
    h_local = h // tp if sp and tp > 1 else h
    if fused_norm == "device" or (fused_norm and e < 4):
        return s * b * (2 * e * h_local + 4)
    return s * b * h_local * (4 + e + (0 if fused_norm else e))


def layer_activation_bytes(
    arch: ModelArchConfig, s: int, b: int, tp: int, sp: bool, e: int, fused_norm: bool = False,
    gemm_attention: bool = False, path: KernelPath | None = None, cp: int = 1,
) -> int:  # fmt: skip
    """What autograd keeps for one transformer layer's backward, for a micro-batch of b sequences of s tokens.

    Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models", count
    sbh(34 + 5as/h) bytes per layer for GPT-3 (16-bit, GeLU MLP of 4h, dropout masks, an s x s softmax). The same
    accounting for the layers mindrl builds (megatron's local spec with a fused SDPA core attention, see
    mindrl.models.attention; no dropout; SwiGLU MLP of size F; a query heads, g KV heads of size d, expanded to a
    for the attention):
        two RMSNorms (fp32 input, normalised copy, output)   2 s b h' (4 + 2e)     (h' = h/t with SP; 4 + e fused)
        SDPA's Q, K, V (expanded) and output, in fp32         4 s b 4 a d / t      (attention_softmax_in_fp32)
        the attention context (output projection input)      e s b a d / t         (the fp32 output itself if e = 4)
        gate+up output (the fused SwiGLU's input), its output e s b 3 F / t
        SDPA's logsumexp and its copy of the mask (fp32)     4 a s b / t + 4 b s^2
    No s x s score or softmax tensor is kept (the fused kernel recomputes them in backward): the only s^2 term
    is the padding mask, without a head dimension. With gemm_attention (short sequences on CPU,
    mindrl.models.attention.GemmAttention) the attention keeps instead
        Q (fp32), K and V (not expanded, fp32)                s b (4 a + 8 g) d / t
        the attention context (output projection input)      e s b a d / t
        the softmax (fp32)                                    4 a b s^2 / t
    On a device whose kernel takes 16-bit operands (`path`, see `KernelPath`) the attention keeps instead
        q, K, V (grouped, or expanded to a heads), output, context   e s b (3 a + 2 kv) d / t
        the kernel's fp32 softmax statistics                          stats a s b / t
        its copy of the padding mask                                  mask b s^2
    and a device RMSNorm kernel keeps its input and 1/rms (see `norm_activation_bytes`).
    The tests compare this with the bytes autograd really saves in the tiny model (tests/plan).
    """
    context = s * b * arch.head_dim * int(arch.num_attention_heads) * e // tp
    if _output_is_context(path, e, gemm_attention):
        context = 0  # the projection's input is SDPA's fp32 output, counted with the attention
    mlp = s * b * 3 * arch.token_ffn_size * e // tp + moe_dispatch_bytes(arch, s, b, tp, e)
    attention = core_attention_bytes(arch, s, b, tp, e, gemm_attention, path, cp)
    return 2 * norm_activation_bytes(arch, s, b, tp, sp, e, _norm(fused_norm, path)) + attention + context + mlp


def moe_dispatch_bytes(arch: ModelArchConfig, s: int, b: int, tp: int, e: int) -> int:
    """What a MoE layer keeps besides its experts' activations: each token's k copies, permuted for the all-to-all
    and received from it (e s b k h / t each, over the TP ranks' sequence shards), and the router's fp32 logits and
    probabilities (8 s b E / t). 0 for a dense model."""
    if not arch.is_moe:
        return 0
    k, h = arch.moe_router_topk, int(arch.hidden_size)
    return (2 * e * s * b * k * h + 8 * s * b * int(arch.num_experts)) // tp


def logits_bytes(arch: ModelArchConfig, s: int, b: int, tp: int, e: int) -> int:
    """The loss's fp32 softmax over the vocab-parallel logits, s b V/t x 4 bytes (the e-byte logits are cast
    to fp32 and not kept; `e` is accepted for symmetry with the other terms)."""
    return s * b * (int(arch.padded_vocab_size) // tp) * 4


FULL_RECOMPUTE = RecomputeSettings("full", "uniform", 1)
"""Every layer recomputed on its own: the least a full recomputation keeps (the planner's alternative figure)."""


def _norm(fused_norm: bool | str, path: KernelPath | None) -> bool | str:
    return "device" if path is not None and path.norm == "device" else fused_norm


def _device_attention(path: KernelPath | None, e: int, gemm_attention: bool) -> bool:
    """Whether the attention terms are a device kernel's on its own e-byte operands (see layer_activation_bytes)."""
    return not gemm_attention and path is not None and not (path.attention_fp32_operands and e < 4)


def _output_is_context(path: KernelPath | None, e: int, gemm_attention: bool) -> bool:
    """Whether SDPA's fp32 output is itself the output projection's input (an fp32 model on the CPU's SDPA path)."""
    return e == 4 and not gemm_attention and not _device_attention(path, e, gemm_attention)


def core_attention_bytes(
    arch: ModelArchConfig, s: int, b: int, tp: int, e: int, gemm_attention: bool = False, path: KernelPath | None = None,
    cp: int = 1,
) -> int:  # fmt: skip
    """What core attention alone keeps for backward, i.e. what selective recomputation does not keep (it keeps the
    attention's inputs instead, `selective_kept_bytes`) and rebuilds for one layer at a time in backward: the
    attention terms of `layer_activation_bytes` but the context, which the output projection keeps either way.
    Under context parallelism (cp > 1) s is the rank's query columns and the keys are all k = cp s (gathered K, V;
    the mask and scores are s x k)."""
    d, a, g = arch.head_dim, int(arch.num_attention_heads), arch.num_kv_heads
    k = s * cp
    if gemm_attention:  # Q, K, V in fp32 (an extra copy when e < 4), the fp32 softmax
        return (s * 4 * a + k * 8 * g) * b * d // tp + 4 * a * b * s * k // tp
    if _device_attention(path, e, gemm_attention):  # q, K, V (grouped or expanded), output; statistics, mask
        kv = g if path.attention_grouped_kv else a
        mask = e if path.mask_bytes is None else path.mask_bytes
        qkv = (s * 2 * a + k * 2 * kv) * b * d * e // tp
        return qkv + path.softmax_stats_bytes * a * s * b // tp + mask * b * s * k
    return (s + k) * b * 8 * a * d // tp + 4 * a * s * b // tp + 4 * b * s * k  # fp32 Q, K, V, output; lse, mask


def selective_kept_bytes(
    arch: ModelArchConfig, s: int, b: int, tp: int, e: int, gemm_attention: bool = False, path: KernelPath | None = None
) -> int:
    """What a layer keeps for its recomputed core attention: the checkpoint's inputs, Q and K after RoPE and V, e
    bytes (V is a view of the fused QKV projection's output, which it keeps whole); and SDPA's fp32 output when it is
    the context (CPU path, e = 4), now kept by the output projection alone (otherwise a term of
    `layer_activation_bytes`)."""
    d, a, g = arch.head_dim, int(arch.num_attention_heads), arch.num_kv_heads
    fp32_context = _output_is_context(path, e, gemm_attention)
    return s * b * (2 * a + 3 * g) * d * e // tp + (s * b * a * d * e // tp if fp32_context else 0)


def activation_output_bytes(arch: ModelArchConfig, s: int, b: int, tp: int, e: int) -> int:
    """The MLP's activation output (the second linear layer's input), s b F/t e bytes: not kept under
    recompute_activation_function, rebuilt for one layer at a time in backward."""
    return s * b * arch.token_ffn_size * e // tp


def recomputed_layers_bytes(
    arch: ModelArchConfig, s: int, b: int, tp: int, sp: bool, e: int, layers: int, recompute: RecomputeSettings | None,
    fused_norm: bool = False, gemm_attention: bool = False, path: KernelPath | None = None, cp: int = 1,
) -> tuple[int, int]:  # fmt: skip
    """(kept, rebuilt) for one micro-batch of a stage of `layers` layers under `recompute`: the bytes its layers
    keep from forward to backward, and the most its backward holds beyond them at once (what a recomputation
    rebuilds, less what the backward has freed by then).

    Full recomputation keeps each checkpoint's input (s b h' e, h' = h/t under SP): uniform, one per chunk of
    recompute_num_layers layers, one chunk rebuilt at a time; block, one per recomputed layer (the first
    recompute_num_layers of the stage) while the others keep everything, one layer rebuilt at a time once the
    kept layers' backward has freed theirs. Selective recomputation keeps `selective_kept_bytes` instead of
    `core_attention_bytes` in every layer and rebuilds one layer's once that layer's MLP and context are freed;
    recompute_activation_function drops the MLP's activation output, rebuilt for one layer at a time before the
    layer frees anything. The layers a full recomputation rebuilds follow the last two."""
    layer = layer_activation_bytes(arch, s, b, tp, sp, e, fused_norm, gemm_attention, path, cp)
    mlp = (
        norm_activation_bytes(arch, s, b, tp, sp, e, _norm(fused_norm, path))
        + s * b * 3 * arch.token_ffn_size * e // tp
    )
    rebuilt = 0  # one layer's selective / activation rebuild: sequential in its backward, the larger counts
    if recompute is not None and recompute.recompute_activation_function:
        act = activation_output_bytes(arch, s, b, tp, e)
        layer, mlp, rebuilt = layer - act, mlp - act, act
    if recompute is not None and recompute.recompute_granularity == "selective":
        core = core_attention_bytes(arch, s, b, tp, e, gemm_attention, path, cp)
        layer += selective_kept_bytes(arch, s, b, tp, e, gemm_attention, path) - core
        context = s * b * int(arch.num_attention_heads) * arch.head_dim * e // tp
        rebuilt = max(rebuilt, core - mlp - context)
    if recompute is None or recompute.recompute_granularity != "full":
        return layers * layer, rebuilt
    h_local = int(arch.hidden_size) // tp if sp and tp > 1 else int(arch.hidden_size)
    checkpoint_input = s * b * h_local * e
    n = min(int(recompute.recompute_num_layers or 1), layers)
    if recompute.recompute_method == "block":
        return n * checkpoint_input + (layers - n) * layer, max(rebuilt, layer - (layers - n) * layer)
    return -(-layers // n) * checkpoint_input, n * layer + rebuilt


def train_activation_bytes(
    arch: ModelArchConfig, role: str, s: int, b: int, tp: int, pp: int, sp: bool, e: int,
    stage: int, micro_batches: int, recompute: RecomputeSettings | None = None, fused_norm: bool = False,
    gemm_attention_max_len: int = 0, path: KernelPath | None = None, cp: int = 1, stage_layers: int | None = None,
) -> int:  # fmt: skip
    """Peak activations of one rank of pipeline stage `stage` (of `stage_layers` layers; None: L/PP) in an update (cp > 1: s is the rank's columns of a
    context-parallel row, `core_attention_bytes`). Under 1F1B stage k holds
    min(PP - k, micro-batches) micro-batches in flight, each keeping what its L/PP layers keep under `recompute`
    (`recomputed_layers_bytes`); the backward of one of them first frees the head of the last stage (the final
    norm, and an actor's logits), then rebuilds what the recomputation rebuilds: the larger of the two counts."""
    layers = int(arch.num_layers) // pp if stage_layers is None else stage_layers
    in_flight = max(1, min(pp - stage, micro_batches))
    gemm = s * cp <= gemm_attention_max_len
    kept, rebuilt = recomputed_layers_bytes(arch, s, b, tp, sp, e, layers, recompute, fused_norm, gemm, path, cp)
    head = 0
    if stage == pp - 1:
        logits = logits_bytes(arch, s, b, tp, e) if role != "critic" else 0
        head = norm_activation_bytes(arch, s, b, tp, sp, e, _norm(fused_norm, path)) + logits
    return in_flight * kept + max(head, rebuilt)


def forward_bytes(arch: ModelArchConfig, role: str, s: int, b: int, tp: int, e: int) -> int:
    """A forward-only pass (old / reference logprobs, critic values): the vocab-parallel logits (e bytes) and
    their fp32 log-softmax for an actor; one layer's transient activations for the critic."""
    if role == "critic":
        return layer_activation_bytes(arch, s, b, tp, False, e)
    return s * b * (int(arch.padded_vocab_size) // tp) * (4 + e)


def kv_bytes_per_token(arch: ModelArchConfig, infer_tp: int, e: int) -> int:
    """K and V of every layer for one token on one engine rank (KV heads split over infer TP, replicated
    when infer TP exceeds them, as vLLM does). Multi-latent attention caches instead each layer's compressed KV,
    the kv_lora_rank latent and the qk_pos_emb_head_dim rope key, whole on every TP rank (vLLM's MLA backends:
    every head reads the one latent)."""
    if arch.multi_latent_attention:
        return int(arch.num_layers) * (int(arch.kv_lora_rank) + int(arch.qk_pos_emb_head_dim)) * e
    kv_heads = max(1, arch.num_kv_heads // infer_tp)
    return 2 * int(arch.num_layers) * kv_heads * arch.head_dim * e


def engine_activation_bytes(arch: ModelArchConfig, tokens: int, seqs: int, infer_tp: int, e: int) -> int:
    """The engine's transient peak for one step of `tokens` batched tokens (what vLLM's profile run reserves
    besides the weights): one layer's hidden states, QKV, gate/up, and fp32 logits of the sampled positions."""
    h, d, f = int(arch.hidden_size), arch.head_dim, arch.token_ffn_size
    a, g = int(arch.num_attention_heads), arch.num_kv_heads
    per_token = 2 * h + ((a + 2 * g) * d + 3 * f) // infer_tp
    return tokens * per_token * e + min(seqs, tokens) * int(arch.padded_vocab_size) // infer_tp * 4


def merge_buffer_bytes(arch: ModelArchConfig, targets: list[str] | None, r: int, tp: int, e: int) -> int:
    """The reshard's peak transient for a LoRA actor (`mindrl.models.lora.merged_weight`, one adapted linear's shard
    at a time): W + scale * B A in fp32 (n params), plus, for a 16-bit W (e bytes), the fp32 copies of A and B while
    B A is added, then the result cast back; the largest adapted linear sets it. 0 without adapters."""
    if not targets:
        return 0
    h, d, f = int(arch.hidden_size), arch.head_dim, arch.ffn_size
    q, kv = int(arch.num_attention_heads) * d, arch.num_kv_heads * d
    shard = {  # (out, in) of this TP rank's shard of W
        "linear_qkv": ((q + 2 * kv) // tp, h),
        "linear_proj": (h, q // tp),
        "linear_fc1": (2 * f // tp, h),
        "linear_fc2": (h, f // tp),
    }
    peak = 0
    for t in targets:
        out, inp = shard[t]
        n = out * inp
        # 16-bit W: A and B's fp32 copies live while B A is added, the 16-bit result after
        peak = max(peak, 4 * n if e == 4 else 4 * n + max(e * n, 4 * r * (out + inp)))
    return peak


def sequences_in_cache(kv_budget: int, max_model_len: int, per_token: int) -> int:
    """Sequences of max_model_len tokens (whole blocks) the KV budget holds at once."""
    if kv_budget <= 0:
        return 0
    blocks = -(-max_model_len // KV_BLOCK)
    return kv_budget // (blocks * KV_BLOCK * per_token)
