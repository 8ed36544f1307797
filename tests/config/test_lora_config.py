"""MindSpeed-RL's LoRA keys load through the config (checked at load, errors naming the key and the file), and a LoRA
run in a setting the trainer does not run through adapters is refused, naming why, rather than training the whole
model in silence."""

from __future__ import annotations

import pytest

from mindrl.config import ConfigError, load_config

LORA = "+megatron_training.lora_target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"


def test_lora_recipe_loads():
    """MindSpeed-RL's grpo_lora_qwen25_32b_A2 as shipped: LoRA on every linear, the shared-backbone reference,
    adapter-only checkpoints; lora_fusion (CCLoRA) is listed as ignored."""
    cfg = load_config("grpo_lora_qwen25_32b_A2")
    a = cfg.actor_config
    assert a.lora and a.lora_ckpt_filter and cfg.rl_config.share_backbone
    assert "actor_config.lora_fusion" in cfg.ignored_keys, cfg.ignored_keys


def test_lora_runs_only_where_tested():
    """A LoRA actor loads with share_backbone in the integrated worker; the untested combinations are refused,
    each naming why."""
    cfg = load_config("grpo_tiny_cpu", overrides=[LORA, "+rl_config.share_backbone=true"])
    assert cfg.actor_config.lora and cfg.rl_config.share_backbone
    with pytest.raises(ConfigError, match="reference model of its own is untested; set rl_config.share_backbone"):
        load_config("grpo_tiny_cpu", overrides=[LORA])
    with pytest.raises(ConfigError, match="LoRA with partial rollout has not been run through adapters"):
        load_config("grpo_tiny_cpu", overrides=[LORA, "+rl_config.share_backbone=true",
                                                "rl_config.partial_rollout_max_split=2"])  # fmt: skip
    with pytest.raises(ConfigError, match="LoRA with async_mode bounded has not been run through adapters"):
        load_config("grpo_tiny_cpu", overrides=[LORA, "+rl_config.share_backbone=true",
                                                "rl_config.async_mode=bounded", "rl_config.val_data_path=null"])  # fmt: skip
    # one_step_off and a reward model run through adapters (tests/trainer/test_lora_e2e.py)
    cfg = load_config("grpo_tiny_cpu", overrides=[LORA, "+rl_config.share_backbone=true",
                                                  "rl_config.async_mode=one_step_off"])  # fmt: skip
    assert cfg.rl_config.async_mode == "one_step_off"
    with pytest.raises(ConfigError, match="critic_config.lora_target_modules: LoRA trains the actor only"):
        load_config("ppo_tiny_cpu", overrides=["+critic_config.lora_target_modules=[linear_qkv]"])


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


def test_smollm2_lora_recipe_is_the_full_recipe_with_adapters():
    """configs/grpo_smollm2_lora_cpu.yaml (`grpo_smollm2_cpu.sh lora`) is grpo_smollm2_cpu with a LoRA actor on every
    linear and the shared backbone: the same task, data, sampling, shaping and evaluation; only the learning rate and
    the output paths differ."""
    full, lora = load_config("grpo_smollm2_cpu"), load_config("grpo_smollm2_lora_cpu")
    a = lora.actor_config
    assert a.lora and a.lora_target_modules == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert lora.rl_config.share_backbone and not full.actor_config.lora
    differ = {"actor_config.lr", "actor_config.min_lr", "actor_config.save", "rl_config.run_dir",
              "rl_config.share_backbone", "actor_config.lora_target_modules", "actor_config.lora_r",
              "actor_config.lora_alpha"}  # fmt: skip

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    f, g = dict(flat(full.to_dict())), dict(flat(lora.to_dict()))
    changed = {k for k in set(f) | set(g) if f.get(k) != g.get(k)} - {"config_name", "source"}
    assert changed <= differ, sorted(changed - differ)
