"""`Batch.real_widths` and `Batch.reframe`, the cut the PPO passes apply to each micro-batch: the widths of rows
without their padding, the tensors cut (or the prompt left-extended) consistently, and real tokens never cut."""

from __future__ import annotations

import pytest
import torch

from mindrl.batch import Batch, pad_rows


def rl_batch(prompts: list[list[int]], responses: list[list[int]]) -> Batch:
    prompt_ids, prompt_mask = pad_rows(prompts, pad=0, left=True)
    response_ids, response_mask = pad_rows(responses, pad=0, left=False)
    return Batch(
        {
            "input_ids": torch.cat([prompt_ids, response_ids], 1),
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "responses": response_ids,
            "response_mask": response_mask,
            "advantages": response_mask.float() * 2,
            "scores": torch.arange(len(prompts), dtype=torch.float),  # per row: left alone
        },
        rows_meta={"uid": list(range(len(prompts)))},
        meta={"prompt_length": prompt_ids.shape[1]},
    )


BATCH = rl_batch([[1, 2], [3, 4, 5], [6]], [[7], [8, 9, 10, 11], []])  # P = 3, R = 4


def test_real_widths():
    prompt, response = BATCH.real_widths()
    assert prompt.tolist() == [2, 3, 1] and response.tolist() == [1, 4, 0]


def test_reframe_cuts_every_tensor_consistently():
    sub = BATCH.index([0, 2])
    cut = sub.reframe(2, 1)
    assert cut.meta["prompt_length"] == 2 and cut.rows_meta == sub.rows_meta
    assert cut["input_ids"].tolist() == [[1, 2, 7], [0, 6, 0]]
    assert cut["attention_mask"].tolist() == [[1, 1, 1], [0, 1, 0]]
    assert cut["responses"].tolist() == [[7], [0]] and cut["advantages"].tolist() == [[2.0], [0.0]]
    assert torch.equal(cut["scores"], sub["scores"])


def test_reframe_extends_the_prompt_with_padding():
    wide = BATCH.reframe(5, 4)
    assert wide["input_ids"][:, :2].eq(0).all() and wide["attention_mask"][:, :2].eq(0).all()
    assert torch.equal(wide["input_ids"][:, 2:], BATCH["input_ids"])


@pytest.mark.parametrize("widths", [(2, 4), (3, 3), (3, 5), (0, 4)])
def test_reframe_refuses_to_cut_real_tokens(widths):
    with pytest.raises(ValueError, match="reframe"):
        BATCH.reframe(*widths)
