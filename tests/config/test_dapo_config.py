"""DAPO, Dr.GRPO and GSPO keys at load: a MindSpeed-RL DAPO recipe written in its style loads (stage ray_dapo, the
overlong buffer, dynamic sampling, acc_for_dapo), the derived train batch, each key's errors, and docs/algorithms.md
naming only keys the loader accepts."""

from __future__ import annotations

import os
import re

import pytest

from mindrl.config import ConfigError, load_config
from mindrl.config.rl import RLSectionConfig
from tests.config.conftest import write_configs
from tests.config.test_errors import errors, issue
from tests.config.test_mindspeed_compat import GRPO, MODEL_7B

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# MindSpeed-RL's DAPO block (dapo_qwen25_32b_A3's keys) on the 7B GRPO recipe of test_mindspeed_compat.
DAPO = (
    GRPO.replace("stage: ray_grpo", "stage: ray_dapo")
    .replace('verifier_function: ["math_verify_reward", "format"]', 'verifier_function: ["acc_for_dapo"]')
    .replace("verifier_weight: [1.0, 0.5]", "verifier_weight: [1.0]")
    .replace(
        "  actor_resource:\n",
        """  token_level_loss: true
  clip_higher_enable: true
  clip_ratio_low: 0.2
  clip_ratio_high: 0.28
  overlong_buffer_enable: true
  rollout_max_tokens : 2048
  overlong_buffer: 512
  overlong_buffer_penalty_factor: 1.0
  filter_groups_enable: true
  filter_groups_metric: acc_for_dapo
  filter_groups_max_batches: -1
  filter_groups_train_batch_size: 8
  actor_resource:
""",
    )
)


def _dir(tmp_path, text: str = DAPO):
    return write_configs(tmp_path / "configs", {"model/qwen25_7b.yaml": MODEL_7B, "dapo_qwen25_7b_A3.yaml": text})


def test_a_mindspeed_dapo_recipe_loads(tmp_path):
    cfg = load_config("dapo_qwen25_7b_A3", config_path=str(_dir(tmp_path)))
    rl = cfg.rl_config
    assert rl.overlong_buffer_enable and rl.overlong_buffer == 512 and rl.rollout_max_tokens == 2048
    assert rl.filter_groups_enable and rl.filter_groups_metric == "acc_for_dapo" and rl.filter_groups_max_batches == -1
    assert rl.verifier_function == ["acc_for_dapo"] and rl.loss_agg_mode == "token-mean"
    # stage ray_dapo: MindSpeed-RL's DAPO loss has no KL, so there is no reference model despite init_kl_coef
    assert rl.init_kl_coef == 0.001 and rl.kl_coef_in_loss == 0 and not rl.needs_reference
    assert rl.train_batch_size == 8 and rl.num_mini_batches == 1 and rl.on_policy
    assert not [k for k in cfg.ignored_keys if "filter_groups" in k or "overlong" in k or "token_level" in k]


def test_the_same_recipe_under_ray_grpo_keeps_its_kl(tmp_path):
    cfg = load_config("dapo_qwen25_7b_A3", config_path=str(_dir(tmp_path, DAPO.replace("ray_dapo", "ray_grpo"))))
    assert cfg.rl_config.kl_coef_in_loss == 0.001 and cfg.rl_config.needs_reference


def test_train_batch_and_mini_batches_follow_filter_groups_train_batch_size(tmp_path):
    text = DAPO.replace("filter_groups_train_batch_size: 8", "filter_groups_train_batch_size: 16")
    cfg = load_config("dapo_qwen25_7b_A3", config_path=str(_dir(tmp_path, text)))
    assert cfg.rl_config.train_batch_size == 16 and cfg.rl_config.num_mini_batches == 2
    text = DAPO.replace("filter_groups_train_batch_size: 8", "filter_groups_train_batch_size: 12")
    err = errors("dapo_qwen25_7b_A3", config_path=str(_dir(tmp_path, text)))
    issue(err, "rl_config.mini_batch_size", "filter_groups_train_batch_size=12", "mini_batch_size=8")


def test_dapo_key_errors(tmp_path):
    d = str(_dir(tmp_path))
    issue(errors("dapo_qwen25_7b_A3", "rl_config.filter_groups_metric=acc", config_path=d),
          "rl_config.filter_groups_metric", "'acc' is neither one of verifier_function (acc_for_dapo)", "seq_reward")  # fmt: skip
    issue(errors("dapo_qwen25_7b_A3", "rl_config.rollout_max_tokens=1024", config_path=d),
          "rl_config.rollout_max_tokens", "1024 differs from generate_config.sampling_config.max_tokens=2048")  # fmt: skip
    issue(errors("dapo_qwen25_7b_A3", "rl_config.overlong_buffer=2048", "rl_config.rollout_max_tokens=null",
                 config_path=d), "rl_config.overlong_buffer", "must be below sampling_config.max_tokens=2048")  # fmt: skip
    issue(errors("dapo_qwen25_7b_A3", "rl_config.overlong_buffer=0", config_path=d),
          "rl_config.overlong_buffer", "must be >= 1")  # fmt: skip
    issue(errors("dapo_qwen25_7b_A3", "rl_config.loss_agg_mode=seq-mean-token-sum", config_path=d),
          "rl_config.token_level_loss", "loss_agg_mode token-mean", "remove one of them")  # fmt: skip
    err = errors("dapo_qwen25_7b_A3", "rl_config.n_samples_per_prompt=1", config_path=d)
    issue(err, "rl_config.filter_groups_enable", "n_samples_per_prompt >= 2")
    issue(errors("dapo_qwen25_7b_A3", "+rl_config.sync_ref_model=true", config_path=d),
          "rl_config.sync_ref_model", "stage ray_dapo has no KL term")  # fmt: skip
    cfg = load_config("dapo_qwen25_7b_A3", config_path=d, overrides=["rl_config.token_level_loss=false"])
    assert cfg.rl_config.loss_agg_mode == "seq-mean-token-mean"


def test_dr_grpo_and_gspo_keys():
    cfg = load_config("grpo_tiny_cpu", overrides=["+rl_config.norm_adv_by_std_in_grpo=false",
                      "rl_config.loss_agg_mode=seq-mean-token-sum-norm", "+rl_config.policy_loss_mode=gspo"])  # fmt: skip
    rl = cfg.rl_config
    assert rl.norm_adv_by_std_in_grpo is False and rl.policy_loss_mode == "gspo" and rl.loss_scale_factor is None
    from mindrl.workers.from_config import loss_settings

    s = loss_settings(cfg)
    assert s.policy_loss_mode == "gspo" and s.loss_scale_factor == cfg.generate_config.sampling_config.max_tokens
    issue(errors("grpo_tiny_cpu", "+rl_config.policy_loss_mode=gpso"), "rl_config.policy_loss_mode",
          "'gpso' is not one of vanilla, gspo", "did you mean 'gspo'")  # fmt: skip
    issue(errors("grpo_tiny_cpu", "+rl_config.policy_loss_mode=gspo", "+rl_config.clip_ratio_c=3"),
          "rl_config.clip_ratio_c", "gspo clips sequences")  # fmt: skip
    issue(errors("grpo_tiny_cpu", "+rl_config.loss_scale_factor=0"), "rl_config.loss_scale_factor", "must be >= 1")


def test_an_older_recipes_shuffle_minibatch_is_shuffle_mini_batch(tmp_path):
    text = GRPO.replace("shuffle_mini_batch: false", "shuffle_minibatch: true")
    d = write_configs(tmp_path / "configs", {"model/qwen25_7b.yaml": MODEL_7B, "grpo_qwen25_7b_A3.yaml": text})
    cfg = load_config("grpo_qwen25_7b_A3", config_path=str(d))
    assert cfg.rl_config.shuffle_mini_batch is True


def test_shipped_dapo_config():
    cfg = load_config("dapo_tiny_cpu")
    rl = cfg.rl_config
    assert cfg.megatron_training.stage == "ray_dapo" and not rl.needs_reference
    assert rl.filter_groups_enable and rl.overlong_buffer_enable and rl.clip_ratio_high == 0.28
    assert rl.rollout_max_tokens == cfg.generate_config.sampling_config.max_tokens


def test_docs_name_only_keys_the_loader_accepts():
    """docs/algorithms.md: every `rl_config.X`, every key of its 'Config keys, all in `rl_config`' list and of the
    GRPO-family table exists; and it names no section key (actor_config.kl_loss_coef...) that does not."""
    text = open(os.path.join(ROOT, "docs", "algorithms.md")).read()
    fields = set(RLSectionConfig.field_names())
    named = set(re.findall(r"rl_config\.(\w+)", text))
    listed = re.search(r"Config keys, all in `rl_config`:(.*?)DAPO's below", text, re.S)
    assert listed
    named |= set(re.findall(r"`(\w+)`", listed.group(1)))
    family = text[text.index("## The GRPO family") : text.index("**GSPO**")]
    named |= {k for k in re.findall(r"`(\w+)(?::[^`]*)?`", family) if "_" in k and k != "ray_dapo"}
    named -= {"group_norm", "acc_for_dapo", "seq_mean_token_sum_norm"}
    named.discard("stage")  # megatron_training.stage, checked below
    assert named and not (named - fields), sorted(named - fields)
    assert "megatron_training.stage" in text
    assert not re.findall(r"(?:actor_config|critic_config)\.\w+", text)


def test_config_error_type():
    with pytest.raises(ConfigError):
        load_config("grpo_tiny_cpu", overrides=["+rl_config.filter_groups_enable=true",
                                                "+rl_config.filter_groups_metric=nope"])  # fmt: skip
