"""The reward model's score (`mindrl.workers.reward_worker.last_token_scores`) against transformers'
*ForSequenceClassification on the same prompt + response tokens: left / right / no padding, EOS, a truncated and an
empty response; TP2 and PP2 against TP1; bounds from HF's own fp32-vs-fp64 gap."""

from __future__ import annotations

import pytest
import torch

from mindrl.checkpoint import convert
from mindrl.rollout.base import RolloutSample
from mindrl.trainer.experience import make_batch
from mindrl.workers.settings import MicroBatching
from tests.workers import reward_rank_fns
from tests.workers.reward_rank_fns import hf_model as _hf_model
from tests.workers.reward_rank_fns import hf_scores as _hf_scores

PROMPTS = ["What is 2 + 3?", "Name a colour of the sky on a clear summer day, in one word."]
RESPONSES = [  # (prompt index, response text, ends with EOS); the longest one is cut at its last token (truncated)
    (0, " It is 5.", True),
    (0, " The answer, after adding two and three together, is five", False),
    (0, "", False),
    (1, " Blue.", True),
    (1, " Light blue, mostly.", True),
    (1, " blue", False),
]


@pytest.fixture(scope="module")
def rm_case(tiny_models, tmp_path_factory, get_pool):
    """(HF dir, {(tp, pp): checkpoint}, the RL batch, each row's prompt + response ids, pad id)."""
    from transformers import AutoTokenizer

    hf = tiny_models["orm"]
    tok = AutoTokenizer.from_pretrained(hf)
    root = tmp_path_factory.mktemp("rm_ckpt")
    ckpts = {(1, 1): str(root / "tp1")}
    convert.hf2mcore(hf, ckpts[(1, 1)], 1, 1, orm=True, pool=get_pool())
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    samples = [[], []]
    for p, text, eos in RESPONSES:
        ids = tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
        samples[p].append(RolloutSample(ids, [0.0] * len(ids), "stop" if eos else "length"))
    batch = make_batch(prompts, samples, 3, tok.pad_token_id)
    assert tok.pad_token_id != tok.eos_token_id  # HF's pooling then keeps the EOS, as mindrl does
    rows = [prompts[i // 3] + ids for i, ids in enumerate(batch.rows_meta["response_ids"])]
    rows[2] = prompts[0]  # the empty response (make_batch gives it one masked pad token): its prompt alone
    return hf, ckpts, batch, rows, tok.pad_token_id


def test_scores_equal_transformers(rm_case, pool):
    hf, ckpts, batch, rows, pad = rm_case
    hf64, hf32 = _hf_model(hf, torch.float64), _hf_model(hf, torch.float32)
    truth = _hf_scores(hf64, rows, pad, "none")
    gap = (_hf_scores(hf32, rows, pad, "none").double() - truth).abs().max().item()  # what fp32 does to a score
    # HF's pooling of padded rows finds the same tokens. Left padding moves the positions, whose rotary tables HF
    # computes in fp32 even for an fp64 model: within fp32's error then, not fp64's.
    assert (_hf_scores(hf64, rows, pad, "right") - truth).abs().max().item() <= convert.GAP_FRACTION * gap
    assert (_hf_scores(hf64, rows, pad, "left") - truth).abs().max().item() <= gap
    # mindrl in fp64 (the score handed back in fp32): within GAP_FRACTION of fp32's error plus the final rounding
    tol = convert.GAP_FRACTION * gap + truth.abs().max().item() * torch.finfo(torch.float32).eps
    plain = MicroBatching(rows=2)
    packed = MicroBatching(token_budget=64, packed=True)
    for micro in (plain, packed, MicroBatching(rows=6)):  # padded rows, packed rows, prefix groups (3 per prompt)
        ours = next(r for r in pool.run(reward_rank_fns.scores_rank, ckpts[(1, 1)], 1, 1, batch, "float64", micro)
                    if r is not None)  # fmt: skip
        err = (ours.double() - truth).abs().max().item()
        print(f"{micro}: max |mindrl - HF| in fp64 {err:.3g} (tol {tol:.3g}; HF fp32-vs-fp64 gap {gap:.3g})")
        assert err <= tol, (micro, ours, truth)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_layouts_equal_tp1(rm_case, pool, tp, pp):
    """The reward model at TP2 / PP2 (a checkpoint saved at TP1, read at the new layout) scores as at TP1."""
    hf, ckpts, batch, rows, pad = rm_case
    runs = {}
    for layout in ((1, 1), (tp, pp)):
        runs[layout] = next(r for r in pool.run(reward_rank_fns.scores_rank, ckpts[(1, 1)], *layout, batch, "float64",
                                                MicroBatching(rows=2)) if r is not None)  # fmt: skip
    hf64, hf32 = _hf_model(hf, torch.float64), _hf_model(hf, torch.float32)
    truth = _hf_scores(hf64, rows, pad, "none")
    gap = (_hf_scores(hf32, rows, pad, "none").double() - truth).abs().max().item()
    tol = convert.GAP_FRACTION * gap + truth.abs().max().item() * torch.finfo(torch.float32).eps
    err = (runs[(tp, pp)].double() - runs[(1, 1)].double()).abs().max().item()
    print(f"TP{tp} PP{pp} vs TP1: max |diff| {err:.3g} (tol {tol:.3g})")
    assert err <= tol
