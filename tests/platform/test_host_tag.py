"""The suite's leak checks see only what this session started: a mindrl job beside it (untagged shm names, processes
without the session's tag) is not mistaken for a leftover."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mindrl.platform.host import SHM_TAG_ENV, shm_prefix
from tests.procs import SESSION_TAG, own_shm_segments, started_by_this_session


def test_the_session_tag_names_our_segments_and_marks_our_processes(tmp_path):
    assert shm_prefix() == f"mindrl{SESSION_TAG}"
    foreign = f"/dev/shm/mindrl_reshard_{os.getpid()}_foreign"  # another job's name: no tag
    ours = f"/dev/shm/{shm_prefix()}_reshard_{os.getpid()}_ours"
    other_env = {k: v for k, v in os.environ.items() if k != SHM_TAG_ENV}
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    # os.environ given explicitly: what Python code (Ray's driver included) hands its children. Inheriting the C-level
    # environment instead failed once in a suite run, the tag missing though os.environ had it (unexplained).
    procs = [subprocess.Popen(sleep, env=other_env), subprocess.Popen(sleep, env=dict(os.environ))]
    try:
        for path in (foreign, ours):
            open(path, "wb").close()
        assert ours in own_shm_segments() and foreign not in own_shm_segments()
        assert not started_by_this_session(procs[0].pid)  # a job started elsewhere
        assert started_by_this_session(procs[1].pid)  # inherits the tag, as Ray's processes do from the driver
        assert not started_by_this_session(2**22 + 1)  # no such process
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for path in (foreign, ours):
            os.unlink(path)


def test_a_tag_that_cannot_be_part_of_a_file_name_is_refused(monkeypatch):
    monkeypatch.setenv(SHM_TAG_ENV, "a/b")
    with pytest.raises(ValueError, match="MINDRL_SHM_TAG='a/b'"):
        shm_prefix()
