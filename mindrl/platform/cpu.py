"""The CPU platform: ranks share the host's one device, gloo carries the collectives, megatron runs on a shim. The
figures behind its choices are in docs/performance.md."""

from __future__ import annotations

import ctypes
import logging
import os
import tempfile
import weakref

import torch

from mindrl.platform.base import Platform
from mindrl.platform.megatron_cpu import adapt_megatron

logger = logging.getLogger(__name__)


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The first core's feature flags (x86 `flags`, ARM `Features`); empty where the file cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
    ray_resource = "CPU"
    has_sleep_mode = False
    is_cpu = True

    # vLLM-CPU's generators refuse the offset rewind a split seeded prefill needs (it kills the engine).
    seeded_chunked_prefill = False
    # Inductor would build vLLM's compiled helpers in every engine process (seconds each) for ops whose eager forms
    # give the same integers and cost nothing at these sizes.
    compiles_rollout_sampler_ops = False
    # Row blocks sized for a core's cache; on devices each block is a handful of kernel launches, so few large ones.
    cache_blocked_logprobs = True
    # Megatron's compiled SwiGLU gives the same update time but inductor builds it in every process, per grad mode
    # and shape (and needs a C++ compiler at run time).
    eager_fused_swiglu = True
    repack_moe_after_reload = True  # vLLM-CPU's grouped-GEMM layout (cpu_moe.process_weights_after_loading)
    # torch has no fused RMSNorm backward on CPU and decomposes the op into about a dozen passes when it needs grads.
    eager_fused_rms_norm = True
    # megatron has no apex / Transformer Engine Adam here and would fall back to torch's per-tensor loop (about eight
    # passes per parameter); the fused step differs from the loop's in the last bits.
    fused_adam = True
    # One gloo event-loop thread per group wakes every 10 ms and preempts the training's OpenMP threads on the cores
    # they fill; one shared transport device per process instead.
    shares_gloo_device = True

    def bf16_in_software(self) -> str | None:
        """x86 without AVX512-BF16 or AMX (AVX2 only, or AVX-512 before them), or an ARM core without the BF16
        extension: torch's and vLLM's bf16 GEMMs then take generic paths, tens of times slower than fp32's."""
        flags = cpu_flags()
        if not flags or flags & {"avx512_bf16", "amx_bf16", "bf16"}:
            return None
        return "this CPU has no bf16 instructions (no avx512_bf16, amx_bf16 or bf16 in /proc/cpuinfo)"

    def device(self, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    def local_rank(self, rank: int) -> int:
        return rank

    def set_device(self, local_rank: int) -> None:
        pass

    def device_count(self) -> int:
        return 1

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        # glibc keeps what the process frees (worker_env: no mmap, no trim), so a phase's freed memory stays resident
        # into the next one. Hand the free pages back before an update (workers.rank.TRAINING_PHASES), as a device's
        # caching allocator would.
        _malloc_trim()

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def reset_peak_memory_stats(self) -> None:
        pass

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        # Host and device coincide, so a copy in memory frees nothing: state offloaded from the "device" goes to a
        # file on a disk-backed file system instead (the kernel's page cache holds it, reclaimable, outside every
        # process's RSS), the way a device run offloads to host memory. Small storages stay in memory.
        spill = _spill_dir() if nbytes >= SPILL_MIN_BYTES else None
        if spill is None:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=False)
        fd, path = tempfile.mkstemp(prefix="mindrl-offload-", dir=spill)
        try:
            # the blocks are reserved now: a full disk is an error here, never a SIGBUS when a page is written
            os.posix_fallocate(fd, 0, nbytes)
            host = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except OSError as e:
            logger.warning("offload: %d bytes do not fit in %s (%s); this buffer stays in memory", nbytes, spill, e)
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=False)
        finally:
            os.close(fd)
            os.unlink(path)  # the mapping keeps the file; nothing is left behind when the buffer goes
        _SPILLED.add(host.data_ptr())
        weakref.finalize(host, _SPILLED.discard, host.data_ptr())  # before its mapping can go
        return host

    def host_copied(self, host: torch.Tensor) -> None:
        # A shared file mapping's pages stay in the page cache (dirty ones are written back, not dropped) when the
        # process lets go of them; the next copy faults them in again from there.
        if host.numel() and host.data_ptr() in _SPILLED:
            if _libc().madvise(host.data_ptr(), host.numel(), _MADV_DONTNEED) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) on an offload buffer failed")

    @property
    def worker_env(self) -> dict[str, str]:
        # glibc malloc keeps what a step frees for the next step (no mmap of big blocks, no trim of the heap's top),
        # so each update and rollout does not page-fault its memory in again, zero-filled by the kernel. Devices keep
        # glibc's defaults: their big buffers are device memory, and host memory handed back matters there (offload).
        # triton has no CPU backend, yet megatron-core and vLLM import it when it is installed: libtriton's pages
        # alone are ~70 MiB of each worker's RSS (docs/performance.md, footprint). `mindrl` keeps it out (BLOCKED_IMPORTS).
        # pyarrow: Ray's serialization context imports it, when it can, for Ray Data's tables, which mindrl never
        # sends (~25 MiB; the driver hides it the same way while Ray makes its context: workers.group.start_ray).
        # wandb: megatron's inference context imports it when installed (~0.3 CPU s per worker start); trackers log
        # from the driver, never from a worker.
        return {
            "MALLOC_MMAP_MAX_": "0",
            "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
            "MINDRL_BLOCKED_IMPORTS": "triton,pyarrow,wandb",
        }

    def deterministic_env(self) -> dict[str, str]:
        # torch's CPU kernels and gloo's ring add in a fixed order for a fixed thread count and world; OpenMP's dynamic
        # adjustment could hand a parallel region fewer threads on a loaded host, and with them another split of a
        # reduction.
        return {**super().deterministic_env(), "OMP_DYNAMIC": "false"}

    def ray_actor_options(self, fraction: float) -> dict:
        return {"num_cpus": fraction}

    def weight_channel_group(self, store, rank: int, world_size: int, timeout_s: float):
        import datetime

        import torch.distributed as dist

        return dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=timeout_s))

    def _gemm_attention_default(self, training: bool) -> int:
        # torch's CPU flash kernel computes its small blocks at a fraction of the GEMM rate (in backward most) until
        # the scores no longer stay in the cache; forward alone it catches up sooner.
        return 320 if training else 160

    def rollout_kv_cache_bytes(self) -> int | None:
        # vLLM-CPU reads gpu_memory_utilization as a fraction of host memory (and refuses to start when that much is
        # not free), so a fixed size is the sane default.
        return 1 << 30

    def _adapt(self) -> None:
        # Megatron's recommended setting for overlapping TP communication on GPUs; here it only silences its warning.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        adapt_megatron()


def _malloc_trim() -> None:
    """glibc's malloc_trim(0): every arena's free pages go back to the kernel (a no-op without glibc)."""
    global _TRIM
    if _TRIM is None:
        import ctypes

        try:
            _TRIM = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


SPILL_MIN_BYTES = 1 << 20
"""Offloaded storages smaller than this stay in memory (norm weights, biases: a file each would cost more)."""
_SPILLED: set[int] = set()  # addresses of the live file-backed host buffers (madvise would zero anonymous memory)
_MADV_DONTNEED = 4
_NO_SPILL_FS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}  # memory-backed: a file there frees nothing


def _spill_dir() -> str | None:
    """Where offloaded state goes on CPU: MINDRL_OFFLOAD_DIR, else the temp directory, if its file system is
    disk-backed; None (offload in memory) otherwise or when MINDRL_OFFLOAD_DIR is empty."""
    d = os.environ.get("MINDRL_OFFLOAD_DIR", tempfile.gettempdir())
    if not d:
        return None
    return d if _fs_type(d) not in _NO_SPILL_FS else None


def _fs_type(path: str) -> str:
    """The file system type of the mount that holds `path` ('' when /proc/mounts cannot say)."""
    path, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        return ""
    return kind


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC


_LIBC = None
