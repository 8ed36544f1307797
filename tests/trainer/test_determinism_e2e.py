"""Determinism (megatron_training.npu_deterministic): a second run of the straight PPO config (rl_helpers.straight_run:
4 iterations, critic, reference, adaptive KL, saved at 2 and 4) with the switch on gives the shared run's metrics,
rollouts and checkpoints bit for bit: two runs of one config are the same, and on CPU the switch changes no bit."""

from __future__ import annotations

import json

import pytest

from tests.trainer.rl_helpers import STRAIGHT_EXTRA, _config, _train, assert_same_checkpoints, straight_run

pytestmark = pytest.mark.slow  # a trainer run: Ray and the worker processes


def _results(lines: list[dict]) -> list[dict]:
    """What a run computes, without how long it took."""
    return [{k: v for k, v in m.items() if not k.startswith("timing/") and not k.endswith("_tps")} for m in lines]


def test_two_runs_are_bit_equal(assets, tmp_path_factory, tmp_path):
    first = straight_run("ppo", assets, tmp_path_factory)
    run_dir = tmp_path / "again"
    cfg = _config(
        "ppo_tiny_cpu", assets, run_dir, "megatron_training.train_iters=4", "megatron_training.save_interval=2",
        *STRAIGHT_EXTRA["ppo"], "megatron_training.npu_deterministic=true",
    )  # fmt: skip
    _, _, lines, rollouts = _train(cfg)
    a, b = _results(first.lines), _results(lines)
    assert len(a) == len(b) == 4 and all("actor/pg_loss" in m and "critic/score/mean" in m for m in b)
    for it, (x, y) in enumerate(zip(a, b), 1):  # ==: bit for bit, every loss, reward, KL, norm and length
        assert x.keys() == y.keys()
        differ = {k: (x[k], y[k]) for k in x if x[k] != y[k]}
        assert not differ, f"iteration {it}: {differ}"
    assert [json.dumps(r, sort_keys=True) for r in rollouts] == [json.dumps(r, sort_keys=True) for r in first.rollouts]
    for role in ("actor", "critic"):  # weights and optimizer state of iteration 4
        assert_same_checkpoints(first.run_dir / f"ckpt_{role}", run_dir / f"ckpt_{role}", tmp_path)
