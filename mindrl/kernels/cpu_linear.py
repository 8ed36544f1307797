"""megatron's fp32 linear layers on an x86 CPU through torch's bundled oneDNN instead of torch.matmul (MKL), where
MKL runs its vendor-generic path (`KernelSet.onednn_linear` decides; `install` puts it in megatron)."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import layers

from mindrl.platform import in_host_memory
from mindrl.platform.megatron_cpu import CpuWgradAccumulation

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
    copied transposed (the second is read strided, no copy), and a transposed copy is slow: the narrower of the two
    is the one copied (for an LM head, the hidden-size operand rather than the vocabulary-size one)."""
    if grad_2d.shape[1] > input_2d.shape[1]:
        return onednn_linear(input_2d.t(), grad_2d.t()).t()  # (input^T @ grad)^T
    return onednn_linear(grad_2d.t(), input_2d.t())


class OneDnnWgradAccumulation(CpuWgradAccumulation):
    """The platform's weight-gradient accumulation slot (main_grad += grad_output^T @ input) with its fp32 GEMM on
    oneDNN: the product, then one add pass over the weight-sized result."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        """total_input (tokens, in), grad_output (tokens, out), main_grad (out, in)."""
        if total_input.dtype == main_grad.dtype == torch.float32:
            main_grad.add_(onednn_weight_grad(total_input, grad_output))
        else:
            CpuWgradAccumulation.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


class OneDnnLinear(_MEGATRON_LINEAR):
    """megatron's `LinearWithGradAccumulationAndAsyncCommunication` with its three GEMMs (forward, input gradient,
    weight gradient into DDP's main_grad) on oneDNN: same inputs, same outputs to fp32 rounding, deterministic run to
    run. Installed in megatron's layers module by `install`; `apply` picks this function for fp32 host tensors without
    sequence parallelism, deferred weight gradients or FSDP, megatron's otherwise."""

    @classmethod
    def apply(cls, *args):
        """megatron's call: (input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        grad_output_buffer, wgrad_deferral_limit, tp_group), positionally."""
        input, weight, _, _, _, sequence_parallel, grad_output_buffer = args[:7]
        covered = (
            input.dtype == torch.float32
            and weight.dtype == torch.float32
            and in_host_memory(input)
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
            # megatron's kernel slot (OneDnnWgradAccumulation once installed): main_grad += grad^T @ input
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
    """Route megatron's linear layers through `OneDnnLinear` (megatron looks the function up at each call), and its
    weight-gradient slot through oneDNN. Call after the platform's `apply` (which fills the slot)."""
    layers.LinearWithGradAccumulationAndAsyncCommunication = OneDnnLinear
    layers.fused_weight_gradient_mlp_cuda = OneDnnWgradAccumulation
