"""Megatron checkpoints as mindrl writes them: a root with a latest-iteration tracker (`release` or the iteration) and
one dist_checkpointing directory + mindrl_model.json per iteration, loadable at any TP/PP; HF files under hf_files/."""

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
    with open(path, errors="replace") as f:  # a crash can leave binary garbage: say so, not UnicodeDecodeError
        text = f.read().strip()
    if text == RELEASE:
        return RELEASE
    if not text:
        raise CheckpointError(f"{path} is empty (interrupted save?): expected 'release' or an iteration number")
    try:
        iteration = int(text)
    except ValueError:
        iteration = -1
    if iteration < 0:
        raise CheckpointError(f"{path}: expected 'release' or an iteration number, found {text!r}")
    return iteration


def write_model_meta(
    it_dir: str, spec: ModelSpec, role: str, tp: int, pp: int, dtype: str, lora: dict | None = None
) -> None:
    """lora: a LoRA model's adapter settings (`mindrl.models.lora.lora_meta`), for loaders to rebuild its adapters."""
    meta = {"format_version": FORMAT_VERSION, "role": role, "tp": tp, "pp": pp, "dtype": dtype, "spec": spec.to_dict()}
    if lora:
        meta["lora"] = lora
    with open(os.path.join(it_dir, MODEL_META), "w") as f:
        json.dump(meta, f, indent=2)


def read_model_meta(root: str, iteration: int | str | None = None) -> tuple[ModelSpec, dict]:
    """(spec, meta) of the checkpoint's latest (or given) iteration."""
    from_tracker = iteration is None
    iteration = read_tracker(root) if iteration is None else iteration
    it_dir = iteration_dir(root, iteration)
    if not os.path.isdir(it_dir):
        named = f"iteration {iteration!r}" + (f" (named by {os.path.join(root, TRACKER)})" if from_tracker else "")
        raise CheckpointError(f"{named}, but {it_dir} does not exist (deleted, or the copy is incomplete)")
    path = os.path.join(it_dir, MODEL_META)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint was not written by mindrl or is incomplete")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        return ModelSpec.from_dict(meta["spec"]), meta
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:  # binary garbage from an interrupted copy
        raise CheckpointError(f"{path}: not UTF-8 JSON text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: JSON nested too deeply to be a model description") from None
    except (KeyError, TypeError) as e:  # hand-edited: a key missing, renamed or added
        raise CheckpointError(f"{path}: not a mindrl model description ({type(e).__name__}: {e})") from None


def check_files(it_dir: str) -> None:
    """Every file dist_checkpointing will read is there, and each shard is as long as `.metadata` says: a
    copy or save interrupted mid-way fails here, naming the file, not deep inside torch.distributed."""
    if not os.path.isdir(it_dir):
        raise CheckpointError(f"checkpoint iteration directory {it_dir!r} does not exist")
    for name in ("metadata.json", "common.pt"):
        if not os.path.isfile(os.path.join(it_dir, name)):
            raise CheckpointError(f"{os.path.join(it_dir, name)} is missing: the checkpoint is incomplete")
    path = os.path.join(it_dir, "metadata.json")
    try:
        with open(path) as f:
            backend = json.load(f)["sharded_backend"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is corrupted ({type(e).__name__}: {e})") from None
    if backend != "torch_dist":  # the only format mindrl writes; other backends keep their own layout
        return
    from torch.distributed.checkpoint import FileSystemReader

    path = os.path.join(it_dir, ".metadata")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    try:
        storage = FileSystemReader(it_dir).read_metadata().storage_data or {}
    except Exception as e:  # an unpickling error of some kind
        raise CheckpointError(f"{path} is truncated or corrupted ({type(e).__name__}: {e})") from None
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        shard = os.path.join(it_dir, name)
        if not os.path.isfile(shard):
            raise CheckpointError(f"shard {shard} is missing (listed in {path}): the checkpoint is incomplete")
        size = os.path.getsize(shard)
        if size < end:
            raise CheckpointError(f"shard {shard} is truncated: {size} bytes, but {path} needs {end}")


def dir_nbytes(path: str) -> int:
    """Bytes of the files under path (a checkpoint's size on disk)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def save_model(model: torch.nn.Module, it_dir: str) -> None:
    """Collective over all ranks: each writes its own shards (replicas are written once)."""
    from megatron.core import dist_checkpointing

    os.makedirs(it_dir, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), it_dir)


def load_model(model: torch.nn.Module, it_dir: str, skip: tuple[str, ...] = (), only_adapters: bool = False) -> None:
    """Collective; works whatever TP/PP the checkpoint was saved with (dist_checkpointing reshards). skip: name
    prefixes of the model's tensors not to load (left as they are; the checkpoint's own may be unused).
    only_adapters: a LoRA model's adapters alone (from an adapter-only checkpoint, lora_ckpt_filter)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    check_files(it_dir)
    full = model.sharded_state_dict()
    adapters = [k for k in full if ".lora.lora_" in k]
    if only_adapters:
        skip = (*skip, *(k for k in full if ".lora.lora_" not in k))
    elif adapters and full[adapters[0]].key not in dist_checkpointing.load_tensors_metadata(it_dir):
        # A LoRA model from a checkpoint without adapters (the base model): they keep their initial values.
        skip = (*skip, *adapters)
    sharded = {k: v for k, v in full.items() if not k.startswith(skip)} if skip else None
    strict = StrictHandling.ASSUME_OK_UNEXPECTED if skip else StrictHandling.RAISE_ALL
    try:
        state = dist_checkpointing.load(sharded or full, it_dir, strict=strict)
    except Exception as e:  # e.g. a shard of the right size holding corrupted bytes
        raise CheckpointError(f"cannot load the model from {it_dir}: {type(e).__name__}: {e}") from e
    if not skip:
        model.load_state_dict(state, strict=True)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = [k for k in missing if not k.startswith(skip) and not k.endswith("_extra_state")]
    if left or unexpected:
        raise CheckpointError(f"{it_dir}: tensors missing {left[:5]}, unexpected {list(unexpected)[:5]}")
