"""Megatron checkpoints as mindrl writes them: a root with a latest-iteration tracker and one
dist_checkpointing (torch_dist) directory per iteration, loadable at any TP/PP.

    ROOT/latest_checkpointed_iteration.txt      "release" (converted) or the iteration number
    ROOT/release/ or ROOT/iter_0000010/         dist_checkpointing files + mindrl_model.json
    ROOT/hf_files/                              config + tokenizer files carried over from HF
"""

from __future__ import annotations

import json
import os

import torch

from mindrl.checkpoint.hf_io import CheckpointError
from mindrl.models.hf_config import ModelSpec

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_META = "mindrl_model.json"
HF_FILES = "hf_files"
RELEASE = "release"
FORMAT_VERSION = 1


def iteration_dir(root: str, iteration: int | str) -> str:
    if iteration == RELEASE:
        return os.path.join(root, RELEASE)
    return os.path.join(root, f"iter_{int(iteration):07d}")


def write_tracker(root: str, iteration: int | str) -> None:
    """Written last, atomically: a checkpoint without it was never completed."""
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
    os.replace(tmp, os.path.join(root, TRACKER))


def read_tracker(root: str) -> int | str:
    if not os.path.isdir(root):
        raise CheckpointError(f"megatron checkpoint directory {root!r} does not exist")
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        raise CheckpointError(f"{root!r} is not a megatron checkpoint: {TRACKER} is missing (incomplete save?)")
    text = open(path).read().strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected 'release' or an iteration number, found {text!r}") from None


def write_model_meta(it_dir: str, spec: ModelSpec, role: str, tp: int, pp: int, dtype: str) -> None:
    meta = {"format_version": FORMAT_VERSION, "role": role, "tp": tp, "pp": pp, "dtype": dtype, "spec": spec.to_dict()}
    with open(os.path.join(it_dir, MODEL_META), "w") as f:
        json.dump(meta, f, indent=2)


def read_model_meta(root: str, iteration: int | str | None = None) -> tuple[ModelSpec, dict]:
    """(spec, meta) of the checkpoint's latest (or given) iteration."""
    iteration = read_tracker(root) if iteration is None else iteration
    path = os.path.join(iteration_dir(root, iteration), MODEL_META)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint was not written by mindrl or is incomplete")
    with open(path) as f:
        meta = json.load(f)
    return ModelSpec.from_dict(meta["spec"]), meta


def save_model(model: torch.nn.Module, it_dir: str) -> None:
    """Collective over all ranks: each writes its own shards (replicas are written once)."""
    from megatron.core import dist_checkpointing

    os.makedirs(it_dir, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), it_dir)


def load_model(model: torch.nn.Module, it_dir: str) -> None:
    """Collective; works whatever TP/PP the checkpoint was saved with (dist_checkpointing reshards)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if not os.path.isdir(it_dir):
        raise CheckpointError(f"checkpoint iteration directory {it_dir!r} does not exist")
    state = dist_checkpointing.load(model.sharded_state_dict(), it_dir, strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(state, strict=True)


def build_and_load(
    load_dir: str, tp: int, pp: int, dtype: str | None = None, sequence_parallel: bool = False
) -> tuple[ModelSpec, dict, torch.nn.Module]:
    """(spec, meta, model): this rank's stage of the checkpoint's model built at TP x PP (any saved layout),
    with the latest iteration loaded. Collective; call inside a rank. dtype defaults to the saved one."""
    from mindrl.models.builder import build_model
    from mindrl.platform.launch import init_model_parallel

    init_model_parallel(tp, pp)
    spec, meta = read_model_meta(load_dir)
    model = build_model(
        spec,
        meta["role"],
        dtype=dtype or meta["dtype"],
        sequence_parallel=sequence_parallel,
        perform_initialization=False,
    )
    load_model(model, iteration_dir(load_dir, read_tracker(load_dir)))
    return spec, meta, model
