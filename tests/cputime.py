"""Per-test CPU time, for budgeting the suite on a shared host: `MINDRL_TEST_CPU=FILE bash tests/run.sh ...` appends one
JSON line per test to FILE: its wall seconds and the CPU seconds of everything this worker's session runs (the pytest
process, its reaped children, and every process carrying the session's tag: Ray, ranks, servers).

Wall time on a loaded host measures the other jobs; CPU time measures the test. A process killed unreaped (Ray's
workers go with their raylet) takes its CPU time with it, so the tagged processes are sampled every 0.5 s while the
test runs and each counts with the most it was seen to have spent: what one spent in its last half second is missed.
The figure is a lower bound."""

from __future__ import annotations

import json
import os
import threading
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


def tagged_cpu() -> dict[int, float]:
    """CPU seconds of every live tagged process other than this one (a tagged process's reaped children are in its
    own figure; one reaped by another tagged process is in that one's)."""
    me = os.getpid()
    return {
        int(name): _proc_cpu(name)
        for name in os.listdir("/proc")
        if name.isdigit() and int(name) != me and started_by_this_session(name)
    }


class _Sampler(threading.Thread):
    """Each tagged process's largest CPU figure seen since the start (pid -> seconds)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.seen: dict[int, float] = tagged_cpu()
        self.start_figures = dict(self.seen)
        self._done = threading.Event()
        self.start()

    def _sample(self) -> None:
        for pid, cpu in tagged_cpu().items():
            self.seen[pid] = max(cpu, self.seen.get(pid, 0.0))

    def run(self) -> None:
        while not self._done.wait(0.5):
            self._sample()

    def finish(self) -> float:
        """CPU seconds the tagged processes spent since the start."""
        self._done.set()
        self.join()
        self._sample()
        return sum(cpu - self.start_figures.get(pid, 0.0) for pid, cpu in self.seen.items())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(ENV)
    if not path:
        yield
        return
    t0, own0, sampler = time.monotonic(), _proc_cpu(os.getpid()), _Sampler()
    yield
    cpu = _proc_cpu(os.getpid()) - own0 + sampler.finish()
    row = {
        "test": item.nodeid,
        "wall_s": round(time.monotonic() - t0, 2),
        "cpu_s": round(cpu, 2),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
