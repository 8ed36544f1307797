"""Every config shipped in configs/ loads and validates; the full-size ones without their (absent) paths."""

from __future__ import annotations

import logging

import pytest
import yaml

from mindrl.config import RLConfig, load_config
from tests.config.conftest import asset_overrides

SHIPPED = [
    "ppo_tiny_cpu",
    "ppo_tiny_cpu_rm",
    "ppo_tiny_cpu_server",
    "grpo_tiny_cpu",
    "dapo_tiny_cpu",
    "retool_tiny_cpu",
    "search_tiny_cpu",
    "grpo_smollm2_cpu",
    "grpo_smollm2_lora_cpu",
    "ppo_qwen25_32b_A3",
    "grpo_qwen25_7b_A3",
    "grpo_qwen25_32b_A3",
    "grpo_qwen3_8b_A3",
]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_validates(name):
    cfg = load_config(name)
    assert isinstance(cfg, RLConfig)
    assert cfg.config_name == name and cfg.source.endswith(f"configs/{name}.yaml")
    assert cfg.model.name == cfg.actor_config.model
    assert (cfg.critic_config is not None) == name.startswith("ppo") == cfg.rl_config.needs_critic
    assert cfg.rl_config.mini_batch_size == cfg.megatron_training.global_batch_size
    assert cfg.rl_config.on_policy
    d = cfg.to_dict()
    assert d["resolved"]["world_size"] == cfg.rl_config.world_size
    assert yaml.safe_load(cfg.to_yaml())["rl_config"]["adv_estimator"] == cfg.rl_config.adv_estimator


def test_tiny_configs_match_the_quickstart():
    ppo, grpo = load_config("ppo_tiny_cpu"), load_config("grpo_tiny_cpu")
    for cfg, n in ((ppo, 2), (grpo, 4)):
        m = cfg.model
        assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_kv_heads) == (
            2, 128, 256, 4, 2
        )  # fmt: skip
        assert m.padded_vocab_size == 1024 and m.untie_embeddings_and_output_weights and m.rotary_base == 1e6
        assert cfg.megatron_training.dtype == "float32" and cfg.generate_config.dtype == "float32"
        assert (
            cfg.rl_config.world_size == 2
            and cfg.actor_config.tp == 2
            and cfg.generate_config.infer_tensor_parallel_size == 2
        )
        assert cfg.megatron_training.global_batch_size == 8 and cfg.rl_config.n_samples_per_prompt == n
        assert cfg.rl_config.max_prompt_length == 64 and cfg.generate_config.sampling_config.max_tokens == 24
        assert cfg.generate_config.max_model_len == 128 and cfg.megatron_training.train_iters == 60
        assert cfg.rl_config.verifier_function == ["acc_for_ppo"] and cfg.ignored_keys == []
        g = cfg.generate_config
        assert g.offload_train_optimizer and g.offload_train_grad and g.offload_train_param
        assert cfg.actor_config.load == "./outputs/quickstart/ckpt/actor_sft"
        assert cfg.rl_config.integrated_mode_config.ref_model_load_path == cfg.actor_config.load
        assert cfg.megatron_training.tokenizer_name_or_path == "./outputs/quickstart/hf_sft"
        assert cfg.megatron_training.data_path == "./outputs/quickstart/data/train"
    assert ppo.critic_config.tp == 2 and ppo.critic_config.load == "./outputs/quickstart/ckpt/critic"
    assert ppo.rl_config.run_dir == "./outputs/ppo_tiny_cpu" and grpo.rl_config.run_dir == "./outputs/grpo_tiny_cpu"


def test_full_size_layouts():
    ppo = load_config("ppo_qwen25_32b_A3")
    rl = ppo.rl_config
    assert (rl.world_size, ppo.actor_config.tp, ppo.critic_config.tp, rl.actor_dp, rl.critic_dp, rl.infer_dp) == (
        32, 8, 8, 4, 4, 4
    )  # fmt: skip
    assert ppo.megatron_training.global_batch_size == 128 and rl.n_samples_per_prompt == 8
    assert rl.max_prompt_length == 2048 and ppo.generate_config.sampling_config.max_tokens == 2048
    assert ppo.model.num_layers == 64 and ppo.model.num_kv_heads == 8 and ppo.megatron_training.dtype == "bfloat16"
    g7 = load_config("grpo_qwen25_7b_A3")
    m = g7.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_kv_heads) == (
        28, 3584, 18944, 28, 4
    )  # fmt: skip
    assert m.padded_vocab_size == 152064 and m.add_qkv_bias and m.norm_epsilon == 1e-6 and m.rotary_base == 1e6
    assert g7.rl_config.actor_dp == 4 and g7.rl_config.infer_dp == 16
    g32 = load_config("grpo_qwen25_32b_A3")
    assert g32.rl_config.actor_dp == 1 and g32.actor_config.pp == 4
    assert g32.rl_config.verifier_function == ["math_verify"]  # MindSpeed-RL's math_verify_reward
    assert "actor_config.num_layer_list" not in g32.ignored_keys  # its 16,17,16,15 stages are built as given


def test_ignored_keys_logged_once(caplog):
    with caplog.at_level(logging.WARNING, logger="mindrl.config"):
        cfg = load_config("grpo_qwen25_32b_A3")
    records = [r for r in caplog.records if r.name == "mindrl.config" and "ignored" in r.getMessage()]
    assert len(records) == 1
    msg = records[0].getMessage()
    assert "grpo_qwen25_32b_A3.yaml" in msg
    for key in cfg.ignored_keys:
        assert msg.count(key + ",") + msg.endswith(key) == 1, key
    for key in ("megatron_training.use_flash_attn", "megatron_training.use_fused_rmsnorm", "rl_config.blocking",
                "rl_config.reward_dispatch_size", "generate_config.trust_remote_code"):  # fmt: skip
        assert key in cfg.ignored_keys
    assert cfg.rl_config.hccl_buffersize == 64 and "rl_config.hccl_buffersize" not in cfg.ignored_keys
    assert len(cfg.ignored_keys) == len(set(cfg.ignored_keys))


def test_tiny_config_with_assets_passes_path_checks(assets):
    from mindrl.preflight import load_config

    cfg = load_config("ppo_tiny_cpu", overrides=asset_overrides(assets))
    assert cfg.actor_config.load == assets["actor"]
    cfg = load_config("grpo_tiny_cpu", overrides=asset_overrides(assets, critic=False))
    assert cfg.critic_config is None
