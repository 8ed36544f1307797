"""Every kind of config error: each message names the key as written, the file (or override) it came from and,
for typos, the close matches; all problems of a config are reported together."""

from __future__ import annotations

import os

import pytest

from mindrl.config import ConfigError, default_config_dir, load_config
from tests.config.conftest import write_configs

CONFIGS = default_config_dir()
PPO = os.path.join(CONFIGS, "ppo_tiny_cpu.yaml")
GRPO = os.path.join(CONFIGS, "grpo_tiny_cpu.yaml")


def errors(name: str, *overrides: str, config_path: str | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load_config(name, config_path=config_path, overrides=list(overrides))
    return e.value


def issue(err: ConfigError, key: str, *fragments: str, source: str | None = None):
    """The one issue of `err` about `key`, checked to contain `fragments` (and to come from `source`)."""
    found = [i for i in err.issues if i.key == key]
    assert found, f"no issue for {key} in:\n{err}"
    text = " | ".join(i.message for i in found)
    for f in fragments:
        assert f in text, f"{f!r} not in {text!r}"
    if source is not None:
        assert any(i.source == source for i in found), [i.source for i in found]
    assert key in str(err)
    return found[0]


def _edited(tmp_path, base: str, old: str, new: str, name: str = "cfg") -> str:
    text = open(base).read()
    assert old in text, old
    write_configs(tmp_path, {f"{name}.yaml": text.replace(old, new, 1),
                             "model/tiny_qwen2.yaml": open(os.path.join(CONFIGS, "model/tiny_qwen2.yaml")).read()})  # fmt: skip
    return str(tmp_path)


# ------------------------------------------------------------------------------------------- keys
def test_unknown_key_in_a_section_file(tmp_path):
    d = _edited(tmp_path, PPO, "  epochs: 1\n", "  epochz: 1\n")
    err = errors("cfg", config_path=d)
    issue(err, "rl_config.epochz", "unknown key", "did you mean 'epochs'?", source=os.path.join(d, "cfg.yaml"))


def test_unknown_megatron_key_and_close_match(tmp_path):
    d = _edited(tmp_path, PPO, "  bf16: false", "  use_flash_atn: true\n  bf16: false")
    issue(errors("cfg", config_path=d), "megatron_training.use_flash_atn", "did you mean 'use_flash_attn'?")


def test_unknown_key_in_model_file(tmp_path):
    d = _edited(tmp_path, PPO, "stage: ray_ppo", "stage: ray_ppo")
    path = os.path.join(d, "model", "tiny_qwen2.yaml")
    with open(path, "a") as f:
        f.write("  num_layer: 2\n")
    issue(errors("cfg", config_path=d), "model.tiny_qwen2.num_layer", "did you mean 'num_layers'", source=path)


def test_unknown_section(tmp_path):
    d = _edited(tmp_path, PPO, "generate_config:", "generate_cfg:\n  x: 1\ngenerate_config:")
    issue(errors("cfg", config_path=d), "generate_cfg", "unknown section", "'generate_config'")


def test_wrong_types(tmp_path):
    d = _edited(tmp_path, PPO, "  global_batch_size: 8 ", '  global_batch_size: "8" ')
    err = errors("cfg", "rl_config.use_tensorboard=3", "rl_config.n_samples_per_prompt=true", config_path=d)
    issue(
        err,
        "megatron_training.global_batch_size",
        "expected an integer",
        "'8' (str)",
        source=os.path.join(d, "cfg.yaml"),
    )
    issue(err, "rl_config.use_tensorboard", "expected true or false", source="override 'rl_config.use_tensorboard=3'")
    issue(err, "rl_config.n_samples_per_prompt", "expected an integer", "True (bool)")


def test_value_from_megatron_training_is_reported_where_written(tmp_path):
    d = _edited(tmp_path, PPO, "  seed: 1234", "  seed: 1234\n  clip_grad: -1.0")
    d2 = _edited(tmp_path / "b", PPO, "  clip_grad: 1.0\n", "", name="cfg")
    del d
    text = open(os.path.join(d2, "cfg.yaml")).read().replace("  clip_grad: 1.0\n", "")
    text = text.replace("  seed: 1234", "  seed: 1234\n  clip_grad: -1.0")
    open(os.path.join(d2, "cfg.yaml"), "w").write(text)
    err = errors("cfg", config_path=d2)
    i = issue(err, "megatron_training.clip_grad", "must be >= 0", "used for actor_config.clip_grad")
    assert i.source.endswith("cfg.yaml")


def test_forbidden_and_unsupported_keys():
    err = errors("grpo_tiny_cpu", "+rl_config.multi_turn_enable=true", "+megatron_training.expert_model_parallel_size=2",
                 "rl_config.use_integrated_worker=false", "generate_config.rollout_mode=server",
                 "+generate_config.enable_expert_parallel=true", "+rl_config.reward_resource.num_npus=2")  # fmt: skip
    issue(err, "rl_config.tool_config_path", "is required with multi_turn_enable: true")
    # multi-turn with separate placement (the engine group) and with servers is allowed: no issue of its own
    assert not any(i.key == "rl_config.multi_turn_enable" for i in err.issues)
    issue(err, "megatron_training.expert_model_parallel_size", "EP=2 needs a mixture-of-experts model")
    issue(err, "rl_config.reference_resource.num_npus", "is required with use_integrated_worker: false")
    issue(err, "generate_config.server_urls", "rollout_mode 'server' needs at least one rollout server URL")
    assert not any(i.key == "generate_config.enable_expert_parallel" for i in err.issues)  # no effect on a dense model
    issue(err, "rl_config.reward_resource", "no reward model", "reward_config")


def test_ref_config_section_is_rejected(tmp_path):
    d = _edited(tmp_path, GRPO, "rl_config:", "ref_config:\n  micro_batch_size: 2\nrl_config:")
    issue(errors("cfg", config_path=d), "ref_config", "must not be set", "integrated mode")


def test_unknown_config_and_model_names(tmp_path):
    err = errors("ppo_tiny_cpuu")
    issue(err, "config_name", "no config 'ppo_tiny_cpuu'", "did you mean 'ppo_tiny_cpu'")
    err = errors("ppo_tiny_cpu", "actor_config.model=tiny_qwen")
    issue(err, "actor_config.model", "no model 'tiny_qwen'", "did you mean 'tiny_qwen3' or 'tiny_qwen2'")


# ------------------------------------------------------------------------------------------- layouts
def test_tp_must_divide_heads_kv_ffn_vocab():
    err = errors("ppo_tiny_cpu", "actor_config.tensor_model_parallel_size=4", "rl_config.actor_resource.num_npus=4",
                 "rl_config.critic_resource.num_npus=4")  # fmt: skip
    # 4 heads are fine for TP4 but the 2 KV heads are not
    issue(err, "actor_config.tensor_model_parallel_size", "TP=4 does not divide model.tiny_qwen2", "num_kv_heads")
    assert "num_attention_heads" not in err.issues[0].message


def test_pp_must_divide_layers_and_tp_pp_the_devices():
    err = errors("grpo_tiny_cpu", "actor_config.pipeline_model_parallel_size=3", "rl_config.actor_resource.num_npus=4")
    issue(err, "actor_config.pipeline_model_parallel_size", "PP=3 does not divide model.tiny_qwen2.num_layers=2")
    issue(err, "actor_config.tensor_model_parallel_size", "TP x PP = 2 x 3 = 6 does not divide the 4 devices")


def test_critic_layout_checked_too():
    err = errors("ppo_tiny_cpu", "critic_config.tensor_model_parallel_size=3")
    issue(err, "critic_config.tensor_model_parallel_size", "TP=3 does not divide", "num_attention_heads=4")


def test_infer_tp_must_divide_heads_and_devices():
    # 4 query heads split over 4; the 2 KV heads are replicated (vLLM's rule): only the 2 devices refuse it
    err = errors("grpo_tiny_cpu", "generate_config.infer_tensor_parallel_size=4")
    issue(err, "generate_config.infer_tensor_parallel_size", "does not divide the 2 devices")
    assert not any("num_kv_heads" in i.message for i in err.issues)
    err = errors("grpo_tiny_cpu", "generate_config.infer_tensor_parallel_size=3")
    issue(err, "generate_config.infer_tensor_parallel_size", "infer TP=3 does not divide model.tiny_qwen2",
          "num_attention_heads=4", "num_kv_heads=2 (nor is it a multiple of them")  # fmt: skip


def test_critic_must_share_the_actor_devices():
    err = errors("ppo_tiny_cpu", "rl_config.critic_resource.num_npus=4")
    issue(err, "rl_config.critic_resource.num_npus", "differs from actor_resource.num_npus=2")


# ------------------------------------------------------------------------------------------- batches
def test_rollout_must_split_into_micro_batches():
    err = errors("grpo_tiny_cpu", "actor_config.tensor_model_parallel_size=1", "actor_config.micro_batch_size=3",
                 "generate_config.infer_tensor_parallel_size=1")  # fmt: skip
    issue(err, "actor_config.micro_batch_size", "8 x 4 = 32 responses", "DP x micro_batch_size = 2 x 3 = 6")


def test_mini_batch_size_is_in_prompts_and_must_divide_global_batch():
    err = errors("grpo_tiny_cpu", "rl_config.mini_batch_size=3")
    issue(err, "rl_config.mini_batch_size", "global_batch_size=8 prompts must be divisible by mini_batch_size=3")


def test_mini_batch_must_split_into_micro_batches():
    # 2 prompts x 2 samples = 4 responses per step; DP 2 x micro-batch 4 = 8
    err = errors("ppo_tiny_cpu", "rl_config.mini_batch_size=2", "actor_config.tensor_model_parallel_size=1",
                 "critic_config.tensor_model_parallel_size=1", "generate_config.infer_tensor_parallel_size=1")  # fmt: skip
    issue(err, "actor_config.micro_batch_size", "mini_batch_size x n_samples_per_prompt = 2 x 2 = 4",
          "DP x micro_batch_size = 2 x 4 = 8")  # fmt: skip
    issue(err, "critic_config.micro_batch_size", "= 4 responses")


def test_prompts_must_split_over_engine_replicas():
    err = errors("grpo_tiny_cpu", "megatron_training.global_batch_size=3", "rl_config.mini_batch_size=3",
                 "generate_config.infer_tensor_parallel_size=1", "actor_config.micro_batch_size=1")  # fmt: skip
    issue(err, "generate_config.infer_tensor_parallel_size", "global_batch_size=3 prompts", "2 engine replicas")


# ------------------------------------------------------------------------------------------- lengths
def test_max_model_len_covers_the_prompt_and_seq_length():
    err = errors("grpo_tiny_cpu", "rl_config.max_prompt_length=128", "megatron_training.seq_length=256")
    issue(err, "generate_config.max_model_len", "128 <= rl_config.max_prompt_length = 128", "no room for a response",
          "megatron_training.seq_length=256")  # fmt: skip


def test_max_model_len_below_prompt_plus_response_caps_the_longest_prompts(caplog):
    """As vLLM (0.32's check_stop: a request stops at max_model_len, finish_reason 'length'; it refuses only a prompt
    of max_model_len tokens or more): the load notes which prompts get fewer tokens, and how few at most."""
    import logging

    with caplog.at_level(logging.WARNING, logger="mindrl.config"):
        cfg = load_config("grpo_tiny_cpu", overrides=["generate_config.sampling_config.max_tokens=100"])
    assert cfg.generate_config.max_model_len == 128
    notes = [r.getMessage() for r in caplog.records if "generate_config.max_model_len=128" in r.getMessage()]
    assert len(notes) == 1 and "64 + 100 = 164" in notes[0], notes
    assert "longer than 28 tokens" in notes[0] and "down to 64 for a 64-token prompt" in notes[0], notes


def test_stop_strings_need_detokenize():
    err = errors("grpo_tiny_cpu", "generate_config.sampling_config.stop=[END]")
    issue(err, "generate_config.sampling_config.stop", "detokenize: true")


def test_max_model_len_within_the_model():
    err = errors("grpo_tiny_cpu", "generate_config.max_model_len=4096")
    issue(err, "generate_config.max_model_len", "max_position_embeddings=2048")


# ------------------------------------------------------------------------------------------- algorithm
def test_gae_needs_a_critic():
    err = errors("grpo_tiny_cpu", "rl_config.adv_estimator=gae")
    issue(err, "rl_config.adv_estimator", "gae needs a value model", "critic_config",
          source="override 'rl_config.adv_estimator=gae'")  # fmt: skip


def test_unknown_estimator_verifier_and_weights():
    err = errors(
        "grpo_tiny_cpu", "rl_config.adv_estimator=group_nrom", "rl_config.verifier_function=[acc_for_ppo,acc_ppo]"
    )
    issue(err, "rl_config.adv_estimator", "unknown estimator 'group_nrom'", "did you mean 'group_norm'?")
    issue(err, "rl_config.verifier_function", "unknown verifier 'acc_ppo'", "'acc_for_ppo'")
    issue(err, "rl_config.verifier_weight", "1 weights for 2 verifiers")


def test_adaptive_kl_needs_target_and_horizon():
    err = errors("grpo_tiny_cpu", "rl_config.kl_ctrl_type=adaptive", "rl_config.kl_target=0.1")
    issue(err, "rl_config.kl_horizon", "is required with kl_ctrl_type: adaptive")
    assert not [i for i in err.issues if i.key == "rl_config.kl_target"]


def test_group_estimator_needs_several_samples_and_names_checked():
    err = errors("grpo_tiny_cpu", "rl_config.n_samples_per_prompt=1", "rl_config.kl_penalty=low_var",
                 "rl_config.loss_agg_mode=seq-mean", "actor_config.lr_decay_style=exp")  # fmt: skip
    issue(err, "rl_config.n_samples_per_prompt", "needs n_samples_per_prompt >= 2")
    issue(err, "rl_config.kl_penalty", "'low_var_kl'")
    issue(err, "rl_config.loss_agg_mode", "token-mean")
    issue(err, "actor_config.lr_decay_style", "WSD")


def test_precision_and_dropout():
    err = errors("grpo_tiny_cpu", "megatron_training.bf16=true", "+megatron_training.fp16=true",
                 "megatron_training.hidden_dropout=0.1", "megatron_training.split='90,10,0'")  # fmt: skip
    issue(err, "megatron_training.fp16", "bf16 and fp16 are both true")
    issue(err, "megatron_training.hidden_dropout", "must be 0.0")
    issue(err, "megatron_training.split", "whole dataset")


def test_all_problems_reported_together():
    err = errors("ppo_tiny_cpu", "rl_config.epochs=0", "actor_config.lr=0", "generate_config.dtype=fp8",
                 "rl_config.clip_ratio=2")  # fmt: skip
    assert {i.key for i in err.issues} >= {"rl_config.epochs", "actor_config.lr", "generate_config.dtype",
                                           "rl_config.clip_ratio"}  # fmt: skip
    assert str(err).startswith(f"{len(err.issues)} problems in config 'ppo_tiny_cpu':")
    assert all(i.source for i in err.issues)


def test_sections_built_directly_raise_at_once():
    from mindrl.config import RoleConfig, SamplingSection

    with pytest.raises(ConfigError, match=r"generate_config.sampling_config.top_p: must be in \(0, 1\]"):
        SamplingSection(top_p=2.0)
    with pytest.raises(ConfigError) as e:
        RoleConfig(lr=None, micro_batch_size="4")  # type: ignore[arg-type]
    assert {i.key for i in e.value.issues} == {"actor_config.lr", "actor_config.load", "actor_config.micro_batch_size"}


def test_make_vocab_size_divisible_by_must_be_positive():
    issue(errors("grpo_tiny_cpu", "model.tiny_qwen2.make_vocab_size_divisible_by=0"),
          "model.tiny_qwen2.make_vocab_size_divisible_by", "must be >= 1, got 0")  # fmt: skip
