"""Per-test CPU time, for budgeting the suite on a shared host: `MINDRL_TEST_CPU=FILE bash tests/run.sh ...` appends one
JSON line per test phase to FILE: its wall seconds and the CPU seconds of everything this worker's session runs (the
pytest process, its reaped children, and every live process carrying the session's tag: Ray, ranks, servers).

Wall time on a loaded host measures the other jobs; CPU time measures the test. What a test's processes spent and
nobody reaped (a process killed with its parent) is missed, so the figure is a lower bound."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.procs import started_by_this_session

ENV = "MINDRL_TEST_CPU"
_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int | str) -> float:
    """utime + stime + cutime + cstime of a process, in seconds (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / _TICK


def session_cpu() -> float:
    """CPU seconds of this process and its reaped children, plus every live tagged process other than this one (a
    tagged process's reaped children are in its own figure; one reaped by another tagged process is in that one's)."""
    me = os.getpid()
    total = _proc_cpu(me)
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me and started_by_this_session(name):
            total += _proc_cpu(name)
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(ENV)
    if not path:
        yield
        return
    t0, c0 = time.monotonic(), session_cpu()
    yield
    row = {
        "test": item.nodeid,
        "wall_s": round(time.monotonic() - t0, 2),
        "cpu_s": round(session_cpu() - c0, 2),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
