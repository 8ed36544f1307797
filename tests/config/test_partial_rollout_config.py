"""rl_config.partial_rollout_max_split at load: the values it takes, the errors, and require_max_age_all_finished
listed as ignored."""

from __future__ import annotations

from mindrl.config import load_config
from tests.config.test_errors import errors, issue

KEY = "rl_config.partial_rollout_max_split"


def test_split_loads_and_one_is_off():
    from mindrl.rollout.base import SamplingConfig
    from mindrl.trainer.pipeline.partial import from_config

    cfg = load_config("grpo_tiny_cpu", overrides=[f"{KEY}=3", "+rl_config.require_max_age_all_finished=true"])
    pool = from_config(cfg, SamplingConfig(max_tokens=25))
    assert (pool.max_split, pool.piece, pool.batch_size) == (3, 9, cfg.megatron_training.global_batch_size)
    assert "rl_config.require_max_age_all_finished" in cfg.ignored_keys
    assert from_config(load_config("grpo_tiny_cpu"), SamplingConfig(max_tokens=25)) is None


def test_bad_values_and_dynamic_sampling_are_refused():
    issue(errors("grpo_tiny_cpu", f"{KEY}=0"), KEY, "integer >= 1", "got 0")
    err = errors("grpo_tiny_cpu", f"{KEY}=2", "rl_config.filter_groups_enable=true",
                 "rl_config.filter_groups_metric=seq_reward")  # fmt: skip
    issue(err, KEY, "dynamic sampling", "filter_groups_enable", "exactly once")


def test_partial_rollout_with_an_async_mode_is_refused():
    err = errors("grpo_tiny_cpu", "rl_config.partial_rollout_max_split=2", "rl_config.async_mode=one_step_off")
    issue(err, "rl_config.partial_rollout_max_split", "async_mode one_step_off", "both schedules", "a run has one")
