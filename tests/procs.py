"""Process checks shared by the tests that look for leftovers, and the project view the example scripts run in."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
