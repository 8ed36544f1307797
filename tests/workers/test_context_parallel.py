"""Context parallelism (megatron_cp_algo): CP2 equals CP1 in the attention itself, and in the actor's and the critic's
forward (logprobs, values), update metrics, gradients and weights, at CP2, CP2 x TP2 (+SP) and CP2 x PP2, padded and
packed rows. fp32 on CPU, gloo ranks; the bound is the CP1 run's own gap to DP-invariance (see `rel`)."""

from __future__ import annotations

import pytest
import torch

from mindrl.models.context_parallel import CPSplit
from mindrl.workers.settings import MicroBatching
from tests.workers import cp_rank_fns
from tests.workers.test_ppo_update import ACTOR_LOSS, CRITIC_LOSS, ckpts, rl_batch  # noqa: F401 (fixtures)

LOSSES = {"actor": ACTOR_LOSS, "critic": CRITIC_LOSS}


def test_split_is_megatrons_load_balanced_chunks():
    split = CPSplit(16, 2, 1)
    assert split.columns().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert CPSplit(16, 2, 0).columns().tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert sorted(split.gathered().tolist()) == list(range(16))
    with pytest.raises(ValueError, match="does not split into 2 x 2"):
        CPSplit(18, 2, 0)


def test_attention_over_cp_is_exact(pool):
    """Each rank's query chunks over the gathered K/V: the full rows' attention and its input gradients (fp64)."""
    cp = 2
    runs = pool.run(cp_rank_fns.attention_rank, cp, 7)
    g = torch.Generator().manual_seed(7)
    s, b, h, d = 16, 2, 4, 8
    q, k, v = (torch.randn(s, b, h, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    mask = torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, 1, s, s).clone()
    mask[0, :, :, :3] = True
    mask[0] &= ~torch.eye(s, dtype=torch.bool)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k).masked_fill(mask, float("-inf"))
    out = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)
    out.pow(2).sum().backward()
    for r in runs:
        torch.testing.assert_close(r["out"], out.detach(), rtol=1e-12, atol=1e-12)
        cols = r["cols"]
        # every rank computes the whole loss; K/V gradients summed over the ranks' queries
        for name, ref in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            torch.testing.assert_close(r[name], ref[cols], rtol=1e-12, atol=1e-12)


def rel(got: dict, want: dict) -> float:
    """|got - want| / |want| over all the tensors together."""
    num = sum(((got[k] - want[k]).norm() ** 2).item() for k in want)
    return (num / sum((want[k].norm() ** 2).item() for k in want)) ** 0.5


def merged(runs, what):
    return {k: v for r in runs if r[what] for k, v in r[what].items()}


def forwards(runs, rows: int):
    out = None
    for r in runs:
        if r["forward"] is None:
            continue
        idx, t = r["forward"]
        out = torch.zeros(rows, t.shape[1]) if out is None else out
        out[idx, : t.shape[1]] = t
    return out


LAYOUTS = [
    pytest.param(1, 1, False, id="cp2"),
    pytest.param(2, 1, True, id="cp2-tp2-sp"),
    pytest.param(1, 2, False, id="cp2-pp2"),
]


def update_rel(got: dict, want: dict, before: dict) -> float:
    """|got - want| over |want - before| (the weight update's own size), over all weights together."""
    num = sum(((got[k] - want[k]).norm() ** 2).item() for k in want)
    return (num / sum(((want[k] - before[k]).norm() ** 2).item() for k in want)) ** 0.5


def gaps(a, b, n: int, before: dict) -> dict:
    fa, fb = forwards(a, n), forwards(b, n)
    ma, mb = a[0]["metrics"], b[0]["metrics"]
    return {
        "forward": ((fb - fa).abs().max() / fa.abs().max()).item(),
        "metrics": max(abs(mb[k] - ma[k]) / max(1.0, abs(ma[k])) for k in ma if not k.startswith("_")),
        "grads": rel(merged(b, "grads"), merged(a, "grads")),
        "update": update_rel(merged(b, "weights"), merged(a, "weights"), before),
    }


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("tp, pp, sp", LAYOUTS)
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_cp2_equals_cp1(pool, tiny_models, ckpts, rl_batch, role, tp, pp, sp, packed):  # noqa: F811
    """CP2 against CP1 at the same TP x PP (the CP1 run has twice the DP: the update is DP-invariant). The bound is
    the fp32 gap between two CP1 runs that group the same sums differently (2 rows per micro-batch against 1),
    measured here, or 1e-6 where that gap is smaller."""
    from mindrl.checkpoint.hf_io import HFCheckpoint

    loss = LOSSES[role]
    one = pool.run(
        cp_rank_fns.layout_rank, ckpts[role], tp, pp, 1, rl_batch, role, loss, MicroBatching(2, packed=packed), sp
    )
    ref = pool.run(
        cp_rank_fns.layout_rank, ckpts[role], tp, pp, 1, rl_batch, role, loss, MicroBatching(1, packed=packed), sp
    )
    two = pool.run(
        cp_rank_fns.layout_rank, ckpts[role], tp, pp, 2, rl_batch, role, loss, MicroBatching(2, packed=packed), sp
    )
    hf = HFCheckpoint(tiny_models["untied" if role == "actor" else "orm"])
    before = {k: hf.get(k).float() for k in merged(one, "weights")}
    n = len(rl_batch)
    bound = {k: max(1e-6, v) for k, v in gaps(one, ref, n, before).items()}
    # Adam's first step is ~sign(g): where g is near eps it magnifies rounding (test_ppo_update.check_savings' bound)
    bound["update"] = max(bound["update"], 1e-4)
    got = gaps(one, two, n, before)
    print(f"{role} tp{tp} pp{pp} sp{sp} packed{packed}: CP2 vs CP1 {got}, fp32 regrouping gap {bound}")
    assert sorted(one[0]["metrics"]) == sorted(two[0]["metrics"])
    assert one[0]["metrics"]["_tokens"][1:] == two[0]["metrics"]["_tokens"][1:]  # computed: padded to 2 x CP
    for k in got:
        assert got[k] <= bound[k], (k, got[k], bound[k])


@pytest.mark.parametrize("platform", ["cpu", "gemm", "cuda", "npu"])
def test_platform_kernels_attend_a_cp_ranks_rows(monkeypatch, platform):
    """Each platform's core attention (CPU's SDPA and GEMM paths, CUDA's kernel choice on CPU tensors, the NPU's
    npu_fusion_attention through tests/models' named fake, which computes in fp32) on one CP rank's queries over the
    gathered keys with `CPSplit.local_mask`: the rows of the fp64 truth, within twice the path's own error on the
    whole rows (or 1e-12). GQA, a left-padded row."""
    import sys

    from mindrl.models.attention import gemm_attention
    from mindrl.models.forward import attention_inputs
    from mindrl.platform import CpuPlatform, CudaPlatform
    from mindrl.platform.npu import NpuPlatform
    from tests.models.test_sdpa_attention import FakeTorchNpu

    if platform == "npu":
        monkeypatch.setitem(sys.modules, "torch_npu", FakeTorchNpu())
    plat = {"cpu": CpuPlatform, "gemm": CpuPlatform, "cuda": CudaPlatform, "npu": NpuPlatform}[platform]()

    def attend(q, k, v, mask):  # [b, n, s, d] layouts
        if platform == "gemm":  # megatron's [s, b, n, d] in
            return gemm_attention(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), mask, 0.3)
        return plat.core_attention(q, k, v, mask, 0.3, 0.0)

    g = torch.Generator().manual_seed(3)
    s, b, heads, kv, d, cp = 16, 2, 4, 2, 8, 2
    q, k, v = (torch.randn(b, n, s, d, generator=g, dtype=torch.float64) for n in (heads, kv, kv))
    valid = torch.ones(b, s, dtype=torch.long)
    valid[1, :5] = 0
    _, mask = attention_inputs(valid, valid)
    ek, ev = (t.repeat_interleave(heads // kv, 1) for t in (k, v))
    truth = (q @ ek.transpose(-1, -2) * 0.3).masked_fill(mask, float("-inf")).softmax(-1) @ ev
    bound = max(1e-12, 2 * (attend(q, k, v, mask).double() - truth).abs().max().item())
    for rank in range(cp):
        split = CPSplit(s, cp, rank)
        order = split.gathered()
        local_q = q.index_select(2, split.columns())
        out = attend(local_q, k.index_select(2, order), v.index_select(2, order), split.local_mask(mask))
        err = (out.double() - truth.index_select(2, split.columns())).abs().max().item()
        assert err <= bound, (platform, rank, err, bound)
