"""A run's checkpoint root as training saves write it (layout: docs/trainer.md): which iterations are complete, putting
a written one into place (rename, then the tracker, so a crash mid-save leaves the previous one latest), pruning."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass

from mindrl.checkpoint import mcore_ckpt
from mindrl.checkpoint.hf_io import carry_files

OPTIM_DIR = "optim"
RANK_STATE_DIR = "rank_state"
REF_DIR = "ref"
TRAINER_STATE = "trainer_state.json"
ASYNC_PENDING = "async_pending.msgpack"


@dataclass
class TrainerState:
    """The driver's part of a training iteration (trainer_state.json in the actor's iteration directory)."""

    iteration: int
    loader: dict
    """The prompt sampler's position (`PromptDataLoader.state_dict`)."""
    kl_ctrl: dict
    """The KL controller's state."""
    skipped_in_a_row: int = 0
    """Consecutive iterations whose update was skipped (non-finite loss or gradients)."""
    save_failures: int = 0
    """Periodic saves that could not be written so far (checkpoint/save_failures)."""
    reference_saved: bool = False
    """The iteration holds the synced reference model (REF_DIR)."""
    config_name: str | None = None
    reward_moments: dict | None = None
    """rl_config.normalize_reward's running statistics of the reward model's scores (None: no reward model)."""
    partial_rollout: dict | None = None
    """The prompts and responses in flight with partial_rollout_max_split > 1 (`PartialRollout.state_dict`)."""
    async_rollout: dict | None = None
    """rl_config.async_mode's batches generated ahead of the update (None: synchronous)."""
    async_pending: bytes | None = None
    """Their responses, one experience message (ASYNC_PENDING next to trainer_state.json); None: none pending."""

    def write(self, it_dir: str) -> None:
        state = dataclasses.asdict(self)
        pending = state.pop("async_pending")
        if pending is not None:
            with open(os.path.join(it_dir, ASYNC_PENDING), "wb") as f:
                f.write(pending)
        with open(os.path.join(it_dir, TRAINER_STATE), "w") as f:
            json.dump(state, f, indent=2)

    @classmethod
    def read(cls, it_dir: str) -> TrainerState:
        """The state saved in it_dir (checked complete by `resume.check_train_iteration`)."""
        with open(os.path.join(it_dir, TRAINER_STATE)) as f:
            state = json.load(f)
        return cls(
            iteration=int(state["iteration"]),
            loader=state["loader"],
            kl_ctrl=state["kl_ctrl"],
            skipped_in_a_row=int(state.get("skipped_in_a_row", 0)),
            save_failures=int(state.get("save_failures", 0)),
            reference_saved=bool(state.get("reference_saved", False)),
            config_name=state.get("config_name"),
            reward_moments=state.get("reward_moments"),
            partial_rollout=state.get("partial_rollout"),
            async_rollout=state.get("async_rollout"),
            async_pending=_read_bytes(os.path.join(it_dir, ASYNC_PENDING)),
        )


def _read_bytes(path: str) -> bytes | None:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def critic_dir(cfg, which: str) -> str:
    """The critic's `load` or `save` dir: its own, or `<dir>/critic` when it is the actor's (they never overwrite
    each other, even when both are ./ckpt)."""
    actor, critic = getattr(cfg.actor_config, which), getattr(cfg.critic_config, which)
    if critic and actor and os.path.abspath(critic) == os.path.abspath(actor):
        return os.path.join(critic, "critic")
    return critic


def saved_iterations(save_dir: str) -> list[int]:
    """The complete (renamed into place) iterations under save_dir, oldest first."""
    out = []
    for name in os.listdir(save_dir):
        if name.startswith("iter_") and name[5:].isdigit() and os.path.isdir(os.path.join(save_dir, name)):
            out.append(int(name[5:]))
    return sorted(out)


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
        src, target = os.path.join(hf_files_from, mcore_ckpt.HF_FILES), os.path.join(save_dir, mcore_ckpt.HF_FILES)
        if os.path.isdir(src) and not os.path.isdir(target):
            carry_files(src, target)
    old = None
    if os.path.isdir(final):  # re-saving an iteration (e.g. a resumed run's first save): keep it until replaced
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    mcore_ckpt.write_tracker(save_dir, iteration)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    prune(save_dir, keep_last, iteration)
    return final


def prune(save_dir: str, keep_last: int | None, protect: int) -> None:
    """Delete complete iterations older than the newest `keep_last` (never `protect`, the one just written)."""
    if keep_last is None:
        return
    for old in saved_iterations(save_dir)[:-keep_last]:
        if old != protect:
            shutil.rmtree(mcore_ckpt.iteration_dir(save_dir, old), ignore_errors=True)
