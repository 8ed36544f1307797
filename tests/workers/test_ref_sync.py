"""TR-DPO reference sync on the ranks (`IntegratedWorker.sync_reference`, `mix_into`): after a sync every reference
parameter equals alpha * actor + (1 - alpha) * reference computed here, bit for bit in fp32 (the same operations in
the same order); alpha 1 copies the actor, alpha 0 changes nothing; the actor's weights, gradients and Adam state
are untouched; the reference stays offloaded; its weights-only save (ref/) reloads exactly. Real megatron GPTModels
at TP2 and PP2 on the shared gloo pool."""

from __future__ import annotations

import contextlib
import copy
import types

import pytest
import torch

from mindrl.checkpoint import convert
from mindrl.workers.train_setup import OptimSettings

ALPHAS = (0.5, 0.3, 1.0, 0.0)  # 0.3: 1 - alpha and alpha are not exact binary fractions


@pytest.fixture(scope="module")
def sync_ckpts(tiny_models, tmp_path_factory, get_pool) -> dict[str, str]:
    """The actor ('untied'), a reference of the same architecture with other random weights, and a tied model
    (another architecture), converted once at TP2."""
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("ref_sync")
    ref_hf = make_tiny_model(str(root / "ref_hf"), tie_word_embeddings=False, num_layers=2, seed=11)
    out = {k: str(root / k) for k in ("actor", "ref", "tied")}
    for key, hf in (("actor", tiny_models["untied"]), ("ref", ref_hf), ("tied", tiny_models["tied"])):
        convert.hf2mcore(hf, out[key], 2, 1, pool=get_pool())
    return out


def _params(model) -> dict[str, torch.Tensor]:
    from mindrl.resharding.stream import unwrap

    return {n: p.detach().clone() for n, p in unwrap(model).named_parameters()}


def sync_rank(ckpts: dict[str, str], tp: int, pp: int, save_root: str) -> dict:
    """On every rank: an actor after one Adam step, an offloaded reference; sync with each of ALPHAS through
    IntegratedWorker.sync_reference and compare with the mix computed here. Returns counts of mismatches."""
    from mindrl.checkpoint.loading import build_and_load
    from mindrl.resharding import OffloadConfig, TrainStateOffloader
    from mindrl.workers.integrated_worker import IntegratedWorker, mix_into
    from mindrl.workers.settings import ModelSettings
    from mindrl.workers.train_setup import build_model_and_optimizer, train_steps

    spec, ddp, optimizer, _ = build_model_and_optimizer(ckpts["actor"], tp, pp, OptimSettings(lr=1e-2), 4)
    train_steps(ddp, optimizer, spec.vocab_size, steps=1, seed=3)  # gradients and Adam moments exist
    ref_spec, _, ref = build_and_load(ckpts["ref"], tp, pp, "float32")
    ref.eval()
    offloader = TrainStateOffloader([ref], None, OffloadConfig(offload_train_param=True))
    offloader.offload()
    worker = types.SimpleNamespace(
        ref=ref, ref_spec=ref_spec, actor=ddp, ref_offloader=offloader,
        actor_offloader=TrainStateOffloader([ddp], optimizer), settings=types.SimpleNamespace(
            actor=ModelSettings(load=ckpts["actor"], tp=tp, pp=pp)
        ),
    )  # fmt: skip
    actor_before = _params(ddp)
    grads_before = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}
    optim_before = copy.deepcopy(optimizer.state_dict())

    out: dict = {"differs_at_start": 0, "mismatched": {}, "offloaded": True}
    offloader.onload()
    start = _params(ref)
    offloader.offload()
    out["differs_at_start"] = sum(not start[n].equal(actor_before[n]) for n in start)
    for alpha in ALPHAS:
        offloader.onload()
        before = _params(ref)
        offloader.offload()
        # TRL's order: reference * (1 - alpha), then + alpha * actor (alpha 1: a copy, alpha 0: nothing).
        expected = {n: b.clone().mul_(1.0 - alpha).add_(actor_before[n], alpha=alpha) for n, b in before.items()}
        if alpha == 1.0:
            expected = actor_before
        IntegratedWorker.sync_reference(worker, alpha)
        out["offloaded"] &= "param" in offloader.offloaded_kinds
        offloader.onload()
        after = _params(ref)
        offloader.offload()
        out["mismatched"][alpha] = sorted(n for n in after if not after[n].equal(expected[n]))
        if alpha == 0.0:
            out["alpha0_changed"] = sorted(n for n in after if not after[n].equal(before[n]))
    out["actor_changed"] = sorted(n for n, p in _params(ddp).items() if not p.equal(actor_before[n]))
    out["grads_changed"] = sorted(n for n, p in ddp.module.named_parameters() if not p.main_grad.equal(grads_before[n]))
    out["optim_changed"] = _state_differs(optim_before, optimizer.state_dict())

    # The synced reference saved as an iteration's ref/ reloads bit for bit.
    IntegratedWorker.save_reference(worker, save_root)
    _, meta, reloaded = build_and_load(save_root, tp, pp, "float32")
    offloader.onload()
    now = _params(ref)
    offloader.offload()
    out["reloaded_mismatched"] = sorted(n for n, p in _params(reloaded).items() if not p.equal(now[n]))
    out["saved_meta"] = (meta["tp"], meta["pp"], meta["dtype"], meta["role"])

    # Another architecture is refused, naming the parameters (at PP1 the tied model has no output layer).
    if pp == 1:
        _, _, tied = build_and_load(ckpts["tied"], tp, pp, "float32")
        try:
            mix_into(tied, ddp, 0.5)
            out["mismatch_error"] = None
        except ValueError as e:
            out["mismatch_error"] = str(e)
    return out


def _state_differs(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return not (isinstance(b, torch.Tensor) and a.shape == b.shape and a.equal(b))
    if isinstance(a, dict):
        return a.keys() != b.keys() or any(_state_differs(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) != len(b) or any(_state_differs(x, y) for x, y in zip(a, b))
    return a != b


@pytest.mark.parametrize("tp, pp", [pytest.param(2, 1, id="tp2"), pytest.param(1, 2, id="pp2")])
def test_sync_reference_is_the_exact_mix(pool, sync_ckpts, tmp_path, tp, pp):
    from mindrl.checkpoint.resume import check_reference

    results = pool.run(sync_rank, sync_ckpts, tp, pp, str(tmp_path / "ref"))
    for rank, r in enumerate(results):
        assert r["differs_at_start"] > 0, rank  # the reference really differs from the actor
        assert r["mismatched"] == {a: [] for a in ALPHAS}, (rank, r["mismatched"])
        assert r["alpha0_changed"] == [], rank
        assert r["offloaded"], rank
        assert r["actor_changed"] == [] and r["grads_changed"] == [] and not r["optim_changed"], (rank, r)
        assert r["reloaded_mismatched"] == [], rank
        assert r["saved_meta"] == (tp, pp, "float32", "actor")
        if pp == 1:
            assert r["mismatch_error"] and "different networks" in r["mismatch_error"], r["mismatch_error"]
            assert "output_layer.weight" in r["mismatch_error"]
    check_reference(str(tmp_path / "ref"))  # what a resume checks: complete, loadable


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float32])
def test_bf16_mix_is_computed_in_fp32_and_rounded_once(source_dtype):
    """bf16 reference weights: the mix is computed in fp32 from the exact bf16 values and rounded to bf16 once,
    equal to that direct computation bit for bit, and (for alpha 0.3) not what mixing in bf16 arithmetic gives."""
    from mindrl.workers.integrated_worker import mix_into

    gen = torch.Generator().manual_seed(0)
    ref = torch.nn.Linear(64, 64).to(torch.bfloat16)
    actor = torch.nn.Linear(64, 64).to(source_dtype)
    with torch.no_grad():
        for module in (ref, actor):
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    src = dict(actor.named_parameters())
    alpha = 0.3
    mix_into(ref, actor, alpha)
    for n, p in ref.named_parameters():
        assert p.dtype == torch.bfloat16
        # TRL's operation order, as the fp32 test above (add with alpha rounds differently from a separate product)
        exact = before[n].float().mul(1.0 - alpha).add(src[n].detach().float(), alpha=alpha).to(torch.bfloat16)
        assert p.equal(exact), n
        in_bf16 = before[n].mul(1.0 - alpha).add(src[n].detach().to(torch.bfloat16), alpha=alpha)
        assert not p.equal(in_bf16), n  # two roundings differ somewhere: the test can tell the two paths apart


def test_holding_onloads_only_for_the_block_and_place_leaves_exactly_the_kinds():
    """`TrainStateOffloader.holding`: an offloaded model's parameters are back (bit-identical) inside the block and
    offloaded again after it, also when the block raises; what was on the device already stays there. `place`:
    exactly the kinds named are on the device after it, whatever was there before."""
    from mindrl.resharding import OffloadConfig, TrainStateOffloader

    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    before = [p.detach().clone() for p in model.parameters()]
    offloader = TrainStateOffloader([model], optimizer, OffloadConfig(offload_train_param=True))
    sizes = offloader.device_bytes()
    assert all(sizes.values())  # params, grads and Adam's moments are all on the device
    for resident in (False, True):
        offloader.place(["param"] if resident else [])
        for fail in (False, True):
            with pytest.raises(RuntimeError, match="inside") if fail else contextlib.nullcontext():
                with offloader.holding(["param"]):
                    assert offloader.device_bytes()["param"] > 0
                    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
                    if fail:
                        raise RuntimeError("inside")
            assert (offloader.device_bytes()["param"] > 0) == resident
    for on in ([], ["grad"], ["param", "optimizer"], ["param", "grad", "optimizer"], ["optimizer"]):
        offloader.place(on)
        assert offloader.device_bytes() == {k: sizes[k] if k in on else 0 for k in sizes}, on
    offloader.place(["param", "grad", "optimizer"])
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
