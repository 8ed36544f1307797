"""megatron's linear layers on an x86 CPU through oneDNN's fp32 GEMM (torch's bundled oneDNN) instead of torch.matmul.

torch.matmul on a CPU is MKL's sgemm, which picks its kernels by CPU vendor: on an AMD EPYC with full-width
AVX-512 it runs its 256-bit path at about half of what the cores do (measured on a 2-core Zen VM at the benchmark
model's shapes: 211-218 GFLOP/s, against 475-505 for oneDNN's JIT-compiled kernel, which picks by ISA; vLLM-CPU runs
its linears on oneDNN for the same reason). `OneDnnLinear` is megatron's
`LinearWithGradAccumulationAndAsyncCommunication` with its three GEMMs (forward, input gradient, weight gradient
into DDP's main_grad) on `torch.ops.mkldnn._linear_pointwise`: same inputs, same outputs to fp32 rounding (relative
differences ~1e-6, as between any two GEMM blockings), deterministic run to run. Cases it does not cover (16-bit
tensors, sequence parallelism, megatron's deferred weight gradients, Megatron-FSDP) go to megatron's own function
unchanged.

Where mindrl's MKL vendor shim is loaded (`mindrl.platform.mkl_vendor`: every worker on an AMD CPU), MKL runs its
instruction-set path and is as fast or faster than oneDNN at every shape (its weight gradient needs no transposed
copies), so `Platform.onednn_linear` is off there and megatron's own function runs; this module then serves workers
without the shim (no C compiler, MINDRL_MKL_VENDOR_SHIM=0) and Intel CPUs.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import layers

_MEGATRON_LINEAR = layers.LinearWithGradAccumulationAndAsyncCommunication


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., k] @ weight [n, k]^T -> [..., n] on oneDNN (fp32 CPU tensors of any strides; no autograd).

    The result is a tensor of its own, not a view: the op returns an N-d product as a view of its 2-d result, and
    an autograd Function's output that is a view cannot be modified in place (megatron all-reduces a row-parallel
    layer's output in place). As torch.matmul does, the 2-d result is reshaped without making a view."""
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, None, "none", [], "")
    return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], weight.shape[0]))


def onednn_weight_grad(input_2d: torch.Tensor, grad_2d: torch.Tensor) -> torch.Tensor:
    """grad^T @ input ([out, in], possibly as a transposed view) for input (tokens, in) and grad (tokens, out).

    oneDNN's linear wants its first operand with the reduction dimension (tokens) contiguous, so that operand is
    copied transposed (the second is read strided, no copy); a transposed copy runs ~6x slower than a plain one. The
    narrower of the two is the one copied: for the LM head (in 512, out 8192) that is a [tokens x 512] copy instead of
    a [tokens x 8192] one, which took as long as the GEMM itself."""
    if grad_2d.shape[1] > input_2d.shape[1]:
        return onednn_linear(input_2d.t(), grad_2d.t()).t()  # (input^T @ grad)^T
    return onednn_linear(grad_2d.t(), input_2d.t())


class CpuWgradAccumulation:
    """The CPU form of megatron's `fused_weight_gradient_mlp_cuda`: main_grad += grad_output^T @ input.

    One GEMM that adds into the grad buffer, instead of a fresh weight-grad tensor that DDP's hook then adds to
    main_grad in another pass over it (and frees): per micro-batch one allocation and one read-modify-write pass of
    every linear weight's size fewer. Its GEMM is oneDNN's once `install` ran (the product, then one add pass over the
    weight-sized result), else torch's addmm_."""

    onednn = False

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        """total_input (tokens, in), grad_output (tokens, out), main_grad (out, in)."""
        if total_input.dtype != main_grad.dtype:  # 16-bit activations, fp32 grads: the 16-bit GEMM, added
            main_grad.add_(grad_output.t().matmul(total_input))
        elif CpuWgradAccumulation.onednn and main_grad.dtype == torch.float32:
            main_grad.add_(onednn_weight_grad(total_input, grad_output))
        else:
            main_grad.addmm_(grad_output.t(), total_input)

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


class OneDnnLinear(_MEGATRON_LINEAR):
    """See the module docstring. Installed in megatron's layers module by `install`; `apply` picks this function
    for fp32 CPU tensors without sequence parallelism, deferred weight gradients or FSDP, megatron's otherwise."""

    @classmethod
    def apply(cls, *args):
        """megatron's call: (input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        grad_output_buffer, wgrad_deferral_limit, tp_group), positionally."""
        input, weight, _, _, _, sequence_parallel, grad_output_buffer = args[:7]
        covered = (
            input.dtype == torch.float32
            and weight.dtype == torch.float32
            and input.device.type == "cpu"
            and not sequence_parallel
            and grad_output_buffer is None
            and not hasattr(weight, "__fsdp_param__")
        )
        return super().apply(*args) if covered else _MEGATRON_LINEAR.apply(*args)

    @staticmethod
    def forward(
        ctx,
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        tp_group,
    ):
        ctx.save_for_backward(input, weight)
        # As megatron: main_grad in ctx, not saved (a module reused across layers would trip the in-place checks).
        ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        output = onednn_linear(input, weight)
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = onednn_linear(grad_output, weight.t())
        handle = None
        if ctx.allreduce_dgrad:  # overlapped with the weight gradient, as megatron does
            handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        grad_2d, input_2d = grad_output.reshape(-1, grad_output.shape[-1]), input.reshape(-1, input.shape[-1])
        if ctx.gradient_accumulation_fusion:
            weight.main_grad = ctx.main_grad
            # megatron's kernel slot (CpuWgradAccumulation on CPU): main_grad += grad^T @ input
            kernel = layers.fused_weight_gradient_mlp_cuda
            if weight.main_grad.dtype == torch.float32:
                kernel.wgrad_gemm_accum_fp32(input_2d, grad_2d, weight.main_grad)
            else:
                kernel.wgrad_gemm_accum_fp16(input_2d, grad_2d, weight.main_grad)
            if hasattr(weight, "grad_added_to_main_grad"):
                # megatron's contract with DDP's hooks: a placeholder grad (zeros where the weight asks for them), so
                # the hooks run on the backward thread, and the flag that says main_grad already has the gradient.
                make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
                grad_weight = make(weight.main_grad.shape, dtype=input.dtype, device=input.device)
                weight.grad_added_to_main_grad = True
            else:
                grad_weight = None
        else:
            grad_weight = onednn_weight_grad(input_2d, grad_2d).contiguous()
        grad_bias = grad_2d.sum(dim=0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def install() -> None:
    """Route megatron's linear layers through `OneDnnLinear` (megatron looks the function up at each call)."""
    layers.LinearWithGradAccumulationAndAsyncCommunication = OneDnnLinear
    CpuWgradAccumulation.onednn = True
