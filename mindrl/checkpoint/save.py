"""Saving a run's checkpoints from the driver: which models, whether a save fits (checked before any rank writes),
writing and committing an iteration, pruning old ones, and removing a half-written one after a failure."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

from mindrl.checkpoint import mcore_ckpt
from mindrl.checkpoint.hf_io import CheckpointError
from mindrl.checkpoint.iterations import (
    REF_DIR,
    TrainerState,
    begin_iteration,
    critic_dir,
    finalize_iteration,
    prune,
    saved_iterations,
)
from mindrl.checkpoint.resume import is_train_iteration

logger = logging.getLogger("mindrl.checkpoint")

SAVE_MARGIN = 1.10
"""A save is refused up front when the disk holds less than this times the expected checkpoint size."""
DISCARD_SETTLE_S = 30.0
"""How long `discard` keeps removing a half-written iteration that reappears."""


class CheckpointSaveError(CheckpointError):
    """A save could not be written (unwritable path, full disk); the previous checkpoint is untouched."""


class SaveAborted(CheckpointError):
    """A writer failed mid-save (e.g. a rank on a full disk; its worker group is gone, the run cannot go on). The
    half-written iteration was removed and the previous checkpoint is intact; the writer's error is the cause."""


# ------------------------------------------------------------------------------------------------ space
def last_iteration_nbytes(save_dir: str) -> int | None:
    """Size of the newest complete iteration under save_dir (what the next save will need), if any."""
    if not os.path.isdir(save_dir):
        return None
    done = saved_iterations(save_dir)
    return mcore_ckpt.dir_nbytes(mcore_ckpt.iteration_dir(save_dir, done[-1])) if done else None


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def estimate_nbytes(load_dir: str | None, dtype: str, with_optim: bool) -> int | None:
    """What the first save of a model loaded from load_dir will take: that iteration's size if it is a training
    save; else its parameter count (weights-only files / their dtype) times the bytes per parameter of the
    weights in `dtype` plus Adam's fp32 moments (and fp32 main params when training in half precision). None
    when it cannot be told (then only writability is checked)."""
    try:
        it = mcore_ckpt.read_tracker(load_dir)
        it_dir = mcore_ckpt.iteration_dir(load_dir, it)
        if is_train_iteration(it_dir):
            return mcore_ckpt.dir_nbytes(it_dir)
        _, meta = mcore_ckpt.read_model_meta(load_dir, it)
        params = mcore_ckpt.dir_nbytes(it_dir) / _DTYPE_BYTES[meta["dtype"]]
        per_param = _DTYPE_BYTES[dtype] + ((8 if dtype == "float32" else 12) if with_optim else 0)
        return int(params * per_param)
    except Exception:  # not ours to judge here: loading reports a broken load dir
        return None


def check_writable(save_dir: str, what: str) -> None:
    """Create save_dir if needed and write a probe file: an unwritable `save` fails before any work is done."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        probe = os.path.join(save_dir, f".mindrl_write_probe_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointSaveError(f"{what}={save_dir!r} is not writable: {e.strerror or e}") from None


def check_space(save_dir: str, need_bytes: int, what: str) -> None:
    """Refuse a save the disk cannot hold (with a margin), before any rank writes."""
    free = shutil.disk_usage(save_dir).free
    if free < need_bytes * SAVE_MARGIN:
        raise CheckpointSaveError(
            f"{what}={save_dir!r}: {free / 2**20:.1f} MiB free, but a checkpoint takes about "
            f"{need_bytes / 2**20:.1f} MiB; free some space or lower megatron_training.save_total_limit"
        )


def free_space_note(save_dir: str) -> str:
    """What a failed save's message says about the disk (torch's writers report a full disk obscurely, e.g.
    "basic_ios::clear: iostream error")."""
    try:
        free = shutil.disk_usage(save_dir).free
    except OSError as e:
        return f"{save_dir}: {e.strerror or e}"
    full = " - the disk is full" if free < 2**20 else ""
    return f"the disk holding {save_dir} has {free / 2**20:.1f} MiB free{full}"


def discard(tmps: list[str]) -> None:
    """Remove half-written iteration folders. A failed group's ranks are killed without waiting for their
    processes to exit (see `group.collect`), so a dying rank's last writes can land after a first removal: remove
    each folder again until it stays gone for 0.5 s, for up to DISCARD_SETTLE_S; a warning names one that
    remains."""
    deadline = time.monotonic() + DISCARD_SETTLE_S
    for tmp in tmps:
        while True:
            shutil.rmtree(tmp, ignore_errors=True)
            time.sleep(0.5)
            if not os.path.exists(tmp) or time.monotonic() > deadline:
                break
        if os.path.exists(tmp):
            logger.warning("could not remove the half-written checkpoint %s; delete it by hand", tmp)


# ------------------------------------------------------------------------------------------------ a run's saves
@dataclass(frozen=True)
class SaveTarget:
    """One model a run saves."""

    key: str
    """The config key of its save dir (actor_config.save, critic_config.save): errors name it."""
    role: str
    """actor or critic."""
    save_dir: str
    load_dir: str | None
    """Where it was loaded from: its hf_files are carried over, and it sizes the first save."""
    save_optim: bool
    save_rng: bool


def save_targets(cfg) -> list[SaveTarget]:
    """Every model a run of `cfg` saves: the actor, then the critic (if the run has one)."""
    a, c = cfg.actor_config, cfg.critic_config
    out = []
    if a.save:
        out.append(SaveTarget("actor_config.save", "actor", a.save, a.load, not a.no_save_optim, not a.no_save_rng))
    if cfg.rl_config.needs_critic and c is not None and c.save:
        save, load = critic_dir(cfg, "save"), critic_dir(cfg, "load")
        out.append(SaveTarget("critic_config.save", "critic", save, load, not c.no_save_optim, not c.no_save_rng))
    return out


WriteModel = Callable[[str, str, bool, bool], None]
"""(role, iteration dir, with optimizer state, with RNG state): the model's ranks write their state into the dir."""


class RunCheckpoints:
    """The checkpoints a run of `cfg` saves. `save` writes one iteration through the writers the trainer hands it
    (the trainer owns the worker groups); a writer raising one of `writer_errors` counts as a failed write."""

    def __init__(self, cfg, writer_errors: tuple[type[BaseException], ...] = ()):
        self.targets = save_targets(cfg)
        self.keep_last = cfg.megatron_training.save_total_limit
        self.dtype = cfg.megatron_training.dtype
        self.actor_save = cfg.actor_config.save
        self.writer_errors = writer_errors

    def check_writable(self) -> None:
        """Every save dir can be written (created if needed): raises CheckpointSaveError naming the one that
        cannot, before any work is done."""
        for t in self.targets:
            check_writable(t.save_dir, t.key)

    def check_save_space(self) -> None:
        """Refuse, before any rank writes, a save the disk cannot hold: its size is the last saved iteration's, or
        for the first save an estimate from the loaded checkpoint (see `estimate_nbytes`)."""
        by_device: dict[int, list[tuple[str, str, int]]] = {}
        for t in self.targets:
            check_writable(t.save_dir, t.key)
            need = last_iteration_nbytes(t.save_dir)
            if need is None:
                need = estimate_nbytes(t.load_dir, self.dtype, t.save_optim)
            by_device.setdefault(os.stat(t.save_dir).st_dev, []).append((t.key, t.save_dir, need or 0))
        for entries in by_device.values():
            key, save_dir, _ = entries[0]
            check_space(save_dir, sum(n for _, _, n in entries), key)

    def save(
        self,
        iteration: int,
        state: TrainerState,
        write_model: WriteModel,
        write_reference: Callable[[str], None] | None = None,
    ) -> None:
        """Actor (with the driver's `state`, and the synced reference through write_reference when given) and
        critic at `iteration`. Both are written to temporary directories first, then each is renamed into place
        and its tracker updated; old iterations are pruned only after both trackers moved on, so a crash at any
        point leaves an iteration that both have complete. A save that cannot fit, or whose files cannot be
        written, raises CheckpointSaveError; a failed writer, SaveAborted. Either way the half-written iteration
        is removed and the previous checkpoint is untouched."""
        if not self.targets:
            return
        t0 = time.perf_counter()
        self.check_save_space()
        tmps: list[str] = []
        try:
            for t in self.targets:
                tmps.append(begin_iteration(t.save_dir, iteration))
                write_model(t.role, tmps[-1], t.save_optim, t.save_rng)
                if t.role == "actor":
                    if write_reference is not None:
                        write_reference(os.path.join(tmps[-1], REF_DIR))
                    state.write(tmps[-1])
        except OSError as e:
            discard(tmps)
            raise CheckpointSaveError(
                f"iteration {iteration} could not be saved ({e}); the previous checkpoint is intact"
            ) from e
        except self.writer_errors as e:  # a rank failed writing (e.g. the disk filled up): its group is gone
            discard(tmps)
            disk = "; ".join(free_space_note(t.save_dir) for t in self.targets)
            raise SaveAborted(f"iteration {iteration}: saving failed: {e} ({disk})") from e
        for t, tmp in zip(self.targets, tmps):
            finalize_iteration(t.save_dir, iteration, tmp, t.load_dir)
        for t in self.targets:
            prune(t.save_dir, self.keep_last, iteration)
        logger.info("iteration %d saved in %.1f s", iteration, time.perf_counter() - t0)

    def resume_hint(self) -> str:
        """For an error that ends the run: where it can resume from ("" when nothing was saved)."""
        save = self.actor_save
        if not save or not os.path.isdir(save):
            return ""
        try:
            return f"; the last complete checkpoint is iteration {mcore_ckpt.read_tracker(save)} in {save}"
        except Exception:
            return ""
