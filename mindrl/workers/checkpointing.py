"""Saving a worker's model as a mindrl megatron checkpoint iteration (loadable at any TP/PP, convertible to HF).

The iteration is written into a temporary directory, renamed into place, and the latest-iteration tracker
is updated last, so a crash mid-save leaves the previous checkpoint the latest complete one.
"""

from __future__ import annotations

import os
import shutil

import torch

from mindrl.checkpoint import mcore_ckpt
from mindrl.workers.settings import ModelSettings


def save_model_iteration(model, spec, role: str, settings: ModelSettings, save_dir: str, iteration: int) -> str:
    """Collective over the model's world. Returns the iteration directory."""
    from mindrl.checkpoint.hf_io import carry_files
    from mindrl.resharding.stream import unwrap

    final = mcore_ckpt.iteration_dir(save_dir, iteration)
    tmp = final + ".tmp"
    rank = torch.distributed.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    torch.distributed.barrier()
    mcore_ckpt.save_model(unwrap(model), tmp)
    torch.distributed.barrier()
    if rank == 0:
        mcore_ckpt.write_model_meta(tmp, spec, role, settings.tp, settings.pp, settings.dtype)
        hf_files = os.path.join(settings.load, mcore_ckpt.HF_FILES)
        target = os.path.join(save_dir, mcore_ckpt.HF_FILES)
        if os.path.isdir(hf_files) and not os.path.isdir(target):
            carry_files(hf_files, target)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        mcore_ckpt.write_tracker(save_dir, iteration)
    torch.distributed.barrier()
    return final
