"""Checks of mindrl's oneDNN linears in megatron, run by test_kernel_set.py in a fresh interpreter (the platform's
shim and the kernels stay installed for the life of a process). Prints "<name>: ok" when every assertion held."""

from __future__ import annotations

import torch

from mindrl.kernels import current_kernels
from mindrl.platform import current_platform


def _close(a: torch.Tensor, b: torch.Tensor, what: str, rel: float = 2e-5) -> None:
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert a.shape == b.shape and err < rel, f"{what}: relative difference {err:.2e} (shapes {a.shape}, {b.shape})"


def onednn_linear() -> None:
    """mindrl.kernels.cpu_linear against megatron's own linear function: forward, input grad, weight grad (plain and
    accumulated into main_grad, with DDP's flag and placeholder), bias grad; deterministic; uncovered cases fall back."""
    current_platform().apply()
    current_kernels().install()
    from megatron.core.tensor_parallel import layers

    from mindrl.kernels import cpu_linear

    assert current_kernels().onednn_linear
    assert layers.fused_weight_gradient_mlp_cuda is cpu_linear.OneDnnWgradAccumulation
    assert layers.LinearWithGradAccumulationAndAsyncCommunication is cpu_linear.OneDnnLinear
    megatron_fn = cpu_linear._MEGATRON_LINEAR
    g = torch.Generator().manual_seed(0)
    x0, w0, b0 = (
        torch.randn(94, 4, 512, generator=g),
        torch.randn(1408, 512, generator=g),
        torch.randn(1408, generator=g),
    )
    grad = torch.randn(94, 4, 1408, generator=g)
    for fusion in (False, True):
        runs = []
        for fn in (megatron_fn, cpu_linear.OneDnnLinear):
            x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
            if fusion:  # as DDP sets it up: a grad buffer that already holds an earlier micro-batch's gradient
                w.main_grad, w.grad_added_to_main_grad, w.zero_out_wgrad = torch.ones(1408, 512), False, True
            for _ in range(2):  # two micro-batches accumulate
                fn.apply(x, w, b, fusion, False, False, None, 0, None).backward(grad)
            y = fn.apply(x0, w0, b0, fusion, False, False, None, 0, None)
            runs.append((y, x.grad, w.main_grad if fusion else w.grad, b.grad, w))
        (y_ref, gx_ref, gw_ref, gb_ref, _), (y, gx, gw, gb, w) = runs
        _close(y, y_ref, "output")
        _close(gx, gx_ref, "input grad")
        _close(gw, gw_ref, "main_grad" if fusion else "weight grad")
        _close(gb, gb_ref, "bias grad")
        if fusion:  # DDP's contract: main_grad has it, the .grad placeholder is zeros (zero_out_wgrad)
            assert w.grad_added_to_main_grad and torch.count_nonzero(w.grad) == 0
    # The weight grad copies whichever operand is narrower (transposed): both orientations give grad^T @ input.
    for width_in, width_out in ((512, 1408), (1408, 512)):
        inp, out_grad = torch.randn(376, width_in, generator=g), torch.randn(376, width_out, generator=g)
        _close(cpu_linear.onednn_weight_grad(inp, out_grad), out_grad.t() @ inp, f"weight grad {width_out}x{width_in}")
    # Its output may be modified in place (megatron all-reduces a row-parallel layer's output in place).
    x = x0.clone().requires_grad_()
    out = cpu_linear.OneDnnLinear.apply(x, w0, None, False, False, False, None, 0, None)
    out.mul_(2.0).sum().backward()
    _close(
        x.grad, 2.0 * megatron_fn.apply(torch.ones_like(grad), w0.t(), None, False, False, False, None, 0, None), "x2"
    )
    again = cpu_linear.OneDnnLinear.apply(x0, w0, b0, False, False, False, None, 0, None)
    assert torch.equal(again, cpu_linear.OneDnnLinear.apply(x0, w0, b0, False, False, False, None, 0, None))
    # Not covered: 16-bit tensors, deferred weight grads (megatron keeps the grad in the buffer): megatron's function.
    half = cpu_linear.OneDnnLinear.apply(x0.bfloat16(), w0.bfloat16(), None, False, False, False, None, 0, None)
    assert torch.equal(half, megatron_fn.apply(x0.bfloat16(), w0.bfloat16(), None, False, False, False, None, 0, None))
    deferred: list = []
    x = x0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    w.main_grad = torch.zeros(1408, 512)
    cpu_linear.OneDnnLinear.apply(x, w, None, True, False, False, deferred, 0, None).backward(grad)
    assert len(deferred) == 1 and torch.equal(deferred[0], grad) and torch.count_nonzero(w.main_grad) == 0
    print("onednn_linear: ok")
