"""Config checks of the TR-DPO reference sync (rl_config.sync_ref_model, ref_model_sync_steps,
ref_model_mixup_alpha): TRL's defaults, and clear errors at load for a sync without a reference model, alpha outside
[0, 1] and a sync period below 1."""

from __future__ import annotations

import pytest

from mindrl.config import load_config
from tests.config.test_errors import errors, issue


def test_defaults_are_trls_and_off():
    rl = load_config("grpo_tiny_cpu").rl_config
    assert (rl.sync_ref_model, rl.ref_model_sync_steps, rl.ref_model_mixup_alpha) == (False, 512, 0.6)


@pytest.mark.parametrize("name", ["grpo_tiny_cpu", "ppo_tiny_cpu"])
def test_sync_loads_with_a_kl_term(name):
    rl = load_config(name, overrides=["rl_config.sync_ref_model=true", "rl_config.ref_model_sync_steps=1",
                                      "rl_config.ref_model_mixup_alpha=1.0"]).rl_config  # fmt: skip
    assert rl.sync_ref_model and rl.needs_reference and rl.ref_model_sync_steps == 1


@pytest.mark.parametrize(
    "name, kl, where",
    [
        ("grpo_tiny_cpu", [], "in the actor loss"),
        ("ppo_tiny_cpu", [], "in the reward"),
        ("ppo_tiny_cpu", ["rl_config.use_kl_in_reward=false"], "in the actor loss"),
    ],
)
def test_sync_without_a_reference_model_is_an_error(name, kl, where):
    err = errors(name, "rl_config.sync_ref_model=true", "rl_config.init_kl_coef=0.0", *kl)
    issue(err, "rl_config.sync_ref_model", "no reference model to sync", where, "init_kl_coef=0.0",
          "sync_ref_model: false")  # fmt: skip


@pytest.mark.parametrize("alpha", ["-0.1", "1.5"])
def test_alpha_outside_0_1_is_an_error(alpha):
    issue(errors("grpo_tiny_cpu", f"rl_config.ref_model_mixup_alpha={alpha}"), "rl_config.ref_model_mixup_alpha",
          "must be in [0, 1]", alpha)  # fmt: skip


def test_sync_period_below_one_is_an_error():
    issue(errors("grpo_tiny_cpu", "rl_config.ref_model_sync_steps=0"), "rl_config.ref_model_sync_steps", ">= 1")


def test_builder_and_config_agree_on_the_reference():
    """from_config.needs_reference (what the trainer builds) is the config's rule that the sync check uses."""
    from mindrl.workers import from_config

    for overrides in ([], ["rl_config.init_kl_coef=0.0"], ["rl_config.use_kl_in_reward=false"]):
        cfg = load_config("ppo_tiny_cpu", overrides=overrides)
        assert (
            from_config.needs_reference(cfg)
            == cfg.rl_config.needs_reference
            == ("rl_config.init_kl_coef=0.0" not in overrides)
        )
