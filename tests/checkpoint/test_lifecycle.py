"""The driver's side of a save: atomic rename, tracker last, save_total_limit, removing a half-written iteration
(no ranks needed)."""

from __future__ import annotations

import os

from mindrl.checkpoint import mcore_ckpt, save
from mindrl.checkpoint.iterations import begin_iteration, finalize_iteration, saved_iterations


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
