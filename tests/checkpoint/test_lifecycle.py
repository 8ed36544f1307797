"""The driver's side of a save: atomic rename, tracker last, save_total_limit, removing a half-written iteration
(no ranks needed)."""

from __future__ import annotations

import os

import pytest

from mindrl.checkpoint import mcore_ckpt, save
from mindrl.checkpoint.iterations import TrainerState, begin_iteration, finalize_iteration, saved_iterations
from mindrl.checkpoint.save import CheckpointSaveError, RunCheckpoints, SaveAborted


def _save(root, iteration, keep=None):
    tmp = begin_iteration(str(root), iteration)
    open(os.path.join(tmp, "payload"), "w").write(str(iteration))
    return finalize_iteration(str(root), iteration, tmp, None, keep)


def test_keep_last_iterations(tmp_path):
    for it in (2, 4, 6, 8):
        _save(tmp_path, it, keep=2)
    assert saved_iterations(str(tmp_path)) == [6, 8]
    assert mcore_ckpt.read_tracker(str(tmp_path)) == 8


def test_unfinished_save_leaves_the_previous_iteration_latest(tmp_path):
    _save(tmp_path, 2)
    tmp = begin_iteration(str(tmp_path), 4)  # a crash after the workers wrote, before the rename
    open(os.path.join(tmp, "payload"), "w").write("partial")
    assert mcore_ckpt.read_tracker(str(tmp_path)) == 2
    assert saved_iterations(str(tmp_path)) == [2]  # the .tmp dir is not an iteration
    _save(tmp_path, 4, keep=1)  # the next save of the same iteration replaces the leftover
    assert saved_iterations(str(tmp_path)) == [4] and not os.path.exists(tmp)
    assert open(os.path.join(mcore_ckpt.iteration_dir(str(tmp_path), 4), "payload")).read() == "4"


def test_a_half_written_iteration_is_removed_although_a_dying_rank_still_writes(tmp_path, monkeypatch):
    """A failed save's ranks are killed without waiting for their processes: one may still write into the iteration's
    folder after a first removal. `discard` removes it again until it stays gone (a writer stands in for the rank)."""
    import threading
    import time

    folder = tmp_path / "iter_0000002.tmp"
    stop = time.monotonic() + 1.5

    def dying_rank():
        i = 0
        while time.monotonic() < stop:
            try:
                folder.mkdir(exist_ok=True)
                (folder / str(i)).write_text("x")
            except OSError:  # removed under it
                pass
            i += 1
            time.sleep(0.005)

    writer = threading.Thread(target=dying_rank)
    writer.start()
    time.sleep(0.1)
    monkeypatch.setattr(save, "DISCARD_SETTLE_S", 10.0)
    save.discard([str(folder)])
    writer.join()
    assert not folder.exists()


def _run_cfg(root, keep=None):
    from types import SimpleNamespace as NS

    role = dict(load=str(root / "load"), no_save_optim=False, no_save_rng=True)
    return NS(
        actor_config=NS(save=str(root / "ckpt"), **role),
        critic_config=NS(save=str(root / "ckpt"), **role),  # the same dir: the critic's goes under ckpt/critic
        rl_config=NS(needs_critic=True),
        megatron_training=NS(save_total_limit=keep, dtype="float32"),
    )


class _WriterDied(RuntimeError):
    pass


def test_a_runs_save_writes_actor_reference_state_then_critic_and_commits_both(tmp_path):
    """RunCheckpoints.save through stand-in writers: the order, the layout, both trackers, pruning after both."""
    ckpts = RunCheckpoints(_run_cfg(tmp_path, keep=1), writer_errors=(_WriterDied,))
    ckpts.check_writable()
    calls = []

    def write_model(role, it_dir, optim, rng):
        calls.append((role, os.path.basename(it_dir), optim, rng))
        open(os.path.join(it_dir, "payload"), "w").write(role)

    def write_reference(ref_dir):
        calls.append(("ref", os.path.relpath(ref_dir, str(tmp_path))))
        os.makedirs(ref_dir)

    for it in (1, 2):
        ckpts.save(it, TrainerState(it, {"pos": it}, {"value": 0.1}), write_model, write_reference)
    assert calls[:3] == [
        ("actor", "iter_0000001.tmp", True, False),
        ("ref", os.path.join("ckpt", "iter_0000001.tmp", "ref")),
        ("critic", "iter_0000001.tmp", True, False),
    ]
    actor, critic = str(tmp_path / "ckpt"), str(tmp_path / "ckpt" / "critic")
    assert saved_iterations(actor) == [2] and saved_iterations(critic) == [2]
    assert mcore_ckpt.read_tracker(actor) == 2 and mcore_ckpt.read_tracker(critic) == 2
    state = TrainerState.read(mcore_ckpt.iteration_dir(actor, 2))
    assert state.iteration == 2 and state.loader == {"pos": 2} and state.save_failures == 0
    assert ckpts.resume_hint() == f"; the last complete checkpoint is iteration 2 in {actor}"


def test_a_failed_write_removes_the_half_written_iteration(tmp_path):
    """An OSError is a CheckpointSaveError, a writer's own error a SaveAborted naming the disk; neither leaves a
    temporary directory or moves a tracker."""
    ckpts = RunCheckpoints(_run_cfg(tmp_path), writer_errors=(_WriterDied,))
    state = TrainerState(3, {}, {})

    def fails_on_the_critic(error):
        def write_model(role, it_dir, optim, rng):
            if role == "critic":
                raise error

        return write_model

    with pytest.raises(CheckpointSaveError, match=r"iteration 3 could not be saved \(.*disk full.*\); the previous"):
        ckpts.save(3, state, fails_on_the_critic(OSError(28, "disk full")))
    with pytest.raises(SaveAborted, match=r"^iteration 3: saving failed: rank 1 died \(the disk holding .* free") as e:
        ckpts.save(3, state, fails_on_the_critic(_WriterDied("rank 1 died")))
    assert isinstance(e.value.__cause__, _WriterDied)
    for root in (tmp_path / "ckpt", tmp_path / "ckpt" / "critic"):
        assert not [n for n in os.listdir(root) if n != "critic"]
