"""Fused elementwise ops for hosts without Transformer Engine: RoPE, SwiGLU and RMSNorm, each one autograd function
running the platform's fused kernels for fp32 or bf16 where it has them, else torch ops bit-identical to megatron's
forms."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mindrl.kernels import current_kernels


def kernels_for(*tensors: torch.Tensor, bf16: bool = False):
    """The platform's fused elementwise kernels where they cover these tensors (fp32; or bf16, for a caller whose
    kernels have a bf16 form), else None."""
    kernels = current_kernels().elementwise_kernels()
    return kernels if kernels is not None and kernels.takes(*tensors, bf16=bf16) else None


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
    kernels = kernels_for(t, cos, sin, bf16=True)
    out = kernels.rope(t, cos, sin, 1 if sign > 0 else -1) if kernels is not None else None
    if out is not None:
        return out  # fp32: the same products and sums, each rounded as here (bit-identical); bf16: rounded once
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


class _SwiGLU(torch.autograd.Function):
    """silu(a) * b for x = [a, b] on its last dimension, keeping only x for backward.

    Megatron's unfused glu keeps a, b and silu(a), and its backward ends in a cat of the two halves' grads; here the
    output is written in place over silu(a), and backward writes each half of the input grad where it belongs. The
    same kernels as autograd's (silu, silu_backward, mul) in the same order: bit-identical forward and backward,
    with no compiler (megatron's fused SwiGLU is torch.compile'd: seconds of inductor build per process and shape)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        kernels = kernels_for(x, bf16=True)
        if kernels is not None:
            return kernels.swiglu_forward(x)
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]).mul_(x[..., half:])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        kernels = kernels_for(x, grad, bf16=True)
        if kernels is not None:
            return kernels.swiglu_backward(x, grad)
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        da, db = dx[..., :half], dx[..., half:]
        # d/da: grad * b * silu'(a), as autograd's mul then silu backward; d/db: grad * silu(a), recomputed.
        torch.ops.aten.silu_backward.grad_input(grad * b, a, grad_input=da)
        torch.ops.aten.silu.out(a, out=db)
        db.mul_(grad)
        return dx


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(x1) * x2 with [x1, x2] = x split in half on the last dimension (megatron's gated-linear-unit order)."""
    if x.shape[-1] % 2:
        raise ValueError(f"SwiGLU needs an even last dimension (gate and up halves), got {tuple(x.shape)}")
    return _SwiGLU.apply(x)


class SwiGLU(torch.nn.Module):
    """The MLP's activation (megatron's `MLPSubmodules.activation_func`, used when `use_te_activation_func` is set):
    the fused `swiglu` on fc1's [gate, up] output. No parameters, so no state-dict keys."""

    def __init__(self, config=None, **unused):
        super().__init__()
        if config is not None and (config.activation_func is not F.silu or not config.gated_linear_unit):
            raise ValueError("mindrl's SwiGLU module needs activation_func=silu and gated_linear_unit=True")
        if config is not None and (config.glu_linear_offset or config.activation_func_clamp_value is not None):
            raise ValueError("mindrl's SwiGLU covers glu_linear_offset 0 and no activation clamp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Nothing to save; megatron's MLP asks each of its submodules for its share of a distributed checkpoint."""
        return {}


def stats_dtype(x: torch.Tensor) -> torch.dtype:
    """RMSNorm's statistics: fp32 for 16- and 32-bit inputs (as HF), fp64 for fp64."""
    return torch.promote_types(x.dtype, torch.float32)


class _RMSNorm(torch.autograd.Function):
    """weight * rms_norm(x) with statistics in fp32 and the weight applied in x's dtype (HF's Llama / Qwen2 order).

    Under autograd torch decomposes rms_norm on CPU (pow, mean, add, rsqrt, mul, then the weight's mul), and its
    backward walks that graph: about a dozen passes over [tokens, hidden]. Here forward is torch's `_fused_rms_norm`
    (the very values of the decomposed form) and backward is five passes: the weight's grad, grad * weight, its dot
    with the normalised input, and dx = rstd * (dy - y * mean(dy * y)). Only y (fp32) and rstd are kept. With the
    platform's kernels both directions are one pass each, the sums in the kernels' order; in bf16 they keep x (bf16)
    and rstd instead of y, and round the output once (weight * y in fp32)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        kernels = kernels_for(x, weight, bf16=True)
        ctx.dtype, ctx.bf16_kernels = x.dtype, kernels is not None and x.dtype == torch.bfloat16
        if ctx.bf16_kernels:
            out, rstd = kernels.rms_norm_forward_bf16(x, weight, eps)
            ctx.save_for_backward(x, rstd, weight)
            return out
        if kernels is not None:  # one pass; the sum of squares in the kernel's order (not bit-identical to torch's)
            out, y, rstd = kernels.rms_norm_forward(x, weight, eps)
        else:
            # statistics in fp32, or in fp64 for an fp64 model (the fp64 reference of `mindrl-convert check`)
            y, rstd = torch.ops.aten._fused_rms_norm(x.to(stats_dtype(x)), [x.shape[-1]], None, eps)
            out = weight * y.to(x.dtype)
        ctx.save_for_backward(y, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.bf16_kernels:
            x, rstd, weight = ctx.saved_tensors
            kernels = kernels_for(grad, weight, bf16=True)
            if kernels is not None:
                dx, dw = kernels.rms_norm_backward_bf16(grad, x, rstd, weight, *ctx.needs_input_grad[:2])
                return dx, dw.to(weight.dtype) if dw is not None else None, None
            y = x.float() * rstd  # a gradient of another dtype: the torch form below, from y
        else:
            y, rstd, weight = ctx.saved_tensors
        kernels = kernels_for(grad, weight) if ctx.dtype == torch.float32 else None
        if kernels is not None:
            return (*kernels.rms_norm_backward(grad, y, rstd, weight, *ctx.needs_input_grad[:2]), None)
        hidden = y.shape[-1]
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # sum over every token of grad * y (y as the forward multiplied it: in x's dtype), accumulated in fp32
            y_used = y if ctx.dtype == y.dtype else y.to(ctx.dtype).to(y.dtype)
            grad_weight = torch.linalg.vecdot(grad.to(y.dtype).reshape(-1, hidden), y_used.reshape(-1, hidden), dim=0)
            grad_weight = grad_weight.to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            dy = (grad * weight).to(y.dtype)
            dot = torch.linalg.vecdot(dy, y).unsqueeze(-1).div_(hidden)
            grad_x = torch.addcmul(dy, y, dot, value=-1.0).mul_(rstd).to(ctx.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x**2, last dim) + eps), the statistics in fp32 (see _RMSNorm); x [..., hidden]."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"RMSNorm weight of shape {tuple(weight.shape)} does not match inputs {tuple(x.shape)}")
    return _RMSNorm.apply(x, weight, eps)
