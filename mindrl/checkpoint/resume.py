"""Which iteration a run resumes from: the newest one complete for every model it trains, falling back past corrupted
ones with a warning, never silently restarting."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from mindrl.checkpoint import mcore_ckpt
from mindrl.checkpoint.hf_io import CheckpointError
from mindrl.checkpoint.iterations import OPTIM_DIR, RANK_STATE_DIR, REF_DIR, TRAINER_STATE, critic_dir, saved_iterations

logger = logging.getLogger("mindrl.checkpoint")


@dataclass(frozen=True)
class ResumePoint:
    iteration: int
    actor_dir: str
    """The actor's iteration directory (holds trainer_state.json)."""
    critic_dir: str | None = None
    ref_dir: str | None = None
    """The synced reference model saved in the actor's iteration (its ref/, a weights-only checkpoint) when the run
    syncs it (rl_config.sync_ref_model); None: the reference is built from ref_model_load_path."""


def is_train_iteration(it_dir: str) -> bool:
    """Whether the directory was written by a training save (as opposed to a weights-only conversion).

    A *training* iteration holds the model, its `rank_state/` and usually `optim/`; the actor's also holds
    `trainer_state.json` and, with rl_config.sync_ref_model, the synced reference model (`ref/`). A *weights-only*
    iteration (`mindrl-convert hf2mcore`, `release`) holds the model alone: a run starts from it at iteration 0."""
    return any(os.path.exists(os.path.join(it_dir, n)) for n in (RANK_STATE_DIR, OPTIM_DIR, TRAINER_STATE))


def check_train_iteration(it_dir: str, trainer_state: bool) -> None:
    """Raise CheckpointError naming the first missing, truncated or unreadable file of a training iteration."""
    root, name = os.path.split(it_dir.rstrip("/"))
    mcore_ckpt.read_model_meta(root, int(name[5:]) if name.startswith("iter_") else name)
    mcore_ckpt.check_files(it_dir)
    optim = os.path.join(it_dir, OPTIM_DIR)
    if os.path.isdir(optim):
        mcore_ckpt.check_files(optim)
    rank0 = os.path.join(it_dir, RANK_STATE_DIR, "rank_0.pt")
    if not os.path.isfile(rank0):
        raise CheckpointError(f"{rank0} is missing: no scheduler / RNG state (incomplete copy?)")
    try:
        world = int(torch.load(rank0, weights_only=False, map_location="cpu")["world_size"])
    except Exception as e:  # truncated, or not ours
        raise CheckpointError(f"{rank0} is truncated or corrupted ({type(e).__name__}: {e})") from None
    for r in range(1, world):
        path = os.path.join(it_dir, RANK_STATE_DIR, f"rank_{r}.pt")
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            raise CheckpointError(f"{path} is missing or empty: the save had {world} ranks (incomplete copy?)")
    ref_saved = False  # the trainer state says the iteration holds a synced reference
    if trainer_state:
        path = os.path.join(it_dir, TRAINER_STATE)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: the iteration has model state but no trainer state")
        try:
            with open(path) as f:
                state = json.load(f)
            missing = [k for k in ("iteration", "loader", "kl_ctrl") if k not in state]
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{path} is truncated or corrupted ({type(e).__name__}: {e})") from None
        if missing:
            raise CheckpointError(f"{path} lacks {', '.join(missing)}: not a mindrl trainer state")
        ref_saved = bool(state.get("reference_saved"))
    if ref_saved or os.path.isdir(os.path.join(it_dir, REF_DIR)):
        check_reference(os.path.join(it_dir, REF_DIR))


def check_reference(ref_dir: str) -> None:
    """A synced reference saved with an iteration (`ref/`): tracker, model description and every shard."""
    if not os.path.isdir(ref_dir):
        raise CheckpointError(
            f"{ref_dir} is missing: the run syncs its reference model (rl_config.sync_ref_model) and saved it there"
        )
    mcore_ckpt.read_model_meta(ref_dir)  # the tracker and the description
    mcore_ckpt.check_files(mcore_ckpt.iteration_dir(ref_dir, mcore_ckpt.read_tracker(ref_dir)))


def _candidates(root: str, what: str, trainer_state: bool) -> tuple[list[int], dict[int, str], bool]:
    """(complete training iterations of `root` up to its tracker, newest first; {iteration: why rejected};
    whether root is a weights-only checkpoint to start from at iteration 0)."""
    try:
        tracked = mcore_ckpt.read_tracker(root)
    except CheckpointError as e:
        if not os.path.isdir(root) or not saved_iterations(root):
            raise CheckpointError(f"{what}={root!r}: {e}") from None
        logger.warning("%s: %s; looking for the newest complete iteration instead", what, e)
        tracked = None
    if tracked == mcore_ckpt.RELEASE:
        return [], {}, True
    tracked_dir = None if tracked is None else mcore_ckpt.iteration_dir(root, tracked)
    if tracked_dir is not None and os.path.isdir(tracked_dir) and not is_train_iteration(tracked_dir):
        return [], {}, True
    good, bad = [], {}
    if tracked_dir is not None and not os.path.isdir(tracked_dir):
        bad[int(tracked)] = f"{tracked_dir} does not exist (named by {os.path.join(root, mcore_ckpt.TRACKER)})"
    for it in reversed(saved_iterations(root)):
        if tracked is not None and it > int(tracked):
            continue  # renamed into place but the tracker was never moved on: not committed
        it_dir = mcore_ckpt.iteration_dir(root, it)
        if not is_train_iteration(it_dir):
            continue
        try:
            check_train_iteration(it_dir, trainer_state)
            good.append(it)
        except CheckpointError as e:
            bad[it] = str(e)
    return good, bad, False


def find_resume(cfg) -> ResumePoint | None:
    """Where a run of `cfg` resumes: the newest iteration complete for the actor (and the critic, if the run has
    one), or None to start from the loaded weights at iteration 0 (finetune: true, or a weights-only checkpoint).
    A corrupted newest iteration falls back to the previous complete one with a warning; with none left, a
    CheckpointError names every problem found."""
    a = cfg.actor_config
    if a.finetune or not a.load:
        return None
    good, bad, weights_only = _candidates(a.load, "actor_config.load", trainer_state=True)
    if weights_only:
        return None
    critic_root = None
    if cfg.rl_config.needs_critic:
        c = cfg.critic_config
        critic_root = critic_dir(cfg, "load")
        if c.finetune or not critic_root:
            raise CheckpointError(
                f"the actor resumes from actor_config.load={a.load!r} (finetune: false) but the critic does not "
                f"(critic_config.load={c.load!r}, finetune: {c.finetune}): resume both, or set finetune: true on both"
            )
        c_good, c_bad, c_weights_only = _candidates(critic_root, "critic_config.load", trainer_state=False)
        if c_weights_only:
            raise CheckpointError(
                f"the actor resumes from {a.load!r} but the critic's checkpoint {critic_root!r} holds weights only: "
                "resume both from the same saved run"
            )
        for it in good:
            if it not in c_good:
                bad.setdefault(it, f"the critic has no complete iteration {it} under {critic_root!r}")
        bad.update({it: f"critic: {why}" for it, why in c_bad.items() if it not in bad})
        good = [it for it in good if it in c_good]
    if not good:
        problems = "; ".join(f"iteration {it}: {why}" for it, why in sorted(bad.items(), reverse=True))
        raise CheckpointError(
            f"actor_config.load={a.load!r} has no complete training iteration to resume from"
            + (f" ({problems})" if problems else "")
            + ": fix or remove the damaged files, or set finetune: true to start from weights at iteration 0"
        )
    it = good[0]
    newer = {k: v for k, v in bad.items() if k > it}
    if newer:
        logger.warning(
            "resuming from iteration %d, not the newest: %s",
            it,
            "; ".join(f"iteration {k}: {v}" for k, v in sorted(newer.items(), reverse=True)),
        )
    actor_dir = mcore_ckpt.iteration_dir(a.load, it)
    return ResumePoint(
        it,
        actor_dir,
        None if critic_root is None else mcore_ckpt.iteration_dir(critic_root, it),
        _synced_reference(cfg, actor_dir),
    )


def _synced_reference(cfg, actor_dir: str) -> str | None:
    """The reference a resumed run continues from: the iteration's synced copy when the run syncs (and saved one),
    else None (ref_model_load_path, the original reference)."""
    rl = cfg.rl_config
    ref, saved = os.path.join(actor_dir, REF_DIR), os.path.isdir(os.path.join(actor_dir, REF_DIR))
    original = rl.integrated_mode_config.ref_model_load_path or cfg.actor_config.load
    if rl.sync_ref_model and rl.needs_reference:
        if saved:
            return ref
        logger.warning(
            "%s holds no synced reference (ref/: the run was saved without rl_config.sync_ref_model); the reference "
            "starts again from %r and is synced from here on",
            actor_dir,
            original,
        )
    elif saved:
        logger.warning(
            "%s holds a synced reference (ref/), but rl_config.sync_ref_model is false now: the reference is the "
            "original %r",
            actor_dir,
            original,
        )
    return None
