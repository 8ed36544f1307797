"""The derived values the trainer reads (KL placement, data-parallel sizes, on-policy, inherited role keys),
and the builders of the rollout engine's configs."""

from __future__ import annotations

import logging

import pytest

from mindrl.config import ConfigError, load_config
from mindrl.rollout.base import RolloutConfig, SamplingConfig


def _load(name: str, *overrides: str):
    return load_config(name, overrides=list(overrides))


def test_ppo_resolution():
    rl = _load("ppo_tiny_cpu").rl_config
    assert rl.needs_critic and rl.kl_in_reward and rl.kl_coef_in_loss == 0.0
    assert (rl.world_size, rl.actor_dp, rl.critic_dp, rl.infer_dp) == (2, 1, 1, 1)
    assert rl.on_policy and rl.num_mini_batches == 1 and rl.mini_batch_responses == 16


def test_grpo_resolution():
    cfg = _load("grpo_tiny_cpu")
    rl = cfg.rl_config
    assert not rl.needs_critic and cfg.critic_config is None and rl.critic_dp is None
    assert not rl.kl_in_reward and rl.kl_coef_in_loss == pytest.approx(0.001)
    assert rl.cpu_devices == 2


def test_kl_placement_follows_use_kl_in_reward():
    rl = _load("grpo_tiny_cpu", "rl_config.use_kl_in_reward=true").rl_config
    assert rl.kl_in_reward and rl.kl_coef_in_loss == 0.0
    rl = _load("ppo_tiny_cpu", "~rl_config.use_kl_in_reward").rl_config  # unset: MindSpeed-RL's PPO choice
    assert rl.use_kl_in_reward is None and rl.kl_in_reward


def test_ppo_kl_in_loss_is_noted(caplog):
    with caplog.at_level(logging.WARNING, logger="mindrl.config"):
        rl = _load("ppo_tiny_cpu", "rl_config.use_kl_in_reward=false").rl_config
    assert not rl.kl_in_reward and rl.kl_coef_in_loss == pytest.approx(0.001)
    assert any("MindSpeed-RL's PPO applies no KL" in r.getMessage() for r in caplog.records)


def test_mini_batches_and_on_policy():
    rl = _load("grpo_tiny_cpu", "rl_config.mini_batch_size=4").rl_config
    assert rl.num_mini_batches == 2 and rl.mini_batch_responses == 16 and not rl.on_policy
    rl = _load("grpo_tiny_cpu", "rl_config.epochs=2").rl_config
    assert rl.num_mini_batches == 1 and not rl.on_policy
    rl = _load("grpo_tiny_cpu", "rl_config.mini_batch_size=null").rl_config
    assert rl.mini_batch_size == 8 and rl.on_policy  # null: one step of global_batch_size prompts


def test_data_parallel_sizes():
    rl = _load("ppo_tiny_cpu", "rl_config.actor_resource.num_npus=4", "rl_config.critic_resource.num_npus=4",
               "critic_config.tensor_model_parallel_size=1", "generate_config.infer_tensor_parallel_size=1",
               "critic_config.micro_batch_size=2", "actor_config.micro_batch_size=2").rl_config  # fmt: skip
    assert (rl.world_size, rl.actor_dp, rl.critic_dp, rl.infer_dp) == (4, 2, 4, 4)


def test_role_keys_inherit_from_megatron_training():
    cfg = _load("ppo_tiny_cpu", "megatron_training.use_distributed_optimizer=true",
                "+critic_config.use_distributed_optimizer=false")  # fmt: skip
    assert cfg.actor_config.use_distributed_optimizer is True
    assert cfg.critic_config.use_distributed_optimizer is False
    assert cfg.actor_config.sequence_parallel is False


def test_dtype():
    assert _load("ppo_tiny_cpu").megatron_training.dtype == "float32"
    assert _load("ppo_tiny_cpu", "megatron_training.bf16=true").megatron_training.dtype == "bfloat16"
    assert _load("ppo_tiny_cpu", "+megatron_training.fp16=true").megatron_training.dtype == "float16"


def test_clip_ratio_low_high():
    rl = _load("grpo_tiny_cpu", "+rl_config.clip_ratio_low=0.2", "+rl_config.clip_ratio_high=0.28").rl_config
    assert (rl.clip_ratio_low, rl.clip_ratio_high) == (0.2, 0.28)
    cfg = _load("grpo_tiny_cpu", "+rl_config.clip_higher_enable=false", "+rl_config.clip_ratio_high=0.28")
    assert cfg.rl_config.clip_ratio_high is None and "rl_config.clip_ratio_high" in cfg.ignored_keys
    with pytest.raises(ConfigError, match="clip_ratio_low: is required with clip_higher_enable: true"):
        _load("grpo_tiny_cpu", "+rl_config.clip_higher_enable=true", "+rl_config.clip_ratio_high=0.28")


def test_sampling_and_rollout_config():
    cfg = _load("grpo_tiny_cpu", "generate_config.kv_cache_memory_gib=0.5", "generate_config.sampling_config.top_k=5")
    s = cfg.generate_config.sampling(cfg.rl_config.n_samples_per_prompt)
    assert isinstance(s, SamplingConfig)
    assert (s.n, s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.logprobs) == (4, 24, 1.0, 1.0, 5, 0.0, 0)
    r = cfg.generate_config.rollout_config("/some/hf_dir", seed=cfg.megatron_training.seed)
    assert isinstance(r, RolloutConfig)
    assert (r.model, r.seed, r.infer_tensor_parallel_size, r.dtype, r.max_model_len) == (
        "/some/hf_dir", 1234, 2, "float32", 128
    )  # fmt: skip
    assert r.kv_cache_memory_bytes == 2**29 and r.load_format == "dummy"
    assert r.tokenizer == cfg.megatron_training.tokenizer_name_or_path  # generate_config's defaults to it


def test_to_dict_has_every_section():
    d = _load("ppo_tiny_cpu").to_dict()
    assert {"megatron_training", "actor_config", "critic_config", "rl_config", "generate_config", "model",
            "critic_model", "ignored_keys", "resolved"} <= set(d)  # fmt: skip
    assert d["model"]["num_kv_heads"] == 2 and d["resolved"]["kl_in_reward"] is True
