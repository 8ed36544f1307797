"""MindSpeed-RL's LoRA keys load through the config (checked at load, errors naming the key and the file), and a LoRA
run is refused, naming what the trainer still lacks, rather than training the whole model in silence."""

from __future__ import annotations

import pytest

from mindrl.config import ConfigError, load_config

LORA = "+megatron_training.lora_target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"


def test_lora_recipe_is_refused_naming_what_is_missing():
    """MindSpeed-RL's grpo_lora_qwen25_32b_A2 as shipped: its one problem is the missing trainer integration (its
    share_backbone, lora_r, lora_alpha, lora_fusion and lora_ckpt_filter pass their checks)."""
    with pytest.raises(ConfigError) as e:
        load_config("grpo_lora_qwen25_32b_A2")
    assert len(e.value.issues) == 1, str(e.value)
    text = str(e.value)
    assert "megatron_training.lora_target_modules: LoRA layers exist" in text
    for missing in ("share_backbone reference", "merged-weight reshard", "lora_ckpt_filter", "PEFT export"):
        assert missing in text
    assert "grpo_lora_qwen25_32b_A2.yaml" in text
    with pytest.raises(ConfigError, match="LoRA layers exist"):
        load_config("grpo_tiny_cpu", overrides=[LORA])


def test_lora_keys_are_checked_at_load():
    with pytest.raises(ConfigError) as e:
        load_config("grpo_tiny_cpu", overrides=["+actor_config.lora_target_modules=[linear_qkv,q_proj,linear_qkv]",
                                                "+actor_config.lora_r=0", "+actor_config.lora_alpha=-1",
                                                "+rl_config.share_backbone=true", "+rl_config.sync_ref_model=true"])  # fmt: skip
    text = str(e.value)
    assert (
        "actor_config.lora_target_modules: ['q_proj'] not among linear_qkv, linear_proj, linear_fc1, linear_fc2" in text
    )
    assert "names a linear twice" in text
    assert "actor_config.lora_r: must be >= 1, got 0" in text and "actor_config.lora_alpha: must be > 0" in text
    assert "rl_config.share_backbone: sync_ref_model" in text
    with pytest.raises(ConfigError, match="rl_config.share_backbone: needs a LoRA actor"):
        load_config("grpo_tiny_cpu", overrides=["+rl_config.share_backbone=true"])
    with pytest.raises(ConfigError, match="rl_config.share_backbone: needs use_integrated_worker: true"):
        load_config(
            "grpo_tiny_cpu", overrides=["+rl_config.share_backbone=true", "rl_config.use_integrated_worker=false"]
        )
    with pytest.raises(ConfigError, match="lora_r: expected an integer"):
        load_config("grpo_tiny_cpu", overrides=["+megatron_training.lora_r=8.5"])


def test_lora_options_without_targets_are_listed_as_ignored():
    cfg = load_config("grpo_tiny_cpu", overrides=["+megatron_training.lora_r=16", "+megatron_training.lora_fusion=true",
                                                  "+megatron_training.lora_target_modules=[]"])  # fmt: skip
    assert not cfg.actor_config.lora and cfg.actor_config.lora_r == 16
    assert {"actor_config.lora_r", "actor_config.lora_fusion"} <= set(cfg.ignored_keys), cfg.ignored_keys
