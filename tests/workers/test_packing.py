"""Packed rows (use_remove_padding) and token-budget micro-batches (use_dynamic_bsz) give the padded row-count path's
logprobs / values, losses and gradients, at TP1, TP2 with sequence parallelism, PP2 and TP2xPP2, for the actor and
the critic. fp32 on CPU, gloo ranks."""

from __future__ import annotations

import pytest
import torch

from mindrl.batch import Batch, pad_rows
from mindrl.models.packing import cut_by_budget, pack_rows
from mindrl.workers.rl_model import MicroBatching
from tests.workers import ppo_rank_fns
from tests.workers.test_ppo_update import ACTOR_LOSS, CRITIC_LOSS, ckpts, make_batch, rel_diffs  # noqa: F401

# Sixteen rows: prompts of 1 to 8 tokens, responses of 1 to 12 tokens and one of 48 (a row 4x longer than any other,
# over the token budget on its own).
PROMPT_LENS = [3, 8, 5, 1, 7, 4, 6, 2, 5, 3, 8, 2, 6, 4, 7, 1]
RESPONSE_LENS = [48, 4, 7, 1, 9, 6, 3, 8, 10, 2, 5, 12, 6, 3, 9, 4]
BUDGET = 24
"""Tokens per micro-batch: the long row (51 tokens) goes alone, the others several to a micro-batch."""
LAYOUTS = [
    pytest.param(1, 1, False, id="tp1"),
    pytest.param(2, 1, True, id="tp2-sp"),
    pytest.param(1, 2, False, id="pp2"),
    pytest.param(2, 2, False, id="tp2pp2"),
]
POOL_WORLD = 4


@pytest.fixture(scope="module")
def long_batch(tiny_models) -> Batch:
    return make_batch(tiny_models["untied"], tiny_models["orm"], prompt_lens=PROMPT_LENS, response_lens=RESPONSE_LENS)


def close(got, want, bound: float) -> bool:
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    return (got - want).abs().max().item() <= bound * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("tp,pp,sp", LAYOUTS)
def test_packed_and_budgeted_equal_the_padded_path(pool, ckpts, long_batch, role, tp, pp, sp):  # noqa: F811
    """Packed rows (2 micro-batches per DP rank, and micro-batches cut by a token budget) and padded rows cut by the
    token budget against padded rows, 2 micro-batches per DP rank: the same logprobs / values and loss metrics within
    1e-6 relative (the issue's bound), every parameter's gradient within 1e-6 of the gradients' norm; packed, the
    model computes the real tokens only (under sequence parallelism, up to TP - 1 padding columns per micro-batch),
    and its core attention runs them row by row."""
    rows = len(long_batch) // (POOL_WORLD // (tp * pp)) // 2
    variants = {
        "padded": MicroBatching(rows=rows),
        "packed": MicroBatching(rows=rows, packed=True),
        "packed_budget": MicroBatching(token_budget=BUDGET, packed=True),
        "padded_budget": MicroBatching(token_budget=BUDGET * 2, max_rows=3),
    }
    loss = ACTOR_LOSS if role == "actor" else CRITIC_LOSS
    runs = pool.run(ppo_rank_fns.micro_batching_rank, ckpts[role], tp, pp, long_batch, role, loss, variants, sp)
    want = runs[0]["padded"]
    real = long_batch["attention_mask"].sum().item()
    for name in variants:
        if name == "padded":
            continue
        got = runs[0][name]
        assert (got["row_attention"] > 0) == name.startswith("packed"), (name, got["row_attention"])
        for k, v in want["metrics"].items():
            if k == "_tokens":
                computed, counted_real, _, shared = got["metrics"][k]
                assert counted_real == real and shared == 0
                if name.startswith("packed"):
                    assert real <= computed <= real + (tp - 1) * len(long_batch), (name, got["metrics"][k])
                    assert computed == real or sp
            elif not k.endswith("/lr"):
                assert close(got["metrics"][k], v, 1e-6), (name, k, v, got["metrics"][k])
        forwards = [(r["padded"]["forward"], r[name]["forward"]) for r in runs if r["padded"]["forward"] is not None]
        assert forwards
        for w, g in forwards:
            assert close(g, w, 1e-6), (name, (g - w).abs().max().item())
        grads = [{k: v for r in runs if r[n]["grads"] for k, v in r[n]["grads"].items()} for n in ("padded", name)]
        norm = sum((t.norm() ** 2).item() for t in grads[0].values()) ** 0.5
        worst = max((grads[1][k] - grads[0][k]).norm().item() for k in grads[0]) / norm
        per_tensor = max(rel_diffs(grads[1], grads[0]).values())
        print(f"{role} tp{tp} pp{pp} {name}: gradient {worst:.2g} of the norm, {per_tensor:.2g} per tensor")
        assert worst <= 1e-6, (name, worst)


def test_pack_rows_layout():
    """Two rows (prompts left-padded to 3, responses right-padded to 3) packed without padding, rounded up to a
    multiple of 4: ids in order, positions restarting per row, a block-diagonal causal mask (a padding column sees
    itself), and each response token's predicting column (column 0 where that is padding)."""
    prompt_ids, prompt_mask = pad_rows([[11, 12], [21, 22, 23]], pad=0, left=True)
    resp_ids, resp_mask = pad_rows([[13, 14, 15], [24]], pad=0, left=False)
    ids, mask = torch.cat([prompt_ids, resp_ids], 1), torch.cat([prompt_mask, resp_mask], 1)
    packed = pack_rows(ids, mask, 3, multiple=4)
    assert packed.ids.tolist() == [[11, 12, 13, 14, 15, 21, 22, 23, 24, 0, 0, 0]]
    assert packed.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0]
    assert packed.real == 9 and packed.width == 12
    # row 0's response tokens are predicted by its columns 1, 2, 3; row 1's by columns 7 and 8, then padding
    assert packed.sources.tolist() == [1, 2, 3, 7, 8, 0]
    seen = ~packed.mask()[0, 0]
    want = torch.zeros(12, 12, dtype=torch.bool)
    want[:5, :5] = torch.ones(5, 5).tril().bool()
    want[5:9, 5:9] = torch.ones(4, 4).tril().bool()
    want[9:, 9:] = torch.eye(3, dtype=torch.bool)
    assert torch.equal(seen, want)


def test_cut_by_budget():
    """First fit in the given order within the budget and the row cap; a row over the budget alone."""
    lens = [30, 9, 8, 6, 5, 2]

    def cost(rows):
        return sum(lens[r] for r in rows)

    assert cut_by_budget(range(6), cost, 16) == [[0], [1, 3], [2, 4, 5]]
    assert cut_by_budget(range(6), cost, 16, max_rows=2) == [[0], [1, 3], [2, 4], [5]]
    assert cut_by_budget(range(6), cost, 100) == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("path", ["gemm", "sdpa"])
def test_packed_rows_attend_row_by_row(monkeypatch, path):
    """SDPAttention on packed rows (three rows of 7, 2 and 5 tokens, packed to a multiple of 4: two padding columns)
    attends row by row, rows of similar length as padded rows (`RowAttention`): the context and the q / k / v gradients at the real columns equal the full
    block-diagonal mask's, within 1e-6 of the largest value in fp64 (the same computation, other shapes); the padding
    columns' context is their own value (it sees only itself)."""
    from types import SimpleNamespace

    from mindrl.models.attention import SDPAttention
    from mindrl.models.packing import packed_rows_of

    monkeypatch.setenv("MINDRL_GEMM_ATTENTION_MAX_LEN", "320" if path == "gemm" else "0")
    gen = torch.Generator().manual_seed(5)
    prompt_ids, prompt_mask = pad_rows([[1, 2, 3], [4], [5, 6]], pad=0, left=True)
    resp_ids, resp_mask = pad_rows([[7, 8, 9, 10], [11], [12, 13, 14]], pad=0, left=False)
    packed = pack_rows(torch.cat([prompt_ids, resp_ids], 1), torch.cat([prompt_mask, resp_mask], 1), 3, multiple=4)
    mask = packed.mask()
    rows = packed_rows_of(mask)
    # rows of 7 and 5 tokens in one group of padded rows, the row of 2 and the two padding columns in another
    assert (packed.real, packed.width) == (14, 16)
    assert [(g.rows, g.length) for g in rows.groups] == [(2, 7), (3, 2)]
    heads, kv, d, s = 4, 2, 8, packed.width
    q, k, v = (torch.randn(s, 1, h, d, generator=gen, dtype=torch.float64) for h in (heads, kv, kv))
    core = SDPAttention.__new__(SDPAttention)  # the attention maths only: no megatron module state is read
    torch.nn.Module.__init__(core)
    core.softmax_scale, core.num_attention_heads_per_partition, core.num_query_groups_per_partition = d**-0.5, heads, kv
    core.hidden_size_per_partition, core.config = heads * d, SimpleNamespace(sequence_parallel=False)
    grad = torch.randn(s, 1, heads * d, generator=gen, dtype=torch.float64)

    def run(row_by_row: bool):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        if row_by_row:
            out = core._packed_rows(*leaves, rows, 0.0)
        else:  # a copy of the mask carries no rows: the full [s, s] mask
            out = core._context(core._attend(*leaves, mask.clone(), 0.0))
        out.backward(grad)
        return [out.detach()] + [x.grad for x in leaves]

    for what, got, want in zip(("context", "dq", "dk", "dv"), run(True), run(False)):
        err = (got - want).abs().max().item() / want.abs().max().item()
        assert err < 1e-6, (what, err)
    out = run(True)[0]
    assert torch.allclose(out[15, 0].view(heads, d), v[15, 0].repeat_interleave(heads // kv, 0))
