"""Hydra-style overrides and the shared --config-name / --config-path / key=value command line."""

from __future__ import annotations

import argparse

import pytest

from mindrl.config import ConfigError, load_config
from mindrl.config.cli import add_config_args
from mindrl.preflight import config_from_args


def test_overrides_change_add_and_delete():
    cfg = load_config(
        "grpo_tiny_cpu",
        overrides=[
            "rl_config.epochs=2",  # present in the YAML
            "rl_config.use_kl_in_reward=true",  # a schema key the YAML leaves out: added without '+'
            "+rl_config.clip_ratio_high=0.28",  # hydra's explicit add
            "generate_config.sampling_config.temperature=0.7",
            "~rl_config.run_dir",  # delete: back to the default
            "megatron_training.train_iters=3",
        ],
    )
    rl = cfg.rl_config
    assert rl.epochs == 2 and rl.use_kl_in_reward is True and rl.clip_ratio_high == 0.28
    assert cfg.generate_config.sampling_config.temperature == 0.7
    assert rl.run_dir is None and cfg.megatron_training.train_iters == 3
    assert not rl.on_policy  # two epochs


def test_unknown_override_key_names_key_source_and_close_match():
    with pytest.raises(ConfigError) as e:
        load_config("ppo_tiny_cpu", overrides=["rl_config.epochz=2", "actor_config.lrr=1e-5"])
    msg = str(e.value)
    assert "rl_config.epochz: unknown key; did you mean 'epochs'?" in msg
    assert "override 'rl_config.epochz=2'" in msg
    assert "actor_config.lrr" in msg and "'lr'" in msg


def test_override_type_error_points_at_the_override():
    with pytest.raises(ConfigError) as e:
        load_config("ppo_tiny_cpu", overrides=["actor_config.micro_batch_size=two"])
    assert len(e.value.issues) == 1
    issue = e.value.issues[0]
    assert issue.key == "actor_config.micro_batch_size" and "expected an integer" in issue.message
    assert issue.source == "override 'actor_config.micro_batch_size=two'"


def test_bad_override_syntax():
    with pytest.raises(ConfigError) as e:
        load_config("ppo_tiny_cpu", overrides=["rl_config.epochs=1=2"])
    assert "rl_config.epochs" in str(e.value) and "bad override" in str(e.value)


def test_unknown_model_group_option():
    with pytest.raises(ConfigError) as e:
        load_config("ppo_tiny_cpu", overrides=["model=qwen25_7bb"])
    assert "qwen25_7bb" in str(e.value) and "tiny_qwen2" in str(e.value)


def _parse(argv):
    p = argparse.ArgumentParser()
    add_config_args(p)
    return p.parse_args(argv)


def test_cli_args():
    args = _parse(["--config-name", "grpo_tiny_cpu", "--no-check-paths", "rl_config.epochs=3", "+rl_config.gamma=0.9"])
    cfg = config_from_args(args)
    assert cfg.config_name == "grpo_tiny_cpu" and cfg.rl_config.epochs == 3 and cfg.rl_config.gamma == 0.9
    args = _parse(["-cn", "ppo_qwen25_32b_A3.yaml", "-cp", cfg.source.rsplit("/", 1)[0], "--no-check-paths"])
    assert config_from_args(args).rl_config.world_size == 32
    with pytest.raises(ConfigError, match="key=value"):
        config_from_args(_parse(["--config-name", "grpo_tiny_cpu", "--no-check-paths", "epochs"]))
    with pytest.raises(SystemExit):
        _parse([])  # --config-name is required


def test_cli_checks_paths_by_default():
    with pytest.raises(ConfigError) as e:
        config_from_args(_parse(["--config-name", "grpo_tiny_cpu", "actor_config.load=/no/such/ckpt"]))
    assert "actor_config.load: checkpoint directory '/no/such/ckpt' does not exist" in str(e.value)


def test_added_keys_are_still_checked_and_empty_sections_mean_defaults():
    with pytest.raises(ConfigError) as e:
        load_config("grpo_tiny_cpu", overrides=["+rl_config.epochss=1"])
    assert "rl_config.epochss: unknown key; did you mean 'epochs'?" in str(e.value)
    cfg = load_config("grpo_tiny_cpu", overrides=["rl_config.integrated_mode_config=null"])
    assert cfg.rl_config.integrated_mode_config.ref_model_load_path is None
