"""The platform's base class: what the rest of mindrl may ask about the hardware it runs on; one subclass per device
kind (`cpu.CpuPlatform`, `cuda.CudaPlatform`, `npu.NpuPlatform`) answers for it."""

from __future__ import annotations

import os
import threading

import torch

from mindrl.platform.gloo import share_one_device
from mindrl.platform.orphans import checkpoint_results_queue, write_buckets_in_process

_APPLIED: set[str] = set()
_LOCK = threading.Lock()

DETERMINISTIC_ENV = "MINDRL_DETERMINISTIC"
"""Set to 1 in a worker's environment (megatron_training.npu_deterministic): the process turns on deterministic
computation (`Platform.enable_determinism`) before its first kernel."""


class Platform:
    """Where this process runs. Subclasses set the class attributes and implement the device calls."""

    name: str  # "npu" | "cuda" | "cpu"
    dist_backend: str  # torch.distributed backend: "hccl" | "nccl" | "gloo"
    ray_resource: str  # Ray resource a device bundle asks for: "NPU" | "GPU" | "CPU"
    # whether the platform's vLLM has sleep mode (without it, VllmEngine.sleep releases its storages in-process)
    has_sleep_mode = True
    is_cpu = False
    # The accelerator `mindrl-plan` assumes when neither its command line nor the config name says (a key of
    # `mindrl.plan.devices.KNOWN`); None: the host's memory (CPU stand-ins).
    planner_device: str | None = None

    # Which implementation of an op the models and the rollout engine pick here (the CPU's answers differ; see
    # `CpuPlatform` for why).
    seeded_chunked_prefill = True  # the rollout engine may split a seeded request's prefill over steps
    compiles_rollout_sampler_ops = True  # the rollout engine keeps vLLM's torch.compile'd helpers
    cache_blocked_logprobs = False  # vocabulary-wide logprob kernels walk the logits in cache-sized row blocks
    eager_fused_swiglu = False  # the MLP runs SwiGLU as mindrl's eager fused function (`mindrl.models.fused`)
    # vLLM prepacks a MoE layer's experts for its kernel at the first load only; a reload_weights writes the new
    # weights over the packed ones and must be packed again (`vllm_ops.repack_moe_experts`)
    repack_moe_after_reload = False
    eager_fused_rms_norm = False  # RMSNorm runs as mindrl's fused function instead of torch's under autograd
    fused_adam = False  # megatron's torch Adam(W) steps with torch's fused kernel (devices keep their own)
    # The core attention's operands for a 16-bit model (see `core_attention`): "fp32" casts q, k and v up and keeps
    # the fp32 copies for backward, so that the softmax runs in fp32; "native" hands the kernel the 16-bit tensors,
    # its softmax staying in fp32 inside (flash-style kernels), and keeps no copy.
    attention_operands = "fp32"
    attention_grouped_kv = False  # the kernel reads grouped K/V heads in place (no copy expanded to the query heads)
    device_rms_norm = False  # RMSNorm as the device's fused kernel (`rms_norm`), keeping its input and fp32 1/rms
    shares_gloo_device = False  # all gloo groups of a process share one transport device (`mindrl.platform.gloo`)
    # What `generate_config.weight_transfer: auto` picks: "dist" (a process group of this platform's backend, no
    # host copy or serialization) or "http" (safetensors buckets).
    weight_transfer = "dist"

    @property
    def device_type(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ----------------------------------------------------------------------------------------- devices
    def device(self, local_rank: int | None = None) -> torch.device:
        """The torch device a rank computes on; without `local_rank`, the device this process selected
        (`set_device`), else its LOCAL_RANK's."""
        raise NotImplementedError

    def local_rank(self, rank: int) -> int:
        """The device index a global rank uses on its host (a Ray worker sees only its own devices)."""
        raise NotImplementedError

    def set_device(self, local_rank: int) -> None:
        raise NotImplementedError

    def device_count(self) -> int:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def empty_cache(self) -> None:
        raise NotImplementedError

    def memory_allocated(self) -> int:
        """Bytes the allocator holds on this rank's device (0 on CPU: use storage accounting there)."""
        raise NotImplementedError

    def max_memory_allocated(self) -> int:
        """Peak bytes the allocator held on this rank's device since the last reset (0 on CPU)."""
        raise NotImplementedError

    def reset_peak_memory_stats(self) -> None:
        raise NotImplementedError

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer for state offloaded from the device: page-locked where the device has pinned memory
        (fast, asynchronous copies)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def host_copied(self, host: torch.Tensor) -> None:
        """`host` (from `host_buffer`) was just written or read: where it lives outside the process's memory, its
        pages may leave the process now (a no-op for memory-backed buffers)."""

    # ------------------------------------------------------------------------------- processes and Ray
    @property
    def worker_env(self) -> dict[str, str]:
        """Environment variables every worker process starts with on this platform, below everything the user sets
        (configs/envs/runtime_env.yaml, the shell, an explicit runtime_env: `mindrl.workers.runtime_env`)."""
        return {}

    def deterministic_env(self) -> dict[str, str]:
        """Environment variables that make this platform's kernels and collectives give the same bits run after run,
        for a process to start with (libraries read them when they first initialise: the BLAS handle, the
        communicators). Python's string hashing is fixed on every platform, so set and dict orders repeat too."""
        return {"PYTHONHASHSEED": "0"}

    def collective_buffer_env(self, mib: int) -> dict[str, str]:
        """Environment variables that give this platform's collectives `mib` MiB communication buffers
        (rl_config.hccl_buffersize); none where the backend has no such setting."""
        return {}

    def enable_determinism(self) -> None:
        """Deterministic computation in this process from now on: this platform's `deterministic_env` (overriding
        the environment: the config asked for it) and torch's deterministic algorithms (an op without a deterministic
        implementation then raises instead of varying). Call before the first kernel and communicator."""
        os.environ.update(self.deterministic_env())
        os.environ[DETERMINISTIC_ENV] = "1"
        torch.use_deterministic_algorithms(True)

    def ray_actor_options(self, fraction: float) -> dict:
        """Ray actor options that claim `fraction` of one device of this platform's placement-group bundle."""
        return {"num_cpus": 0, "resources": {self.ray_resource: fraction}}

    def weight_channel_group(self, store, rank: int, world_size: int, timeout_s: float):
        """A process group outside the default world (the rollout server's weight channel): this platform's backend
        over `store`; blocks until all `world_size` ranks joined or `timeout_s` passed. Its `broadcast` moves
        tensors on `self.device()`."""
        raise NotImplementedError

    def prepare_process_groups(self) -> None:
        """Call in a process before its first torch.distributed process group (the default one included)."""
        if self.shares_gloo_device:
            share_one_device()

    # ----------------------------------------------------------------------------- models and rollout
    def gemm_attention_max_len(self, training: bool = True) -> int:
        """The longest sequence whose core attention runs as batched GEMMs with the softmax kept for backward
        (`mindrl.models.attention.gemm_attention`) instead of torch's SDPA kernel, in a pass with gradients
        (training) or without; 0: never. MINDRL_GEMM_ATTENTION_MAX_LEN overrides both (0 turns it off)."""
        value = os.environ.get("MINDRL_GEMM_ATTENTION_MAX_LEN", "").strip()
        if value:
            try:
                return max(0, int(value))
            except ValueError:
                raise ValueError(f"MINDRL_GEMM_ATTENTION_MAX_LEN={value!r} is not an integer") from None
        return self._gemm_attention_default(training)

    def _gemm_attention_default(self, training: bool) -> int:
        return 0  # devices keep their fused attention kernels

    def core_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, dropout: float
    ) -> torch.Tensor:
        """softmax(scale q k^T, masked) v for q [b, heads, sq, d] and k, v [b, kv heads, s, d] (kv heads dividing
        heads); mask: bool [b or 1, 1, sq, s], True = hidden, or None for causal. Returns [b, heads, sq, d]. Here
        torch's SDPA over K and V expanded to the query heads."""
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if mask is None:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=scale
            )
        # megatron's mask marks what is hidden; SDPA's boolean mask marks what is seen.
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=~mask, dropout_p=dropout, scale=scale
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / rms(x) through the device's fused kernel (`device_rms_norm`); not on this platform."""
        raise NotImplementedError(f"{type(self).__name__} has no device RMSNorm kernel")

    def rollout_kv_cache_bytes(self) -> int | None:
        """Default KV cache size for an in-process rollout engine; None: size it by gpu_memory_utilization."""
        return None

    def bf16_in_software(self) -> str | None:
        """Why bf16 would run in software here (a host without bf16 instructions), or None: bf16 is native."""
        return None

    # ------------------------------------------------------------------------------------- adaptation
    def apply(self) -> None:
        """Adapt megatron-core to this device. Idempotent; call once per process before building models."""
        with _LOCK:
            if self.name in _APPLIED:
                return
            self._adapt()
            _in_process_checkpoint_writes()
            _APPLIED.add(self.name)

    def _adapt(self) -> None:
        """This device's part of `apply`."""


def _in_process_checkpoint_writes() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._get_write_results_queue = checkpoint_results_queue
    filesystem_async.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(write_buckets_in_process)


def determinism_requested() -> bool:
    """Whether this process was started to compute deterministically (DETERMINISTIC_ENV is 1)."""
    return env_switch(DETERMINISTIC_ENV, default="0")


def env_switch(name: str, default: str = "1") -> bool:
    """An on/off environment switch of mindrl's: unset is `default`, 1 is on, 0 is off, anything else is a ValueError naming the
    variable (a misspelt "false" must not leave a feature silently on). Read at every call, so that a worker's
    environment, a test or an A/B in one process decides."""
    value = os.environ.get(name, default).strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r} must be 0 or 1")
    return value == "1"


def in_host_memory(*tensors: torch.Tensor) -> bool:
    """Whether all these tensors are in host memory (where the CPU kernels can read them)."""
    return all(t.device.type == "cpu" for t in tensors)
