"""Exact resume with megatron's distributed optimizer (issue 10): N optimizer steps straight equal N/2 steps, a
save_train_state, a fresh model + optimizer built from that checkpoint, load_train_state and N/2 more steps, bit
for bit (weights, fp32 main params, Adam moments, and each parameter's own Adam step), at TP2 x DP2 on gloo; and
onto another TP x DP (megatron's model-space `fully_reshardable` layout), equal to the straight run there.

Without mindrl's handling the save fails outright (megatron's default layout raises "ShardedTensor.flattened_range
is not supported" on CPU), and the load gives every parameter one shared `step` tensor holding the stale pre-load
step, so every later Adam bias correction is wrong."""

from __future__ import annotations

import pytest
import torch

import tests.conftest as conftest
from mindrl.checkpoint import convert
from mindrl.checkpoint.hf_io import CheckpointError
from mindrl.launch import RankPool
from mindrl.platform.detect import current_platform
from mindrl.workers.train_setup import OptimSettings
from tests.workers import distopt_rank_fns

STEPS = 4
DISTOPT = OptimSettings(lr=1e-3, clip_grad=1.0, weight_decay=0.01, use_distributed_optimizer=True)


@pytest.fixture(scope="module")
def actor_ckpt(tiny_models, tmp_path_factory) -> str:
    """The tiny actor converted at TP2 (module fixtures run before `pool`: start the shared pool as conftest does)."""
    if conftest._POOL is None or conftest._POOL.closed:
        conftest._POOL = RankPool(4, timeout_s=600)
    out = str(tmp_path_factory.mktemp("distopt") / "actor")
    convert.hf2mcore(tiny_models["untied"], out, 2, 1, pool=conftest._POOL)
    return out


def compare_runs(straight: list[dict], resumed: list[dict]) -> dict[str, float]:
    """Max abs differences between two runs' per-rank results, by kind."""
    diff = {"loss": 0.0, "weights": 0.0, "param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    for a, b in zip(straight, resumed):
        diff["loss"] = max(diff["loss"], max(abs(x - y) for x, y in zip(a["losses"], b["losses"])))
        assert a["weights"].keys() == b["weights"].keys()
        for k in a["weights"]:
            diff["weights"] = max(diff["weights"], (a["weights"][k] - b["weights"][k]).abs().max().item())
        assert len(a["optim"]) == len(b["optim"]) > 0
        for x, y in zip(a["optim"], b["optim"]):
            assert x.keys() == y.keys() == {"param", "step", "exp_avg", "exp_avg_sq"}
            for k in ("param", "exp_avg", "exp_avg_sq"):
                diff[k] = max(diff[k], (x[k].float() - y[k].float()).abs().max().item())
    return diff


@pytest.mark.parametrize("dtype,fmt", [("float32", None), ("bfloat16", None), ("float32", "dp_reshardable")])
def test_distributed_optimizer_resumes_bit_exactly(pool, actor_ckpt, tmp_path, dtype, fmt):
    """Today's model-space layout, and the older dp_reshardable one (checkpoints saved before) at its own TP."""
    straight = pool.run(distopt_rank_fns.train_straight, actor_ckpt, 2, DISTOPT, dtype, STEPS, 0)
    resumed = pool.run(
        distopt_rank_fns.train_resumed, actor_ckpt, 2, DISTOPT, dtype, STEPS, 0, str(tmp_path / "ck"), fmt
    )
    diff = compare_runs(straight, resumed)
    print(f"{dtype}: straight vs resumed max abs diffs {diff}")
    assert all(v == 0.0 for v in diff.values()), diff
    moved = straight[0]["losses"][0] - straight[0]["losses"][-1]
    assert moved != 0.0  # the steps really trained
    for r in resumed:
        # every parameter has taken exactly STEPS Adam steps, each counted on its own tensor
        assert {e["step"].item() for e in r["optim"]} == {float(STEPS)}
        assert r["shared_steps"] == 0
    # torch's fused Adam where the platform asks for it, on both runs: the resumed one loaded param groups saved
    # with the loop's flags, and the loop's last bits differ from the fused kernel's (the bit-exact check above)
    if current_platform().fused_adam:
        assert {f for r in straight + resumed for f in r["fused"]} == {True}
    # really distributed: a rank's optimizer holds about half of its TP shard of the model (DP = 2), in fp32
    held = sum(e["param"].numel() for e in straight[0]["optim"])
    tp_shard = sum(t.numel() for t in straight[0]["weights"].values()) / 2
    assert 0.4 * tp_shard < held < 0.6 * tp_shard, (held, tp_shard)
    assert all(e["param"].dtype == torch.float32 for e in straight[0]["optim"])


def _resume_elsewhere(load_dir: str, it_dir: str, optim: OptimSettings, tp: int) -> str:
    """Build at TP `tp` from load_dir with `optim` and try to load it_dir's optimizer: the error message."""
    from mindrl.checkpoint.train_state import load_train_state
    from mindrl.workers.train_setup import build_model_and_optimizer

    _, ddp, optimizer, scheduler = build_model_and_optimizer(load_dir, tp, 1, optim, total_steps=STEPS)
    try:
        load_train_state(ddp, optimizer, scheduler, it_dir, optim=True, rng=False)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def _merged(results: list[dict], key: str) -> dict:
    """Union over ranks of an HF-named dict (each pipeline stage reports its own parameters)."""
    out = {}
    for r in results:
        for k, v in r[key].items():
            out[k] = v
    return out


def _loss_gap(a: list[dict], b: list[dict]) -> float:
    return max(abs(x - y) for x, y in zip(a[0]["losses"], b[0]["losses"]))


def _weight_gap(a: list[dict], b: list[dict]) -> float:
    wa, wb = _merged(a, "weights"), _merged(b, "weights")
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.mark.parametrize("save_at,load_at", [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 2), (2, 1))])
def test_distributed_optimizer_resumes_onto_another_layout(pool, actor_ckpt, tmp_path, save_at, load_at):
    """Saved at one TP x PP x DP, resumed at another: the model-space optimizer state reshards. Proven directly:
    every parameter's fp32 main param, exp_avg, exp_avg_sq and step, gathered to full HF-named tensors, are equal
    bit for bit just before the save (at the old layout) and just after the load (at the new one). Its first half is
    the straight run at the old layout, bit for bit. The run then continues as the straight run at the new layout
    does, within the two layouts' own gap: the straight runs at the old and the new layout differ only by their
    reduction order, measured here on this CPU's kernels; the resumed run took half its steps at each, so it may
    not stray further from the new layout's straight run than twice that gap (the factor: headroom for the max
    norm over single elements, whose Adam steps jump when a tiny gradient's rounding differs)."""
    import os

    straight = pool.run(distopt_rank_fns.train_straight, actor_ckpt, load_at[0], DISTOPT, "float32", STEPS, 0,
                        load_at[1])  # fmt: skip
    old_layout = pool.run(distopt_rank_fns.train_straight, actor_ckpt, save_at[0], DISTOPT, "float32", STEPS, 0,
                          save_at[1])  # fmt: skip
    resumed = pool.run(
        distopt_rank_fns.train_resumed_elsewhere, actor_ckpt, save_at, load_at, DISTOPT, STEPS, 0, str(tmp_path / "ck")
    )
    worst = {}
    for kind in ("param", "exp_avg", "exp_avg_sq", "step"):
        saved, loaded = (
            _merged([r["saved_state"] for r in resumed], kind),
            _merged([r["loaded_state"] for r in resumed], kind),
        )
        assert saved.keys() == loaded.keys() and saved, kind
        worst[kind] = max((saved[k] - loaded[k]).abs().max().item() for k in saved)
        assert all(saved[k].equal(loaded[k]) for k in saved), (kind, worst[kind])
        if kind == "step":
            assert {v.unique().item() for v in saved.values()} == {float(STEPS // 2)}
    half = STEPS // 2
    assert resumed[0]["losses"][:half] == old_layout[0]["losses"][:half]  # the first half ran at the old layout
    loss = _loss_gap(straight, resumed)
    weights = _weight_gap(straight, resumed)
    layouts_loss, layouts_weights = _loss_gap(straight, old_layout), _weight_gap(straight, old_layout)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "ck") for f in fs)
    print(
        f"TPxPP {save_at}->{load_at}: optimizer state after the load vs before the save {worst}; continued run vs "
        f"straight: loss diff {loss:.3g}, weight diff {weights:.3g} (the layouts' straight runs: {layouts_loss:.3g}, "
        f"{layouts_weights:.3g}); save {max(r['save_s'] for r in resumed):.2f} s, "
        f"load {max(r['load_s'] for r in resumed):.2f} s, {size / 1e6:.1f} MB"
    )
    assert layouts_weights > 0.0  # really two reduction orders: the bound below is not vacuous
    # a loss is one fp32 sum: where the layouts' losses happen to round alike, a few of its own ulps still apart
    ulps = 4 * torch.finfo(torch.float32).eps * max(abs(x) for x in straight[0]["losses"])
    assert loss <= max(2 * layouts_loss, ulps), (loss, layouts_loss, ulps)
    assert weights <= 2 * layouts_weights, (weights, layouts_weights)
    assert {e["step"].item() for r in resumed for e in r["optim"]} == {float(STEPS)}
    assert all(r["shared_steps"] == 0 for r in resumed)


def test_mismatched_optimizer_layouts_are_refused(pool, actor_ckpt, tmp_path):
    """A distributed-optimizer checkpoint cannot feed the plain optimizer, and one in the older dp_reshardable
    layout cannot load at another TP: clear errors that name the optim dir and the way out (no_load_optim)."""
    from mindrl.checkpoint.mcore_ckpt import iteration_dir

    root = str(tmp_path / "ck")
    pool.run(distopt_rank_fns.train_resumed, actor_ckpt, 2, DISTOPT, "float32", 2, 0, root)
    it_dir = iteration_dir(root, 1)
    plain = OptimSettings(lr=1e-3, clip_grad=1.0, weight_decay=0.01)
    msgs = pool.run(_resume_elsewhere, root, it_dir, plain, 2)
    assert "saved with use_distributed_optimizer: true, this run has use_distributed_optimizer: false" in msgs[0]
    assert f"{it_dir}/optim" in msgs[0] and "no_load_optim: true" in msgs[0]
    legacy = str(tmp_path / "legacy")
    pool.run(distopt_rank_fns.train_resumed, actor_ckpt, 2, DISTOPT, "float32", 2, 0, legacy, "dp_reshardable")
    msgs = pool.run(_resume_elsewhere, legacy, iteration_dir(legacy, 1), DISTOPT, 1)
    assert "saved at TP=2 PP=1" in msgs[0] and "this run has TP=1 PP=1" in msgs[0], msgs[0]
