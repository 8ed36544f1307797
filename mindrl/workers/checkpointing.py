"""A trained model's full state as a mindrl megatron checkpoint iteration (loadable at any TP/PP, convertible
to HF, and resumable exactly):

    ITER_DIR/                    the model (dist_checkpointing) + mindrl_model.json   (what build_and_load reads)
    ITER_DIR/optim/              the optimizer state (dist_checkpointing), unless no_save_optim
    ITER_DIR/rank_state/rank_R.pt  per rank: LR scheduler, torch and megatron RNG states (RNG unless no_save_rng)

The workers write into a temporary directory; the driver adds its own state, renames it into place and updates
the latest-iteration tracker last (`finalize_iteration`), so a crash mid-save leaves the previous checkpoint the
latest complete one.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

from mindrl.checkpoint import mcore_ckpt
from mindrl.checkpoint.hf_io import CheckpointError
from mindrl.workers.settings import ModelSettings

OPTIM_DIR = "optim"
RANK_STATE_DIR = "rank_state"
logger = logging.getLogger("mindrl.checkpoint")


def save_train_state(
    model, optimizer, scheduler, spec, role: str, settings: ModelSettings, it_dir: str, optim: bool, rng: bool
) -> None:
    """Collective over the model's world: every rank writes its shards into it_dir (which must exist)."""
    from megatron.core import dist_checkpointing, tensor_parallel

    from mindrl.resharding.stream import unwrap

    rank = torch.distributed.get_rank()
    inner = unwrap(model)
    model_sd = inner.sharded_state_dict()
    dist_checkpointing.save(model_sd, it_dir)
    if optim:
        os.makedirs(os.path.join(it_dir, OPTIM_DIR), exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(
            optimizer.sharded_state_dict(inner.sharded_state_dict()), os.path.join(it_dir, OPTIM_DIR)
        )
    state = {"scheduler": scheduler.state_dict(), "world_size": torch.distributed.get_world_size()}
    if rng:
        state["torch_rng"] = torch.get_rng_state()
        state["megatron_rng"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    os.makedirs(os.path.join(it_dir, RANK_STATE_DIR), exist_ok=True)
    torch.save(state, os.path.join(it_dir, RANK_STATE_DIR, f"rank_{rank}.pt"))
    torch.distributed.barrier()
    if rank == 0:
        mcore_ckpt.write_model_meta(it_dir, spec, role, settings.tp, settings.pp, settings.dtype)
    torch.distributed.barrier()


def load_train_state(model, optimizer, scheduler, it_dir: str, optim: bool, rng: bool) -> None:
    """Collective: the optimizer state (any saved layout: dist_checkpointing reshards), then this rank's scheduler
    and RNG states. The model itself was loaded by build_and_load."""
    from megatron.core import dist_checkpointing, tensor_parallel

    from mindrl.resharding.stream import unwrap

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if optim:
        optim_dir = os.path.join(it_dir, OPTIM_DIR)
        if not os.path.isdir(optim_dir):
            raise CheckpointError(
                f"{optim_dir} is missing: the checkpoint was saved without optimizer state (no_save_optim); "
                "set no_load_optim: true to resume with a fresh optimizer"
            )
        inner = unwrap(model)
        with torch.no_grad():
            sharded = optimizer.sharded_state_dict(inner.sharded_state_dict(), is_loading=True)
            optimizer.load_state_dict(dist_checkpointing.load(sharded, optim_dir))
    path = os.path.join(it_dir, RANK_STATE_DIR, f"rank_{rank}.pt")
    if not os.path.isfile(path):
        path = os.path.join(it_dir, RANK_STATE_DIR, "rank_0.pt")  # a smaller world than saved: rank 0's scheduler
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint has no scheduler / RNG state (incomplete save?)")
    state = torch.load(path, weights_only=False)
    scheduler.load_state_dict(state["scheduler"])
    if rng and "torch_rng" in state:
        if state["world_size"] != world:
            logger.warning(
                "%s was saved by %d ranks, this run has %d: RNG states are not restored (a different layout "
                "draws dropout masks differently anyway)",
                it_dir,
                state["world_size"],
                world,
            )
        else:
            torch.set_rng_state(state["torch_rng"])
            tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_rng"])


def begin_iteration(save_dir: str, iteration: int) -> str:
    """A fresh temporary directory for iteration `iteration` under save_dir (driver side)."""
    tmp = mcore_ckpt.iteration_dir(save_dir, iteration) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def finalize_iteration(
    save_dir: str, iteration: int, tmp: str, hf_files_from: str | None, keep_last: int | None = None
) -> str:
    """Move a completely written temporary iteration into place; the tracker is updated last. With keep_last,
    older complete iterations beyond the newest `keep_last` are then deleted (never the one just written)."""
    final = mcore_ckpt.iteration_dir(save_dir, iteration)
    if hf_files_from:
        from mindrl.checkpoint.hf_io import carry_files

        src, target = os.path.join(hf_files_from, mcore_ckpt.HF_FILES), os.path.join(save_dir, mcore_ckpt.HF_FILES)
        if os.path.isdir(src) and not os.path.isdir(target):
            carry_files(src, target)
    if os.path.isdir(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    mcore_ckpt.write_tracker(save_dir, iteration)
    if keep_last is not None:
        for old in saved_iterations(save_dir)[:-keep_last]:
            if old != iteration:
                shutil.rmtree(mcore_ckpt.iteration_dir(save_dir, old), ignore_errors=True)
    return final


def saved_iterations(save_dir: str) -> list[int]:
    """The complete (renamed into place) iterations under save_dir, oldest first."""
    out = []
    for name in os.listdir(save_dir):
        if name.startswith("iter_") and name[5:].isdigit() and os.path.isdir(os.path.join(save_dir, name)):
            out.append(int(name[5:]))
    return sorted(out)
