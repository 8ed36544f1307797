"""rl_config.async_mode one_step_off end to end on the tiny GRPO (off-policy: 2 mini-batches x 2 epochs): with
max_staleness 0 it is the synchronous trainer, metric for metric; with 1 every batch trains one version after it was
sampled, corrected by the truncated importance ratio; and a resume from a mid-run checkpoint is exact."""

from __future__ import annotations

import math
import shutil

import pytest

from tests.trainer.rl_helpers import PROFILE, STRAIGHT_EXTRA, _config, _train, assert_same_checkpoints, straight_run

pytestmark = pytest.mark.slow

# the straight GRPO run's settings (rl_helpers.straight_run), without its profiling (no effect on the numbers)
GRPO = [x for x in STRAIGHT_EXTRA["grpo"] if x not in PROFILE]
RUN = ["megatron_training.train_iters=4", "megatron_training.save_interval=2", "rl_config.use_tensorboard=false", *GRPO]
ONE_STEP_OFF = ["rl_config.async_mode=one_step_off"]
RESUME = [f"actor_config.{k}" for k in ("finetune=false", "no_load_optim=false", "no_load_rng=false")]
_RUNS: dict = {}


def _same(a: dict, b: dict) -> dict:
    """The keys of `a` whose values differ from `b`'s beyond float round-off (1e-6); timings, throughputs and the
    engine's weight loads aside (one_step_off's first iteration also generates the batch ahead)."""
    keys = [k for k in a if not k.startswith(("timing/", "async/", "rollout/weight_loads")) and not k.endswith("_tps")]
    assert set(keys) <= set(b), sorted(set(keys) - set(b))
    return {k: (a[k], b[k]) for k in keys if not math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-6)}


def _one_step_off(assets, tmp_path_factory):
    if "one_step_off" not in _RUNS:
        run_dir = tmp_path_factory.mktemp("one_step_off")
        _RUNS["one_step_off"] = (run_dir, _train(_config("grpo_tiny_cpu", assets, run_dir, *RUN, *ONE_STEP_OFF)))
    return _RUNS["one_step_off"]


def test_max_staleness_0_is_the_synchronous_trainer(assets, tmp_path_factory, tmp_path):
    sync = straight_run("grpo", assets, tmp_path_factory).lines
    _, _, lines, _ = _train(
        _config("grpo_tiny_cpu", assets, tmp_path, *RUN, *ONE_STEP_OFF, "rl_config.max_staleness=0")
    )
    assert len(lines) == len(sync) == 4
    for a, b in zip(sync, lines):
        assert not _same(a, b), _same(a, b)
        assert b["async/staleness/max"] == 0.0 and b["async/queue_depth"] == 0.0


def test_one_step_off_trains_one_version_old_experiences(assets, tmp_path_factory):
    _, (_, results, lines, rollouts) = _one_step_off(assets, tmp_path_factory)
    assert [m["async/staleness/max"] for m in lines] == [0.0, 1.0, 1.0, 1.0]  # iteration 1 has nothing ahead of it
    assert [m["async/staleness/mean"] for m in lines] == [0.0, 1.0, 1.0, 1.0]
    assert [m["async/queue_depth"] for m in lines] == [1.0, 1.0, 1.0, 0.0]  # nothing generated past the last one
    for m in lines:
        assert m["async/dropped_stale"] == 0.0
        assert (m["async/trainer_idle_s"] > 0) == (m["iteration"] < 4)  # the last iteration generates nothing
        assert 0 < m["actor/is_weight_mean"] <= 2.0  # truncated at the default threshold
        assert math.isfinite(m["actor/pg_loss"]) and m["async/sampler_tps"] >= 0
    # one version later the rollout's logprobs are further from the trainer's than the same weights' round-off
    # Iteration 1 is the synchronous one; later, the rollout's logprobs (one version old) are further from the
    # trainer's old logprobs than the same weights' round-off is in the synchronous run.
    sync = straight_run("grpo", assets, tmp_path_factory).lines
    assert not _same(sync[0], lines[0]), _same(sync[0], lines[0])
    key = "rollout/logprob_diff_mean"
    assert all(a[key] > b[key] for a, b in zip(lines[1:], sync[1:])), [(a[key], b[key]) for a, b in zip(lines, sync)]


def test_one_step_off_resume_is_exact(assets, tmp_path_factory, tmp_path):
    """The straight run's iteration-2 checkpoint holds iteration 3's batch, generated before update 2."""
    from mindrl.checkpoint import mcore_ckpt

    straight_dir, (_, _, straight, _) = _one_step_off(assets, tmp_path_factory)
    split = tmp_path / "split"
    shutil.copytree(straight_dir, split)
    shutil.rmtree(split / "ckpt_actor" / "iter_0000004")
    mcore_ckpt.write_tracker(str(split / "ckpt_actor"), 2)
    assert (split / "ckpt_actor" / "iter_0000002" / "async_pending.msgpack").is_file()
    cfg = _config("grpo_tiny_cpu", assets, split, *RUN, *ONE_STEP_OFF, *RESUME, actor_load=split / "ckpt_actor")
    _, results, lines, _ = _train(cfg)
    assert [r.iteration for r in results] == [3, 4]
    for a, b in zip(straight[2:], lines[2:]):
        assert not _same(a, b), _same(a, b)
        assert a["async/staleness/max"] == b["async/staleness/max"] == 1.0
    assert_same_checkpoints(straight_dir / "ckpt_actor", split / "ckpt_actor", tmp_path)
