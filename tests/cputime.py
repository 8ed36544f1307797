"""Per-test CPU time, for budgeting the suite on a shared host: `MINDRL_TEST_CPU=FILE bash tests/run.sh ...` appends one
JSON line per test to FILE: its wall seconds and the CPU seconds of everything this worker's session runs (the pytest
process, its reaped children, and every process carrying the session's tag: Ray, ranks, servers).

Wall time on a loaded host measures the other jobs; CPU time measures the test. A process killed unreaped (Ray's
workers go with their raylet) takes its CPU time with it, so the tagged processes are sampled every 0.5 s while the
test runs and each counts with the most it was seen to have spent: what one spent in its last half second is missed.
The figure is a lower bound.

Where the host lets us make a cgroup (v1 `cpuacct`, as root in a container), the worker moves itself into a cgroup of
its own at its first test and each test's figure is that cgroup's CPU counter's rise instead: exact, daemons and
killed processes included (`"how": "cgroup"` in the row; `"sampled"` otherwise)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from tests.procs import started_by_this_session

ENV = "MINDRL_TEST_CPU"
_TICK = os.sysconf("SC_CLK_TCK")
_CPUACCT = "/sys/fs/cgroup/cpuacct"
_cgroup: list[str | None] = []  # [path of this worker's cgroup, or None where none could be made]


def _own_cgroup() -> str | None:
    """This process's cpuacct cgroup, made and joined on the first call; None where the host does not allow it."""
    if not _cgroup:
        path = os.path.join(_CPUACCT, f"mindrl-test-{os.getpid()}")
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            _cgroup.append(path)
        except OSError:
            _cgroup.append(None)
    return _cgroup[0]


def _cgroup_cpu(path: str) -> float:
    with open(os.path.join(path, "cpuacct.usage")) as f:
        return int(f.read()) / 1e9


def leave_cgroup() -> None:
    """At the session's end (conftest): leaves the worker's cgroup and removes it (it stays while processes of the session live in it)."""
    if _cgroup and _cgroup[0]:
        try:
            with open(os.path.join(_CPUACCT, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            os.rmdir(_cgroup[0])
        except OSError:
            pass


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
    group = _own_cgroup()
    t0 = time.monotonic()
    if group:
        cpu0 = _cgroup_cpu(group)
        yield
        cpu = _cgroup_cpu(group) - cpu0
    else:
        own0, sampler = _proc_cpu(os.getpid()), _Sampler()
        yield
        cpu = _proc_cpu(os.getpid()) - own0 + sampler.finish()
    row = {
        "test": item.nodeid,
        "wall_s": round(time.monotonic() - t0, 2),
        "cpu_s": round(cpu, 2),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "how": "cgroup" if group else "sampled",
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
