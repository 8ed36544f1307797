"""Activation recomputation changes no number: one PPO update of the actor (policy loss through the logits) and of
the critic (value head) with each recompute mode gives the loss and every parameter's gradient of the same update
without it, fp32 on CPU within the issue's 1e-6 (relative), at TP1, TP2+SP, PP2 and TP2xPP2; prompts shared by
two samples each, so core attention runs on packed prefix groups (and must find their layout when run again)."""

from __future__ import annotations

import pytest
import torch

from mindrl.checkpoint import convert
from mindrl.config.settings import RecomputeSettings
from mindrl.workers.rl_model import PPOLossSettings
from mindrl.workers.train_setup import OptimSettings
from tests.workers.ppo_rank_fns import dp_forward
from tests.workers.test_ppo_update import ACTOR_LOSS, CRITIC_LOSS, make_batch

LAYERS = 4
TOLERANCE = 1e-6  # issue 44's bound: recomputation must not change the update
LAYOUTS = [  # tp, pp, sequence parallel
    pytest.param(1, 1, False, id="tp1"),
    pytest.param(2, 1, True, id="tp2sp"),
    pytest.param(1, 2, False, id="pp2"),
    pytest.param(2, 2, True, id="tp2pp2sp"),
]


def modes(layers_per_stage: int) -> dict[str, RecomputeSettings]:
    half = layers_per_stage // 2
    return {
        "full-uniform": RecomputeSettings("full", "uniform", half),  # two chunks of `half` layers per stage
        "full-block": RecomputeSettings("full", "block", half),  # the stage's first half recomputed, the rest kept
        "selective": RecomputeSettings("selective"),
        "activation": RecomputeSettings(recompute_activation_function=True),
    }


def _count_recomputation(counts: dict[str, int]):
    """Patches that count megatron's recomputations (checkpointed layers or core attention, released activation
    outputs rebuilt) and the core attention calls that found the packed layout (all: every micro-batch here is
    packed prefix groups, also when recomputed); undo with the returned function."""
    from megatron.core.tensor_parallel import random as mrandom

    from mindrl.models.attention import SDPAttention, prefix_groups_of

    backward, recompute = mrandom.CheckpointFunction.__dict__["backward"], mrandom.CheckpointWithoutOutput._recompute
    attention = SDPAttention.forward

    def counted_attention(self, query, key, value, attention_mask, *args, **kwargs):
        counts["attention"] += 1
        counts["packed"] += prefix_groups_of(attention_mask) is not None
        return attention(self, query, key, value, attention_mask, *args, **kwargs)

    def counted_backward(ctx, *args):
        counts["checkpoint"] += 1
        return backward.__func__(ctx, *args)

    def counted_recompute(self, grad):
        counts["activation"] += 1
        return recompute(self, grad)

    mrandom.CheckpointFunction.backward = staticmethod(counted_backward)
    mrandom.CheckpointWithoutOutput._recompute = counted_recompute
    SDPAttention.forward = counted_attention

    def undo():
        mrandom.CheckpointFunction.backward = backward
        mrandom.CheckpointWithoutOutput._recompute = recompute
        SDPAttention.forward = attention

    return undo


def _update_rank(load_dir: str, tp: int, pp: int, sp: bool, batch, role: str, loss: PPOLossSettings, mbs: int):
    """The same ppo_update without recomputation and with each mode, each from the loaded weights: per mode the
    largest relative gap of a reported loss and of a parameter's gradient (this rank's shard, ||g - g0|| / ||g0||),
    how many recomputations ran, and whether the forward-only pass (logprobs / values) was unchanged."""
    from mindrl.workers import rl_model
    from mindrl.workers.train_setup import build_model_and_optimizer

    optim = OptimSettings(lr=1e-3, clip_grad=1e9)

    def run(recompute: RecomputeSettings | None):
        counts = {"checkpoint": 0, "activation": 0, "attention": 0, "packed": 0}
        undo = _count_recomputation(counts)
        try:
            _, ddp, optimizer, scheduler = build_model_and_optimizer(
                load_dir, tp, pp, optim, 1, sequence_parallel=sp, recompute=recompute
            )
            shard, forward = dp_forward(ddp, batch, role, mbs, loss.temperature)
            result = rl_model.ppo_update(ddp, optimizer, scheduler, shard, role, loss, mbs, 1, 1)
        finally:
            undo()
        grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
        losses = {k: v for k, v in result.metrics.items() if k.endswith("_loss")}
        return losses, grads, forward, counts

    base_losses, base_grads, base_forward, base_counts = run(None)
    assert base_counts["checkpoint"] == base_counts["activation"] == 0, base_counts
    assert base_losses and all(abs(v) > 1e-3 for v in base_losses.values()), base_losses
    out = {"none": (0.0, 0.0, base_counts, True)}
    for name, recompute in modes(LAYERS // pp).items():
        losses, grads, forward, counts = run(recompute)
        loss_gap = max(abs(losses[k] - v) / abs(v) for k, v in base_losses.items())
        grad_gap = max(((grads[n] - g).norm() / g.norm()).item() for n, g in base_grads.items() if g.norm() > 0)
        same_forward = forward is None or torch.equal(forward, base_forward)
        out[name] = (loss_gap, grad_gap, counts, same_forward)
    return out


@pytest.fixture(scope="module")
def recompute_ckpts(tmp_path_factory, get_pool) -> dict[str, str]:
    """A 4-layer actor and critic (two layers per PP stage, so block and uniform differ), their mcore checkpoints
    and a batch of 4 prompts x 2 samples."""
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("recompute")
    hf = {
        "actor": make_tiny_model(str(root / "hf_actor"), num_layers=LAYERS, seed=41),
        "critic": make_tiny_model(str(root / "hf_critic"), num_layers=LAYERS, seed=42, orm=True),
    }
    out = {}
    for role, hf_dir in hf.items():
        out[role] = str(root / role)
        convert.hf2mcore(hf_dir, out[role], 1, 1, orm=role == "critic", pool=get_pool())
    out["batch"] = make_batch(hf["actor"], hf["critic"], prompt_lens=[6, 3, 5, 2], samples=2)
    return out


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("tp,pp,sp", LAYOUTS)
def test_recomputation_keeps_the_update(pool, recompute_ckpts, role, tp, pp, sp):
    loss = ACTOR_LOSS if role == "actor" else CRITIC_LOSS
    results = pool.run(_update_rank, recompute_ckpts[role], tp, pp, sp, recompute_ckpts["batch"], role, loss, 2)
    base = results[0]["none"][2]
    assert base["attention"] == base["packed"] > 0, base
    for name in modes(LAYERS // pp):
        loss_gap = max(r[name][0] for r in results)
        grad_gap = max(r[name][1] for r in results)
        counts = results[0][name][2]
        print(f"{role} tp{tp} pp{pp} sp{int(sp)} {name}: loss rel gap {loss_gap:.2g}, grad rel gap {grad_gap:.2g}, "
              f"recomputed {counts}")  # fmt: skip
        assert all(r[name][3] for r in results), f"{name}: the forward-only pass changed"
        assert counts["checkpoint" if name != "activation" else "activation"] > 0, (name, counts)
        # core attention run again (full, selective) found the packed layout on the checkpoint's detached mask
        assert counts["attention"] == counts["packed"], (name, counts)
        assert (counts["attention"] > base["attention"]) == (name != "activation"), (name, counts, base)
        assert loss_gap <= TOLERANCE, (name, loss_gap)
        assert grad_gap <= TOLERANCE, (name, grad_gap)
