"""tools/setup_env.sh run through a directory of symlinks to the checkout (tests/procs.project_view, as the example
scripts' tests run it) works on the checkout's own .venv: the logical path would have installed the editable package
and the entry points' interpreter path into the temporary view, leaving `.venv/bin/mindrl-*` pointing at a deleted
directory once the view was gone."""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

from tests.procs import project_view

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stamp() -> str:  # setup_env.sh's own: its inputs' text, as `$(cat ...)` gives it (trailing newlines dropped)
    text = b"".join(
        open(os.path.join(ROOT, p), "rb").read()
        for p in ("tools/setup_env.sh", "tools/requirements-cpu.txt", "setup.py")
    )
    return hashlib.sha256(text.rstrip(b"\n")).hexdigest()


def test_setup_env_through_a_view_uses_the_checkouts_venv(tmp_path):
    venv = os.path.join(ROOT, ".venv")
    stamp_file = os.path.join(venv, ".mindrl_env_stamp")
    if not os.path.isfile(stamp_file) or open(stamp_file).read().strip() != _stamp():
        pytest.skip(".venv is not up to date with tools/setup_env.sh (bash tests/run.sh sets it up first)")
    view = project_view(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "VENV"}
    r = subprocess.run(["bash", "tools/setup_env.sh"], cwd=view, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"[setup_env] {os.path.realpath(venv)} is up to date", r.stdout
