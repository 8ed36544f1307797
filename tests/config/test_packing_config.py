"""Config of packed rows and token-budget micro-batches (rl_config.use_remove_padding, use_dynamic_bsz and the
*max_packing_token_size / *dynamic_max_batch_size keys): MindSpeed-RL's defaults, what each budget cuts, what the
workers are told, and clear errors for a budget below 1 or one that cannot hold a row."""

from __future__ import annotations

import pytest

from mindrl.config import load_config
from mindrl.workers import from_config
from mindrl.workers.rl_model import MicroBatching
from tests.config.test_errors import errors, issue


def test_defaults_are_off_with_mindspeed_rls_budget():
    rl = load_config("ppo_tiny_cpu").rl_config
    assert (rl.use_remove_padding, rl.use_dynamic_bsz, rl.max_packing_token_size) == (False, False, 4096)
    assert rl.token_budget("update") == (None, None)
    actor = from_config.model_settings(load_config("ppo_tiny_cpu").actor_config, load_config("ppo_tiny_cpu"), 2, None)
    assert actor.micro_batching(False) == MicroBatching(rows=4)
    assert actor.micro_batching(True) == MicroBatching(rows=2)


def test_each_use_reads_its_budget_and_the_workers_get_them():
    """update_ / actor_ / ref_ budgets for the actor's update, old logprobs and reference logprobs; the critic's
    values and update read max_packing_token_size; unset ones fall back to max_packing_token_size and
    dynamic_max_batch_size."""
    cfg = load_config(
        "ppo_tiny_cpu",
        overrides=[
            "rl_config.use_remove_padding=true",
            "rl_config.use_dynamic_bsz=true",
            "rl_config.max_packing_token_size=200",
            "rl_config.update_max_packing_token_size=100",
            "rl_config.ref_max_packing_token_size=300",
            "rl_config.dynamic_max_batch_size=8",
            "rl_config.update_dynamic_max_batch_size=2",
        ],
    )
    rl = cfg.rl_config
    assert rl.token_budget("update") == (100, 2)
    assert rl.token_budget("actor") == (200, 8)
    assert rl.token_budget("ref") == (300, 8)
    assert rl.token_budget("critic") == (200, 8)
    actor = from_config.model_settings(cfg.actor_config, cfg, None, None)
    critic = from_config.model_settings(cfg.critic_config, cfg, None, None, critic=True)
    assert actor.micro_batching(False) == MicroBatching(4, 100, 2, True)
    assert actor.micro_batching(True) == MicroBatching(4, 200, 8, True)
    assert critic.micro_batching(False) == critic.micro_batching(True) == MicroBatching(4, 200, 8, True)


@pytest.mark.parametrize(
    "key", ["max_packing_token_size", "ref_max_packing_token_size", "update_dynamic_max_batch_size"]
)
def test_a_budget_below_one_is_an_error(key):
    issue(errors("grpo_tiny_cpu", f"rl_config.{key}=0"), f"rl_config.{key}", "must be >= 1")


def test_a_budget_that_cannot_hold_a_row_is_noted(caplog):
    """MindSpeed-RL's rule that every row fits (max_prompt_length + max_tokens = 64 + 24 tokens) is a warning naming
    the key the budget came from and the uses it cuts, once, as its shipped configs break it (a longer row gets a
    micro-batch of its own); budgets that cut nothing in the run (GRPO: no critic) are not checked."""
    import logging

    with caplog.at_level(logging.WARNING, logger="mindrl.config"):
        load_config("grpo_tiny_cpu", overrides=["rl_config.use_dynamic_bsz=true", "rl_config.max_packing_token_size=80",
                                                "rl_config.actor_max_packing_token_size=60"])  # fmt: skip
    notes = [r.getMessage() for r in caplog.records if "tokens per micro-batch" in r.getMessage()]
    assert len(notes) == 1 and "rl_config.max_packing_token_size=80" in notes[0], notes
    assert "(update, ref)" in notes[0] and "= 88" in notes[0] and "micro-batch of its own" in notes[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mindrl.config"):
        load_config(
            "grpo_tiny_cpu", overrides=["rl_config.use_dynamic_bsz=true", "rl_config.max_packing_token_size=88"]
        )
    assert not [r for r in caplog.records if "tokens per micro-batch" in r.getMessage()]
