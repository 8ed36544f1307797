"""mindrl's optional fast paths per platform (the CPU's C kernels, the rollout's GEMM and sampler, oneDNN linears,
the MKL vendor shim), behind one object that says which are on: `current_kernels()`."""

from mindrl.kernels.kernel_set import CpuKernelSet, KernelSet, current_kernels

__all__ = ["CpuKernelSet", "KernelSet", "current_kernels"]
