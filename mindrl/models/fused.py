"""Fused elementwise ops for hosts without Transformer Engine: RoPE as one autograd function.

Installed as megatron's `fused_apply_rotary_pos_emb` (its hook for TE's kernel) only where that hook is empty.
"""

from __future__ import annotations

import torch


class _RotaryHalves(torch.autograd.Function):
    """y = t * cos + rotate_half(t) * sin over the first `2 * half` channels of t, the rest passed through.

    Megatron's unfused form builds rotate_half with a chunk + neg + cat, multiplies twice, adds, and cats the
    pass-through channels back: five full-size temporaries per call and as many again in backward. Here each half of
    the output is written in place, with one half-size temporary; backward is the same rotation transposed."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin, sign=1.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, sign=-1.0), None, None


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """[x1, x2, rest] -> [x1 cos - sign x2 sin, x2 cos + sign x1 sin, rest] (sign -1: the transpose, for backward).

    Every product is rounded before the sum, as in megatron's (t * cos) + (rotate_half(t) * sin): the result is
    bit-identical to it (an addcmul would round once and differ in the last bit)."""
    half = cos.shape[-1]
    x1, x2 = t[..., :half], t[..., half : 2 * half]
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    o1, o2 = out[..., :half], out[..., half : 2 * half]
    first, second = (torch.Tensor.sub_, torch.Tensor.add_) if sign > 0 else (torch.Tensor.add_, torch.Tensor.sub_)
    product = torch.mul(x2, sin)
    first(torch.mul(x1, cos, out=o1), product)
    torch.mul(x1, sin, out=product)
    second(torch.mul(x2, cos, out=o2), product)
    if t.shape[-1] > 2 * half:
        out[..., 2 * half :] = t[..., 2 * half :]
    return out


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Megatron's `fused_apply_rotary_pos_emb` contract (bshd: t [s, b, heads, dim], freqs [s, 1, 1, rot_dim] built
    by RotaryEmbedding as cat(f, f)); bit-identical to its unfused `_apply_rotary_pos_emb_bshd` with mscale 1,
    forward and backward."""
    if interleaved:
        raise NotImplementedError(
            "mindrl's fused RoPE covers the rotate-half layout (Llama / Qwen2); set rotary_interleaved: false "
            "or run without apply_rope_fusion"
        )
    rot = freqs.shape[-1]
    if rot % 2 or rot > t.shape[-1]:
        raise ValueError(f"RoPE frequencies of width {rot} do not fit heads of width {t.shape[-1]}")
    half = freqs[..., : rot // 2]
    # As megatron: cos / sin in the frequencies' dtype (fp32), then cast to the activations' dtype.
    return _RotaryHalves.apply(t, torch.cos(half).to(t.dtype), torch.sin(half).to(t.dtype))


def install_fused_rope() -> bool:
    """Make megatron's RoPE fusion hook available (ours where Transformer Engine gave none). Idempotent; True when
    the hook is set, so `apply_rope_fusion` may be turned on."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    return rope_utils.fused_apply_rotary_pos_emb is not None
