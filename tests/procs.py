"""Process checks shared by the tests that look for leftovers, and the project view the example scripts run in."""

from __future__ import annotations

import glob
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# This pytest session's tag (tests/conftest.py sets it before any test runs): every /dev/shm name a mindrl process
# started by the suite creates carries it, and every process the suite starts (Ray's included) inherits it in its
# environment. The leak checks below look only at what carries it, so a training run beside the suite is not
# mistaken for the suite's leftovers.
SESSION_TAG = f"t{os.getpid()}"


def own_shm_segments() -> list[str]:
    """This session's mindrl segments left in /dev/shm."""
    from mindrl.platform.host import shm_prefix

    return glob.glob(f"/dev/shm/*{shm_prefix()}*")


def started_by_this_session(pid: int | str) -> bool:
    """Whether the process inherited this session's tag (children of killed parents included: the environment
    survives re-parenting). A process we may not read is another user's, not ours."""
    from mindrl.platform.host import SHM_TAG_ENV

    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{SHM_TAG_ENV}={SESSION_TAG}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def alive(pid: int) -> bool:
    """Whether `pid` runs. A zombie (dead, not yet reaped: an orphan's new parent may never reap it) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def check_in_fresh_process(module: str, check: str, **extra_env: str) -> None:
    """Run `module`'s function `check` (it prints "<check>: ok") in a new interpreter, without the MKL vendor shim
    (it turns oneDNN linears off) unless `extra_env` sets LD_PRELOAD: the platform shim and the kernels are installed
    once per process, for good, so installing them in the test process would change every later test."""
    code = f"from {module} import {check}; {check}()"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(extra_env)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith(f"{check}: ok"), proc.stdout[-2000:]


def project_view(tmp_path) -> str:
    """The project's entries linked into a temp dir, so the script runs with its own defaults (OUT, RUN_DIR under
    ./outputs) without writing into the checkout."""
    view = tmp_path / "project"
    view.mkdir()
    for name in os.listdir(ROOT):
        if name not in ("outputs", ".git"):
            os.symlink(os.path.join(ROOT, name), view / name)
    return str(view)


def stop_all(procs, timeout_s: float = 30.0) -> None:
    """Terminate each subprocess.Popen still running, then kill any that outlive `timeout_s`; reap them all."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
