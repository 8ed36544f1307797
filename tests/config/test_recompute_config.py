"""The recompute_* keys: where MindSpeed-RL accepts them (megatron_training as each role's default, a role's own),
megatron's rules at load (each error naming the key and its file), and the settings the workers get."""

from __future__ import annotations

import os

import pytest

from mindrl.config import default_config_dir, load_config
from mindrl.config.settings import RecomputeSettings
from mindrl.workers import from_config
from tests.config.test_errors import _edited, errors, issue

PPO = os.path.join(default_config_dir(), "ppo_tiny_cpu.yaml")


def test_megatron_training_is_each_roles_default():
    cfg = load_config("ppo_tiny_cpu", overrides=[
        "+megatron_training.recompute_granularity=full", "+megatron_training.recompute_method=block",
        "+megatron_training.recompute_num_layers=1", "+critic_config.recompute_granularity=selective",
        "+critic_config.recompute_method=null", "+critic_config.recompute_num_layers=null",
        "+actor_config.recompute_activation_function=true",
    ])  # fmt: skip
    actor, critic = cfg.actor_config.recompute_settings(), cfg.critic_config.recompute_settings()
    assert actor == RecomputeSettings("full", "block", 1, True)
    assert critic == RecomputeSettings("selective", None, None, False)
    assert not any("recompute" in k for k in cfg.ignored_keys)
    assert from_config.model_settings(cfg.actor_config, cfg, None, None).recompute == actor
    assert from_config.model_settings(cfg.critic_config, cfg, None, None).recompute == critic


def test_no_recomputation_by_default():
    cfg = load_config("ppo_tiny_cpu")
    assert not cfg.actor_config.recompute_settings().recomputes
    assert from_config.model_settings(cfg.actor_config, cfg, None, None).recompute == RecomputeSettings()


@pytest.mark.parametrize(
    "overrides, key, fragments",
    [
        (["+actor_config.recompute_granularity=partial"], "actor_config.recompute_granularity", ["'partial'", "full"]),
        (["+actor_config.recompute_granularity=full", "+actor_config.recompute_num_layers=1"],
         "actor_config.recompute_method", ["is required", "uniform or block"]),
        (["+actor_config.recompute_granularity=full", "+actor_config.recompute_method=uniform"],
         "actor_config.recompute_num_layers", ["is required"]),
        (["+actor_config.recompute_granularity=full", "+actor_config.recompute_method=stripes",
          "+actor_config.recompute_num_layers=1"], "actor_config.recompute_method", ["'stripes'"]),
        (["+actor_config.recompute_granularity=full", "+actor_config.recompute_method=uniform",
          "+actor_config.recompute_num_layers=0"], "actor_config.recompute_num_layers", [">= 1"]),
        (["+actor_config.recompute_granularity=full", "+actor_config.recompute_method=block",
          "+actor_config.recompute_num_layers=3"], "actor_config.recompute_num_layers",
         ["3 exceeds the 2 layers per pipeline stage", "num_layers=2"]),
        (["+actor_config.recompute_granularity=selective", "+actor_config.recompute_method=block"],
         "actor_config.recompute_method", ["must be unset with recompute_granularity: selective"]),
        (["+actor_config.recompute_granularity=selective", "+actor_config.recompute_num_layers=1"],
         "actor_config.recompute_num_layers", ["must be unset"]),
    ],
)  # fmt: skip
def test_megatron_rules_at_load(overrides, key, fragments):
    issue(errors("ppo_tiny_cpu", *overrides), key, *fragments)


def test_an_error_names_the_file(tmp_path):
    d = _edited(tmp_path, PPO, "  pipeline_model_parallel_size: 1\n",
                "  pipeline_model_parallel_size: 1\n  recompute_granularity: full\n  recompute_method: block\n"
                "  recompute_num_layers: 3\n")  # fmt: skip
    issue(errors("cfg", config_path=d), "actor_config.recompute_num_layers", "3 exceeds the 2 layers",
          source=os.path.join(d, "cfg.yaml"))  # fmt: skip


def test_uniform_chunks_divide_the_stage():
    err = errors("ppo_tiny_cpu", "model.tiny_qwen2.num_layers=3", "actor_config.tensor_model_parallel_size=1",
                 "critic_config.tensor_model_parallel_size=1", "generate_config.infer_tensor_parallel_size=1",
                 "+actor_config.recompute_granularity=full", "+actor_config.recompute_method=uniform",
                 "+actor_config.recompute_num_layers=2")  # fmt: skip
    issue(err, "actor_config.recompute_num_layers", "2 does not divide the 3 layers per pipeline stage")


def test_an_inherited_error_names_megatron_training():
    err = errors("ppo_tiny_cpu", "+megatron_training.recompute_granularity=partial")
    issue(err, "megatron_training.recompute_granularity", "'partial'", "used for actor_config.recompute_granularity")


def test_method_without_granularity_is_ignored():
    cfg = load_config("ppo_tiny_cpu", overrides=["+actor_config.recompute_method=uniform"])
    assert "actor_config.recompute_method" in cfg.ignored_keys


def test_settings_built_in_code_are_checked():
    with pytest.raises(ValueError, match="recompute_method is required"):
        RecomputeSettings("full", None, 1)
    assert RecomputeSettings("full", "uniform", 2).recompute_problems(layers_per_stage=3)
