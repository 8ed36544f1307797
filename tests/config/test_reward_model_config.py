"""reward_config and the rl_config keys of a reward model: what loads, and each error naming its key."""

from __future__ import annotations

import pytest

from mindrl.config import load_config
from tests.config.test_errors import errors, issue

RM = ["+reward_config.load=/ckpt/rm", "+reward_config.micro_batch_size=2"]


def test_reward_config_merges_over_megatron_training():
    cfg = load_config("grpo_tiny_cpu", overrides=[*RM, "+reward_config.tensor_model_parallel_size=2"])
    rc = cfg.reward_config
    assert (rc.load, rc.tp, rc.pp, rc.micro_batch_size, rc.model) == ("/ckpt/rm", 2, 1, 2, "tiny_qwen2")
    assert cfg.reward_model is not None and cfg.reward_model.name == "tiny_qwen2"
    assert "reward_config" in cfg.to_dict() and cfg.ignored_keys == []
    shipped = load_config("ppo_tiny_cpu_rm")
    assert shipped.rl_config.reward_resource.num_npus == shipped.rl_config.world_size
    assert (shipped.rl_config.reward_model_weight, shipped.rl_config.normalize_reward) == (0.5, True)


def test_reward_config_errors_name_their_keys():
    err = errors("grpo_tiny_cpu", "+reward_config.micro_batch_size=2", "+reward_config.tensor_model_parallel_size=3",
                 "+reward_config.seq_length=64", "+rl_config.reward_resource.num_npus=4",
                 "+rl_config.reward_clip_range=[1.0,-1.0]", "+rl_config.reward_model_weight=nan")  # fmt: skip
    issue(err, "reward_config.load", "is required")
    issue(err, "reward_config.tensor_model_parallel_size", "TP=3 does not divide")
    issue(err, "reward_config.seq_length", "differs from megatron_training.seq_length", "reward_config shares")
    issue(err, "rl_config.reward_resource.num_npus", "differs from actor_resource.num_npus=2", "use_integrated_worker")
    issue(err, "rl_config.reward_clip_range", "low < high")
    issue(err, "rl_config.reward_model_weight", "finite")


def test_reward_model_with_dynamic_sampling_loads_and_separate_placement_needs_devices():
    cfg = load_config("dapo_tiny_cpu", overrides=[*RM, "rl_config.filter_groups_metric=seq_reward"])
    assert cfg.rl_config.filter_groups_enable and cfg.reward_config is not None
    err = errors("grpo_tiny_cpu", *RM, "rl_config.use_integrated_worker=false")
    issue(err, "rl_config.reward_resource.num_npus", "is required with use_integrated_worker: false")


def test_reward_knobs_without_a_reward_model_are_noted(caplog):
    cfg = load_config("grpo_tiny_cpu", overrides=["+rl_config.normalize_reward=true"])
    assert cfg.reward_config is None
    assert "rl_config.normalize_reward" in cfg.ignored_keys
    with pytest.raises(Exception, match="no reward model"):
        load_config("grpo_tiny_cpu", overrides=["+rl_config.reward_resource.num_npus=2"])


def test_reward_model_checkpoint_is_checked_at_load(assets):
    from mindrl.config import ConfigError
    from mindrl.preflight import load_config as load_checked
    from tests.config.conftest import asset_overrides

    with pytest.raises(ConfigError) as e:
        load_checked("grpo_tiny_cpu", overrides=[*asset_overrides(assets, critic=False),
                                                 f"+reward_config.load={assets['actor']}"])  # fmt: skip
    issue(e.value, "reward_config.load", "needs a value model (convert with --orm)")
    cfg = load_checked("grpo_tiny_cpu", overrides=[*asset_overrides(assets, critic=False),
                                                   f"+reward_config.load={assets['critic']}"])  # fmt: skip
    assert cfg.reward_config.load == assets["critic"]


def test_rule_reward_false_leaves_the_reward_model_alone():
    """MindSpeed-RL's rule_reward: false: no verifier runs (their keys are listed as ignored); the reward model must
    be there and weigh something, and dynamic sampling can only filter on the whole reward."""
    cfg = load_config("grpo_tiny_cpu", overrides=[*RM, "rl_config.rule_reward=false"])
    rl = cfg.rl_config
    assert rl.verifiers == () and rl.verifier_weights == ()
    assert "rl_config.verifier_function" in cfg.ignored_keys  # grpo_tiny_cpu names acc_for_ppo
    from mindrl.workers.from_config import reward_settings

    assert reward_settings(cfg).verifier_function == ()
    err = errors("grpo_tiny_cpu", "rl_config.rule_reward=false")
    issue(err, "rl_config.rule_reward", "no reward model", "nothing gives a reward", "reward_config")
    err = errors("grpo_tiny_cpu", *RM, "rl_config.rule_reward=false", "+rl_config.reward_model_weight=0")
    issue(err, "rl_config.reward_model_weight", "every reward is 0")
    err = errors("dapo_tiny_cpu", *RM, "rl_config.rule_reward=false")  # its filter_groups_metric: acc_for_ppo
    issue(err, "rl_config.filter_groups_metric", "'acc_for_ppo'", "rule_reward is false", "seq_reward")
    cfg = load_config("dapo_tiny_cpu", overrides=[*RM, "rl_config.rule_reward=false",
                                                   "rl_config.filter_groups_metric=seq_reward"])  # fmt: skip
    assert cfg.rl_config.verifiers == ()
