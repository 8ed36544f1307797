"""Per-device memory formulas: training state (megatron's accounting), activations (Korthikanti et al. 2022,
adapted to these decoders) and the rollout engine's weights and KV cache. Every function returns bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mindrl.config.model import ModelArchConfig

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
    mindrl's eager fused one (fused_norm, on CPU) only the fp32 normalised rows, s b h' (4 + e); a device's fused
    kernel (fused_norm="device") its e-byte input and 4-byte 1/rms per token, s b (2 e h' + 4)."""
    h = int(arch.hidden_size)
    h_local = h // tp if sp and tp > 1 else h
    if fused_norm == "device":
        return s * b * (2 * e * h_local + 4)
    return s * b * h_local * (4 + e + (0 if fused_norm else e))


def layer_activation_bytes(
    arch: ModelArchConfig, s: int, b: int, tp: int, sp: bool, e: int, fused_norm: bool = False,
    gemm_attention: bool = False, path: KernelPath | None = None,
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
    d, f = arch.head_dim, arch.ffn_size
    a, g = int(arch.num_attention_heads), arch.num_kv_heads
    if gemm_attention:
        attention_per_token = a * d * (4 + e) + 8 * g * d
        attention = 4 * a * b * s * s // tp
    elif path is not None and not (path.attention_fp32_operands and e < 4):
        # the kernel's own operands: q, K and V (grouped or expanded), its output and the projection's input
        kv = g if path.attention_grouped_kv else a
        attention_per_token = (3 * a + 2 * kv) * d * e
        mask = e if path.mask_bytes is None else path.mask_bytes
        attention = path.softmax_stats_bytes * a * s * b // tp + mask * b * s * s
    else:
        attention_per_token = a * d * (16 + (e if e < 4 else 0))
        attention = 4 * a * s * b // tp + 4 * b * s * s
    per_token = (attention_per_token + e * 3 * f) // tp
    norm = path.norm if path is not None and path.norm == "device" else fused_norm
    return 2 * norm_activation_bytes(arch, s, b, tp, sp, e, norm) + s * b * per_token + attention


def logits_bytes(arch: ModelArchConfig, s: int, b: int, tp: int, e: int) -> int:
    """The loss's fp32 softmax over the vocab-parallel logits, s b V/t x 4 bytes (the e-byte logits are cast
    to fp32 and not kept; `e` is accepted for symmetry with the other terms)."""
    return s * b * (int(arch.padded_vocab_size) // tp) * 4


def train_activation_bytes(
    arch: ModelArchConfig, role: str, s: int, b: int, tp: int, pp: int, sp: bool, e: int,
    stage: int, micro_batches: int, recompute: bool, fused_norm: bool = False, gemm_attention_max_len: int = 0,
    path: KernelPath | None = None,
) -> int:  # fmt: skip
    """Peak activations of one rank of pipeline stage `stage` in an update. Under 1F1B stage k holds
    min(PP - k, micro-batches) micro-batches in flight, each with its L/PP layers; the last stage of an actor
    adds the logits of one micro-batch. With full recomputation a layer keeps only its input (s b h' e bytes)
    and one layer's activations are rebuilt at a time."""
    layers = int(arch.num_layers) // pp
    in_flight = max(1, min(pp - stage, micro_batches))
    full = layer_activation_bytes(arch, s, b, tp, sp, e, fused_norm, s <= gemm_attention_max_len, path)
    if recompute:
        h_local = int(arch.hidden_size) // tp if sp and tp > 1 else int(arch.hidden_size)
        body = in_flight * layers * s * b * h_local * e + full
    else:
        body = in_flight * layers * full
    head = 0
    if stage == pp - 1:  # the final norm, and the logits of an actor
        logits = logits_bytes(arch, s, b, tp, e) if role != "critic" else 0
        norm = "device" if path is not None and path.norm == "device" else fused_norm
        head = norm_activation_bytes(arch, s, b, tp, sp, e, norm) + logits
    return body + head


def forward_bytes(arch: ModelArchConfig, role: str, s: int, b: int, tp: int, e: int) -> int:
    """A forward-only pass (old / reference logprobs, critic values): the vocab-parallel logits (e bytes) and
    their fp32 log-softmax for an actor; one layer's transient activations for the critic."""
    if role == "critic":
        return layer_activation_bytes(arch, s, b, tp, False, e)
    return s * b * (int(arch.padded_vocab_size) // tp) * (4 + e)


def kv_bytes_per_token(arch: ModelArchConfig, infer_tp: int, e: int) -> int:
    """K and V of every layer for one token on one engine rank (KV heads split over infer TP, replicated
    when infer TP exceeds them, as vLLM does)."""
    kv_heads = max(1, arch.num_kv_heads // infer_tp)
    return 2 * int(arch.num_layers) * kv_heads * arch.head_dim * e


def engine_activation_bytes(arch: ModelArchConfig, tokens: int, seqs: int, infer_tp: int, e: int) -> int:
    """The engine's transient peak for one step of `tokens` batched tokens (what vLLM's profile run reserves
    besides the weights): one layer's hidden states, QKV, gate/up, and fp32 logits of the sampled positions."""
    h, d, f = int(arch.hidden_size), arch.head_dim, arch.ffn_size
    a, g = int(arch.num_attention_heads), arch.num_kv_heads
    per_token = 2 * h + ((a + 2 * g) * d + 3 * f) // infer_tp
    return tokens * per_token * e + min(seqs, tokens) * int(arch.padded_vocab_size) // infer_tp * 4


def sequences_in_cache(kv_budget: int, max_model_len: int, per_token: int) -> int:
    """Sequences of max_model_len tokens (whole blocks) the KV budget holds at once."""
    if kv_budget <= 0:
        return 0
    blocks = -(-max_model_len // KV_BLOCK)
    return kv_budget // (blocks * KV_BLOCK * per_token)
