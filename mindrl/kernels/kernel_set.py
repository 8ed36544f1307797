"""The one object that says which of mindrl's optional fast paths are on in this process, per platform: none on a
device platform; on CPU the C kernels, the rollout's hooks, oneDNN linears and the MKL vendor shim, by switch."""

from __future__ import annotations

import functools
import os

import torch

from mindrl.kernels.cpu_kernels import Kernels, load
from mindrl.kernels.mkl_vendor import cpu_vendor, is_x86_64, loaded, shim
from mindrl.platform import CpuPlatform, Platform, current_platform, env_switch


class KernelSet:
    """The fast paths of a platform that has none of mindrl's own: devices keep their vendor's kernels (megatron's
    compiled / TE / MindSpeed ones for training, vLLM's / vllm-ascend's for the rollout)."""

    rollout_c_rms_norm = False  # an eager rollout engine runs vLLM's own C RMSNorm kernels (`mindrl.rollout.vllm_ops`)
    onednn_available = False  # torch's oneDNN fp32 linear (`cpu_linear.onednn_linear`) is there to use
    onednn_linear = False  # megatron's fp32 linear layers run their GEMMs on oneDNN (`cpu_linear`)
    mkl_vendor_shim: str | None = None  # the library preloaded into workers that answers MKL's vendor check

    def __init__(self, platform: Platform) -> None:
        self.platform = platform

    def elementwise_kernels(self) -> Kernels | None:
        """mindrl's fused elementwise kernels for fp32 training (`mindrl.models.fused`, `.attention`,
        `.vocab_parallel` ask), or None."""
        return None

    def rollout_sampler_kernels(self) -> Kernels | None:
        """The kernels a rollout engine samples with in place of vLLM's random sampling step
        (`mindrl.rollout.vllm_ops.install_c_sampler`), or None for vLLM's own."""
        return None

    def rollout_linear_kernels(self) -> Kernels | None:
        """The kernels an eager rollout engine computes its fp32 linear layers and LM head with
        (`mindrl.rollout.vllm_ops.c_linears`), or None for vLLM's own."""
        return None

    @property
    def worker_env(self) -> dict[str, str]:
        """The platform's `worker_env` plus what these kernels need in every worker process from its start."""
        return self.platform.worker_env

    def install(self) -> None:
        """Put these kernels in megatron (after `current_platform().apply()`, once per process that builds models)."""


class CpuKernelSet(KernelSet):
    """On CPU: mindrl's C kernels (`cpu_kernels`, built once per machine; off with MINDRL_CPU_KERNELS=0 or without a
    compiler), vLLM's C norms and mindrl's sampler and GEMM in the rollout, oneDNN linears where MKL runs its
    vendor-generic path, and the MKL vendor shim on AMD CPUs. docs/performance.md has the figures."""

    rollout_c_rms_norm = True  # vLLM-CPU picks a torch-op form that an eager engine runs op by op

    def elementwise_kernels(self) -> Kernels | None:
        return load()

    def rollout_sampler_kernels(self) -> Kernels | None:
        # vLLM-CPU draws Gumbel noise for every vocabulary entry; MINDRL_ROLLOUT_C_SAMPLER=0 keeps vLLM's (an A/B, or
        # vLLM's exact token streams for a seed).
        return self._rollout_kernels("MINDRL_ROLLOUT_C_SAMPLER")

    def rollout_linear_kernels(self) -> Kernels | None:
        # vLLM-CPU's oneDNN waits on the weights at a decode step's few rows; MINDRL_ROLLOUT_C_LINEAR=0 keeps vLLM's.
        return self._rollout_kernels("MINDRL_ROLLOUT_C_LINEAR")

    def _rollout_kernels(self, switch: str) -> Kernels | None:
        """`elementwise_kernels` for a rollout engine's step where the on/off `switch` is on; None elsewhere."""
        if not env_switch(switch):
            return None
        return self.elementwise_kernels()

    @property
    def onednn_available(self) -> bool:
        """x86-64 and a torch built with oneDNN."""
        if not is_x86_64():
            return False
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

    @property
    def onednn_linear(self) -> bool:
        """Where MKL runs its vendor-generic path: a non-Intel x86 CPU without the MKL vendor shim (MKL picks its
        kernels by vendor, oneDNN by instruction set). Where MKL runs its instruction-set path (Intel, or the shim
        loaded) MKL is the faster of the two at the model's shapes. MINDRL_ONEDNN_LINEAR: `auto` (the default, as
        above), `0` (off) or `1` (on wherever oneDNN is there)."""
        mode = os.environ.get("MINDRL_ONEDNN_LINEAR", "auto").strip().lower()
        if mode not in ("auto", "0", "1"):
            raise ValueError(f"MINDRL_ONEDNN_LINEAR={mode!r} must be auto, 0 or 1")
        if not self.onednn_available or mode == "0":
            return False
        if mode == "1":
            return True
        mkl_native = cpu_vendor() == "GenuineIntel" or loaded()
        return not (torch.backends.mkl.is_available() and mkl_native)

    @property
    def mkl_vendor_shim(self) -> str | None:
        """The shim's path on an AMD CPU (`mkl_vendor`); None elsewhere, or without a C compiler to build it."""
        return shim()

    @property
    def worker_env(self) -> dict[str, str]:
        env = dict(self.platform.worker_env)
        if self.mkl_vendor_shim:
            env["LD_PRELOAD"] = self.mkl_vendor_shim
        return env

    def install(self) -> None:
        if self.onednn_linear:
            from mindrl.kernels.cpu_linear import install  # imports megatron: only in processes that build models

            install()


@functools.cache
def current_kernels() -> KernelSet:
    """This process's fast paths, for `current_platform()`."""
    platform = current_platform()
    return CpuKernelSet(platform) if isinstance(platform, CpuPlatform) else KernelSet(platform)
