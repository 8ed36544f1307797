"""Module-level functions the rollout tests run on pool ranks (external_launcher inside the pool's world)."""

from __future__ import annotations

import glob
import os

import torch

from mindrl.rollout import RolloutConfig, SamplingConfig


def vllm_rollout_in_world(
    model_dir: str, tps: list[int], prompts: list[list[int]], samplings: list[SamplingConfig]
) -> dict:
    """On every rank: for each infer TP, build a VllmEngine in the existing world, load the checkpoint's
    tensors, generate once per sampling config, shut it down; then prove the world and host state survived."""
    from mindrl.rollout.vllm_engine import VllmEngine
    from tests.rollout.helpers import hf_state, host_diff, host_state

    torch.manual_seed(1000 + torch.distributed.get_rank())  # the host's RNG differs per rank, as in training
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
        results[tp] = dict(outs=outs, dp_rank=engine.dp_rank, tp_rank=engine.tp_rank, seed=engine.seed)
        engine.shutdown()
        torch.distributed.barrier()
        results[tp]["shm"] = (ident, shm_during, glob.glob(f"/dev/shm/*{ident}*"))
    t = torch.tensor([torch.distributed.get_rank() + 1.0])
    torch.distributed.all_reduce(t)  # the default process group is still usable
    barrier_ok = torch.distributed.barrier() is None
    return dict(results=results, allreduce=t.item(), barrier=barrier_ok, host_diff=host_diff(before, host_state()))
