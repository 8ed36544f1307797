"""The planner with packed rows and token-budget micro-batches: a micro-batch's shape (s, b) from the token budget or
rows x the longest row (a packed row attends row by row: the attention terms of padded rows), the activations of that
shape, and the budget key as the fix for activations."""

from __future__ import annotations

import pytest

import mindrl.plan.memory as mem
from mindrl.config import load_config
from mindrl.plan import make_plan, to_text

SEQ = 88
"""grpo_tiny_cpu's longest row: max_prompt_length + max_tokens = 64 + 24."""


@pytest.mark.parametrize(
    "rows, budget, max_rows, packed, shape",
    [
        (4, None, None, False, (SEQ, 4)),  # rows: b rows of the longest row
        (4, None, None, True, (SEQ, 4)),  # packed rows attend row by row: the same terms
        (4, 300, None, False, (SEQ, 3)),  # padded, a budget: as many longest rows as it holds
        (4, 300, 2, False, (SEQ, 2)),
        (4, 50, None, False, (SEQ, 1)),  # a row over the budget runs alone
        (4, 300, None, True, (SEQ, 4)),  # packed, a budget: its tokens as rows of the longest row (ceil)
        (4, 300, 2, True, (SEQ, 2)),
        (4, 50, None, True, (SEQ, 1)),
    ],
)
def test_micro_batch_shape(rows, budget, max_rows, packed, shape):
    assert mem.micro_batch_shape(SEQ, rows, budget, max_rows, packed) == shape


def test_packed_budget_of_one_row_plans_as_one_padded_row():
    """A packed micro-batch of one longest row is a padded micro-batch of one row: the same activation bytes in
    every phase, and twice the micro-batches per step of micro_batch_size 2 rows."""
    padded = make_plan(load_config("grpo_tiny_cpu", overrides=["actor_config.micro_batch_size=1",
                                                               "rl_config.actor_forward_micro_batch_size=1",
                                                               "rl_config.ref_forward_micro_batch_size=1"]))  # fmt: skip
    packed = make_plan(load_config("grpo_tiny_cpu", overrides=["rl_config.use_remove_padding=true",
                                                               "rl_config.use_dynamic_bsz=true",
                                                               f"rl_config.max_packing_token_size={SEQ}"]))  # fmt: skip
    a, b = padded.layouts["actor"], packed.layouts["actor"]
    assert b.update_shape == b.forward_shape == a.update_shape == (SEQ, 1)
    assert a.micro_batches_per_step == b.micro_batches_per_step
    for role in ("actor", "reference"):
        for phase, terms in padded.memory[role].items():
            assert packed.memory[role][phase] == terms, (role, phase)
    assert "packed micro-batches of 1 x 88 tokens" in to_text(packed)


def test_fix_for_activations_is_the_token_budget():
    from mindrl.plan.planner import fix_key

    cfg = load_config("ppo_tiny_cpu", overrides=["rl_config.use_dynamic_bsz=true"])
    plan = make_plan(cfg)
    keys = {
        (role, phase): fix_key(cfg, role, phase, "activations_bytes", plan.layouts, True)
        for role, phase in [
            ("actor", "train"),
            ("actor", "score"),
            ("reference", "score"),
            ("critic", "score"),
            ("critic", "critic_train"),
        ]  # fmt: skip
    }
    assert keys == {
        ("actor", "train"): "rl_config.update_max_packing_token_size (lower it)",
        ("actor", "score"): "rl_config.actor_max_packing_token_size (lower it)",
        ("reference", "score"): "rl_config.ref_max_packing_token_size (lower it)",
        ("critic", "score"): "rl_config.max_packing_token_size (lower it)",
        ("critic", "critic_train"): "rl_config.max_packing_token_size (lower it)",
    }
