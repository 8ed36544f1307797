"""The shipped 32B configs train in bf16 with megatron's distributed optimizer: a few actor PPO steps
(ppo_update, 2 mini-batches x 2 epochs, TP2 x DP2 on gloo) in bf16 against fp32, the distributed optimizer
against the plain one, and gradient clipping that really clips (CPU, tiny model)."""

from __future__ import annotations

import math

import pytest

import tests.conftest as conftest
from mindrl.checkpoint import convert
from mindrl.checkpoint.hf_io import HFCheckpoint
from mindrl.launch import RankPool
from mindrl.workers.train_setup import OptimSettings
from tests.workers import distopt_rank_fns, ppo_rank_fns
from tests.workers.test_ppo_update import ACTOR_LOSS, make_batch

MINI, EPOCHS, MICRO = 2, 2, 1  # 4 optimizer steps; DP2 -> 2 rows per rank per mini-batch, 2 micro-batches
OPTIM = OptimSettings(lr=1e-3, clip_grad=1.0, adam_eps=1e-6)


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    if conftest._POOL is None or conftest._POOL.closed:
        conftest._POOL = RankPool(4, timeout_s=600)
    out = str(tmp_path_factory.mktemp("bf16") / "actor")
    convert.hf2mcore(tiny_models["untied"], out, 2, 1, pool=conftest._POOL)
    batch = make_batch(tiny_models["untied"], tiny_models["orm"])
    return out, batch, HFCheckpoint(tiny_models["untied"])


@pytest.fixture(scope="module")
def runs(setup):
    """runs(dtype, distributed) -> (metrics, weights), memoised."""
    done = {}

    def get(dtype: str, distributed: bool):
        if (dtype, distributed) not in done:
            load_dir, batch, _ = setup
            optim = OptimSettings(**{**OPTIM.__dict__, "use_distributed_optimizer": distributed})
            results = conftest._POOL.run(
                distopt_rank_fns.ppo_train_rank, load_dir, 2, batch, ACTOR_LOSS, optim, dtype, MINI, EPOCHS, MICRO
            )
            assert results[0]["dp"] == 2
            for r in results:
                assert r["metrics"] == results[0]["metrics"]
            done[dtype, distributed] = results[0]["metrics"], results[0]["weights"]
        return done[dtype, distributed]

    return get


def update_diff(got: dict, want: dict, before: HFCheckpoint) -> tuple[float, float]:
    """(||Δgot - Δwant|| / ||Δwant||, max |got - want|): how far two runs' weight updates differ."""
    num = den = 0.0
    worst = 0.0
    for k in want:
        start = before.get(k).float()
        num += ((got[k] - start) - (want[k] - start)).norm().item() ** 2
        den += (want[k] - start).norm().item() ** 2
        worst = max(worst, (got[k] - want[k]).abs().max().item())
    return math.sqrt(num / den), worst


def test_distributed_optimizer_matches_the_plain_one(pool, setup, runs):
    """fp32: the same 4 PPO steps with the optimizer state sharded over DP2 give the same weights and metrics
    (measured: max abs weight diff 1.0e-6, relative update diff 1.5e-6, from the reduce-scatter's summation
    order; bounds 1e-5 and 1e-4)."""
    _, _, before = setup
    (m_plain, w_plain), (m_dist, w_dist) = runs("float32", False), runs("float32", True)
    rel, worst = update_diff(w_dist, w_plain, before)
    print(f"distopt vs plain (fp32): max abs weight diff {worst:.3g}, relative update diff {rel:.3g}")
    assert worst < 1e-5 and rel < 1e-4
    for k, v in m_plain.items():
        if not k.startswith("_"):
            assert abs(m_dist[k] - v) <= 1e-5 * max(1.0, abs(v)), (k, m_dist[k], v)


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distopt"])
def test_bf16_tracks_fp32(pool, setup, runs, distributed):
    """bf16 params and activations (fp32 main params, grads reduced in fp32) against the fp32 run. bf16 keeps 8
    mantissa bits (relative rounding 2^-9 ~ 2e-3 per op): the losses agree to ~1e-2 relative, and the weight
    updates point the same way: the relative update error is measured at 0.09 (max abs weight diff 7e-3) (Adam's g / sqrt(v) turns
    small gradient differences into same-size update differences where the gradient is near zero), bound 0.35.
    A wrong bf16 path (a missing master copy, a grad in bf16 truncating the update, a skipped step) gives ~1."""
    _, _, before = setup
    (m32, w32), (m16, w16) = runs("float32", distributed), runs("bfloat16", distributed)
    rel, worst = update_diff(w16, w32, before)
    print(f"bf16 vs fp32 ({'distopt' if distributed else 'plain'}): relative update diff {rel:.3g}, "
          f"max abs weight diff {worst:.3g}; pg_loss {m16['actor/pg_loss']:.5f} vs {m32['actor/pg_loss']:.5f}")  # fmt: skip
    assert m16["actor/skipped_updates"] == 0.0
    assert rel < 0.35
    assert worst < 2e-2
    for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
        assert abs(m16[k] - m32[k]) <= 2e-2 * max(1.0, abs(m32[k])), (k, m16[k], m32[k])


def test_gradient_clipping_clips(pool, setup):
    """clip_grad below the gradient's norm: the reported grad_norm is the unclipped global norm, and the gradient
    the optimizer used is that gradient scaled to norm clip_grad, element for element (TP2 x DP2, fp32)."""
    load_dir, batch, _ = setup
    clip = 0.05
    runs = {}
    for c in (1e9, clip):
        optim = OptimSettings(lr=1e-3, clip_grad=c)
        results = pool.run(ppo_rank_fns.ppo_update_rank, load_dir, 2, 1, batch, "actor", ACTOR_LOSS, optim, 2)
        grads = next(r["grads"] for r in results if r["grads"] is not None)
        runs[c] = results[0]["metrics"], grads
    (m_free, g_free), (m_clip, g_clip) = runs[1e9], runs[clip]
    norm = m_free["actor/grad_norm"]
    assert norm > 10 * clip  # the clip really triggers
    assert m_clip["actor/grad_norm"] == pytest.approx(norm, rel=1e-6)  # reported before clipping
    clipped_norm = math.sqrt(sum((g.norm() ** 2).item() for g in g_clip.values()))
    print(f"grad norm {norm:.4g} clipped to {clipped_norm:.6g} (clip_grad {clip})")
    assert clipped_norm == pytest.approx(clip, rel=1e-4)
    scale = clip / (norm + 1e-6)  # megatron's clip coefficient
    for k in g_free:
        assert (g_clip[k] - g_free[k] * scale).abs().max().item() <= 1e-6 * max(1.0, g_free[k].abs().max().item())
