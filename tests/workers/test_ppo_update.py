"""The actor's and the critic's PPO update (`ppo_update`) are numerically right: the reported losses and the
gradients equal a plain PyTorch + transformers implementation of the PPO equations written here (not
`mindrl.algorithms`), at TP1 / TP2 / PP2 / TP2xPP2; and the update does not depend on the DP size, on the
micro-batch split, or (on-policy) report a ratio other than 1. fp32 on CPU, gloo ranks."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch

from mindrl.batch import Batch, pad_rows
from mindrl.checkpoint import convert
from mindrl.checkpoint.hf_io import HFCheckpoint
from mindrl.launch import RankPool
from mindrl.workers.rl_model import PPOLossSettings
from mindrl.workers.train_setup import OptimSettings
from tests.workers import ppo_rank_fns

# Eight rows: prompts of different lengths (left-padded to P = 8), responses of different lengths
# (right-padded to R = 10), so every micro-batch and DP shard holds a different number of valid tokens.
PROMPT_LENS = [3, 8, 5, 1, 7, 4, 6, 2]
RESPONSE_LENS = [10, 4, 7, 1, 9, 6, 3, 8]
ROWS = len(PROMPT_LENS)
VOCAB = 1024
ACTOR_LOSS = PPOLossSettings(
    clip_ratio_low=0.2,
    clip_ratio_high=0.28,
    entropy_coeff=0.05,
    kl_loss_coef=0.1,
    kl_loss_type="low_var_kl",
    loss_agg_mode="token-mean",
    temperature=0.7,
)
CRITIC_LOSS = PPOLossSettings(cliprange_value=0.2, loss_agg_mode="token-mean")
# clip_grad far above any norm: megatron still computes the norm (checked) but never scales the gradient.
NO_CLIP = OptimSettings(lr=1e-3, clip_grad=1e9)
LAYOUTS = [
    pytest.param(1, 1, id="tp1"),
    pytest.param(2, 1, id="tp2"),
    pytest.param(1, 2, id="pp2"),
    pytest.param(2, 2, id="tp2pp2"),
]
POOL_WORLD = 4


# ---------------------------------------------------------------------------------------------- reference
def hf_model(hf_dir: str, critic: bool):
    import transformers

    cls = transformers.AutoModelForSequenceClassification if critic else transformers.AutoModelForCausalLM
    return cls.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


def hf_response_outputs(model, batch: Batch, critic: bool) -> torch.Tensor:
    """(rows, R, vocab) logits or (rows, R) values at the outputs that predict the response tokens.

    Positions count real tokens only; a query sees the real keys at or before it (and itself, so that a
    padding query is not empty): the megatron mask, built here independently."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    s = ids.shape[1]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    allowed = torch.ones(s, s, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
    allowed = allowed | torch.eye(s, dtype=torch.bool)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    hidden = model.model(input_ids=ids, attention_mask=additive, position_ids=position_ids).last_hidden_state
    p, r = batch.meta["prompt_length"], batch["responses"].shape[1]
    hidden = hidden[:, p - 1 : p - 1 + r]
    return model.score(hidden).squeeze(-1) if critic else model.lm_head(hidden)


def token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum()


def reference_actor(hf_dir: str, batch: Batch, s: PPOLossSettings) -> tuple[dict, dict]:
    """PPO actor loss: clipped surrogate - entropy_coeff * entropy + kl_coef * k3 KL, each a token mean over
    the whole batch. Returns (metrics, HF-named gradients)."""
    model = hf_model(hf_dir, critic=False)
    mask = batch["response_mask"].float()
    logits = hf_response_outputs(model, batch, critic=False) / s.temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    log_prob = log_probs.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    adv, old, ref = batch["advantages"], batch["old_log_prob"], batch["ref_log_prob"]
    ratio = torch.exp(log_prob - old)
    surrogate = -adv * ratio
    clipped = -adv * ratio.clamp(1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
    pg_loss = token_mean(torch.maximum(surrogate, clipped), mask)
    kl = torch.exp(ref - log_prob) - (ref - log_prob) - 1
    ent, kl_loss = token_mean(entropy, mask), token_mean(kl, mask)
    loss = pg_loss - s.entropy_coeff * ent + s.kl_loss_coef * kl_loss
    loss.backward()
    metrics = {
        "actor/pg_loss": pg_loss.item(),
        "actor/entropy": ent.item(),
        "actor/kl_loss": kl_loss.item(),
        "actor/pg_clipfrac": token_mean((clipped > surrogate).float(), mask).item(),
        "actor/ppo_kl": token_mean(old - log_prob, mask).item(),
    }
    return metrics, {n: p.grad.clone() for n, p in model.named_parameters()}


def reference_critic(hf_dir: str, batch: Batch, s: PPOLossSettings) -> tuple[dict, dict]:
    """Clipped value loss 0.5 * max((v - R)^2, (V + clip(v - V, -c, c) - R)^2), token mean."""
    model = hf_model(hf_dir, critic=True)
    mask = batch["response_mask"].float()
    v = hf_response_outputs(model, batch, critic=True)
    old, returns, c = batch["values"], batch["returns"], s.cliprange_value
    unclipped = (v - returns) ** 2
    clipped = (torch.clamp(v, old - c, old + c) - returns) ** 2
    vf_loss = 0.5 * token_mean(torch.maximum(unclipped, clipped), mask)
    vf_loss.backward()
    metrics = {
        "critic/vf_loss": vf_loss.item(),
        "critic/vf_clipfrac": token_mean((clipped > unclipped).float(), mask).item(),
    }
    return metrics, {n: p.grad.clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------- fixtures
def make_batch(
    actor_dir: str, critic_dir: str, prompt_lens=PROMPT_LENS, samples: int = 1, response_lens=RESPONSE_LENS
) -> Batch:
    """An RL batch in the trainer's layout with every key the actor and critic updates read. The old and
    rollout logprobs are the current policy's plus noise (the ratio is not 1 and some tokens clip), the
    reference logprobs another perturbation; the old values are the current critic's plus noise. samples > 1:
    each prompt's row `samples` times in a row (a GRPO group), with different responses."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in prompt_lens for _ in range(samples)]
    prompts = [prompts[i // samples * samples] for i in range(len(prompts))]
    responses = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in response_lens]
    prompt_ids, prompt_mask = pad_rows(prompts, pad=0, left=True)
    response_ids, response_mask = pad_rows(responses, pad=0, left=False)
    batch = Batch(
        {
            "input_ids": torch.cat([prompt_ids, response_ids], 1),
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "responses": response_ids,
            "response_mask": response_mask,
        },
        meta={"prompt_length": prompt_ids.shape[1]},
        group_size=samples,
    )
    mask = response_mask.float()
    with torch.no_grad():
        logits = hf_response_outputs(hf_model(actor_dir, critic=False), batch, critic=False)
        values = hf_response_outputs(hf_model(critic_dir, critic=True), batch, critic=True)
    lp = torch.log_softmax(logits / ACTOR_LOSS.temperature, -1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)

    def noise(scale: float) -> torch.Tensor:
        return scale * torch.randn(response_ids.shape, generator=g)

    batch.update(
        {
            "old_log_prob": (lp + noise(0.3)) * mask,
            "rollout_log_prob": (lp + noise(0.3)) * mask,
            "ref_log_prob": (lp + noise(0.5)) * mask,
            "advantages": noise(1.0) * mask,
            "values": (values + noise(0.3)) * mask,
            "returns": (values + noise(1.0)) * mask,
        }
    )
    return batch


@pytest.fixture(scope="module")
def ckpts(tiny_models, tmp_path_factory, get_pool) -> dict[str, str]:
    """The actor ('untied') and the critic ('orm', --orm) converted once at TP2; every layout loads them
    (dist-ckpt reshards) on the shared pool (`get_pool`: module fixtures cannot use the function-scoped `pool`)."""
    root = tmp_path_factory.mktemp("ppo_ckpts")
    out = {"actor": str(root / "actor"), "critic": str(root / "critic")}
    convert.hf2mcore(tiny_models["untied"], out["actor"], 2, 1, pool=get_pool())
    convert.hf2mcore(tiny_models["orm"], out["critic"], 2, 1, orm=True, pool=get_pool())
    return out


@pytest.fixture(scope="module")
def rl_batch(tiny_models) -> Batch:
    return make_batch(tiny_models["untied"], tiny_models["orm"])


@pytest.fixture(scope="module")
def grouped_batch(tiny_models) -> Batch:
    """Two prompts (6 and 3 tokens, left-padded to 6) with 4 samples each, responses of 1 to 10 tokens (the plain
    path's width 16 splits over TP2's sequence parallelism)."""
    return make_batch(tiny_models["untied"], tiny_models["orm"], prompt_lens=[6, 3], samples=4)


@pytest.fixture(scope="module")
def references(tiny_models, rl_batch) -> dict[str, tuple[dict, dict]]:
    return {
        "actor": reference_actor(tiny_models["untied"], rl_batch, ACTOR_LOSS),
        "critic": reference_critic(tiny_models["orm"], rl_batch, CRITIC_LOSS),
    }


@pytest.fixture(scope="module")
def small_pools():
    """1- and 2-rank pools: DP1 and DP2 at TP1 (the shared pool's 4 ranks are DP4 at TP1)."""
    with RankPool(1, timeout_s=600) as one, RankPool(2, timeout_s=600) as two:
        yield {1: one, 2: two}


@pytest.fixture(scope="module")
def updates(ckpts, rl_batch):
    """updates(pool, role, tp, pp): one ppo_update of the batch at TP x PP with 2 micro-batches per DP rank,
    memoised (the reference tests and the grad-norm test share each run)."""
    done = {}

    def get(pool, role: str, tp: int, pp: int):
        if (role, tp, pp) not in done:
            loss = ACTOR_LOSS if role == "actor" else CRITIC_LOSS
            mbs = micro_batch_size(tp, pp, 2)
            done[role, tp, pp] = run_update(pool, ckpts[role], tp, pp, rl_batch, role, loss, mbs)
        return done[role, tp, pp]

    return get


# ---------------------------------------------------------------------------------------------- helpers
def run_update(
    pool, load_dir, tp, pp, batch, role, loss, micro_batch_size, optim=NO_CLIP, mini=1, weights=False, skipped=0
):
    """(metrics, HF-named gradients, HF-named weights or None) of one ppo_update on `pool`; the metrics
    must be the same on every rank, and `skipped` updates must have been skipped."""
    results = pool.run(
        ppo_rank_fns.ppo_update_rank, load_dir, tp, pp, batch, role, loss, optim, micro_batch_size, mini, weights
    )

    def comparable(m: dict) -> dict:  # NaN (e.g. the grad norm of a skipped step) equals NaN here
        return {k: ("nan" if v != v else v) for k, v in m.items()}

    metrics = results[0]["metrics"]
    for rank, r in enumerate(results):
        assert comparable(r["metrics"]) == comparable(metrics), f"rank {rank} reports other metrics"
    assert metrics[f"{role}/skipped_updates"] == float(skipped)
    grads, after = {}, {}
    for r in results:  # one entry per pipeline stage
        if r["grads"] is not None:
            grads.update(r["grads"])
            after.update(r["weights"] or {})
    return metrics, grads, (after or None)


def rel_diffs(got: dict, want: dict) -> dict[str, float]:
    """Per tensor ||got - want|| / ||want||, plus "_all" over all tensors together."""
    assert sorted(got) == sorted(want)
    out = {k: ((got[k] - want[k]).norm() / want[k].norm()).item() for k in want}
    num = math.sqrt(sum(((got[k] - want[k]).norm() ** 2).item() for k in want))
    out["_all"] = num / global_norm(want)
    return out


def global_norm(tensors: dict) -> float:
    return math.sqrt(sum((t.norm() ** 2).item() for t in tensors.values()))


def micro_batch_size(tp: int, pp: int, micro_batches: int) -> int:
    """The micro-batch size that cuts each DP rank's shard of the batch into `micro_batches`."""
    dp = POOL_WORLD // (tp * pp)
    return ROWS // dp // micro_batches


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_actor_update_matches_reference(pool, updates, references, tp, pp):
    """Off-policy ratios (some clipped, DAPO clip-higher), k3 KL loss, entropy bonus, temperature 0.7, token
    mean, 2 micro-batches per DP rank: losses within 1e-5 and gradients within 1e-4 of the reference."""
    want, want_grads = references["actor"]
    assert 0.05 < want["actor/pg_clipfrac"] < 0.95  # the clip is active on some tokens, not all
    metrics, grads, _ = updates(pool, "actor", tp, pp)
    for k, v in want.items():
        assert abs(metrics[k] - v) <= 1e-5, f"{k}: {metrics[k]} vs reference {v}"
    diffs = rel_diffs(grads, want_grads)
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_critic_update_matches_reference(pool, updates, references, tp, pp):
    """Value head on every position, clipped value loss (some tokens clipped), token mean, 2 micro-batches
    per DP rank: vf_loss within 1e-5 and gradients within 1e-4 of the reference."""
    want, want_grads = references["critic"]
    assert 0.05 < want["critic/vf_clipfrac"] < 0.95
    metrics, grads, _ = updates(pool, "critic", tp, pp)
    for k, v in want.items():
        assert abs(metrics[k] - v) <= 1e-5, f"{k}: {metrics[k]} vs reference {v}"
    diffs = rel_diffs(grads, want_grads)
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize(
    "tp,pp",
    [
        pytest.param(1, 1, id="tp1"),
        pytest.param(2, 1, id="tp2"),
        pytest.param(1, 2, id="pp2"),
        pytest.param(2, 2, id="tp2pp2"),
    ],
)
def test_reported_grad_norm_is_the_global_norm(pool, updates, references, role, tp, pp):
    """<role>/grad_norm (the norm the clip uses) is the norm of the whole model's gradient, every TP shard
    counted once (megatron marks TP-sharded weights only when it initialises them: a model built for loading
    must be marked by mindrl.models.builder, or the norm drops the TP rank > 0 shards)."""
    metrics, _, _ = updates(pool, role, tp, pp)
    assert metrics[f"{role}/grad_norm"] == pytest.approx(global_norm(references[role][1]), rel=1e-5)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_update_is_dp_invariant(pool, tiny_models, ckpts, rl_batch, small_pools, role):
    """The same global batch (2 mini-batches, cut with shard_rows as the driver does) at DP1 and DP2 (TP1):
    the same weights after the update and the same metrics, within 1e-5. Gradient clipping is on, so the
    global norm must agree too."""
    loss = ACTOR_LOSS if role == "actor" else CRITIC_LOSS
    # A large adam_eps bounds how much Adam's g / sqrt(v) can amplify rounding in a near-zero gradient.
    optim = OptimSettings(lr=1e-3, clip_grad=1.0, adam_eps=1e-6)
    runs = {
        dp: run_update(small_pools[dp], ckpts[role], 1, 1, rl_batch, role, loss, 1, optim, mini=2, weights=True)
        for dp in (1, 2)
    }
    (m1, _, w1), (m2, _, w2) = runs[1], runs[2]
    before = HFCheckpoint(tiny_models["untied" if role == "actor" else "orm"])
    moved = max((w1[k] - before.get(k)).abs().max().item() for k in w1)
    assert moved > 1e-4  # the update is not trivially small
    assert sorted(w1) == sorted(w2)
    weight_diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert weight_diff < 1e-5, weight_diff
    assert sorted(m1) == sorted(m2)
    for k in m1:
        if k == "_tokens":
            assert m1[k] == m2[k]
        elif k == "_logprob_diff":
            assert m1[k][1] == m2[k][1] and abs(m1[k][0] - m2[k][0]) < 1e-4 and abs(m1[k][2] - m2[k][2]) < 1e-5
        else:
            assert abs(m1[k] - m2[k]) < 1e-5, (k, m1[k], m2[k])


def test_on_policy_update_has_ratio_one(pool, ckpts, rl_batch):
    """Without old_log_prob (the trainer's on-policy mode: one mini-batch, one epoch) the ratio is exactly 1:
    no token clips, the k1 KL is exactly 0, and the surrogate is -mean(advantages)."""
    batch = rl_batch.select([k for k in rl_batch.tensors if k != "old_log_prob"])
    metrics, _, _ = run_update(pool, ckpts["actor"], 2, 1, batch, "actor", ACTOR_LOSS, micro_batch_size(2, 1, 2))
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/ppo_kl"] == 0.0
    mask = batch["response_mask"].float()
    assert metrics["actor/pg_loss"] == pytest.approx(-token_mean(batch["advantages"], mask).item(), abs=1e-6)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_update_is_micro_batch_invariant(pool, ckpts, rl_batch, role):
    """1 vs 4 micro-batches per DP rank (TP2, DP2): the same gradient within 1e-5 (the loss is normalised
    by the mini-batch's global token count, not per micro-batch)."""
    loss = ACTOR_LOSS if role == "actor" else CRITIC_LOSS
    m1, g1, _ = run_update(pool, ckpts[role], 2, 1, rl_batch, role, loss, micro_batch_size(2, 1, 1))
    m4, g4, _ = run_update(pool, ckpts[role], 2, 1, rl_batch, role, loss, micro_batch_size(2, 1, 4))
    diffs = rel_diffs(g4, g1)
    assert max(diffs.values()) < 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    for k in m1:
        if not k.startswith("_"):
            assert abs(m1[k] - m4[k]) < 1e-5, (k, m1[k], m4[k])


@pytest.mark.parametrize(
    "role,tp,pp,mbs,loss,sp",
    [
        pytest.param("actor", 2, 1, 2, replace(ACTOR_LOSS, entropy_coeff=0.0), False, id="actor-tp2-no-entropy-bonus"),
        pytest.param(
            "actor", 1, 2, 2, replace(ACTOR_LOSS, loss_agg_mode="seq-mean-token-sum-norm"), False, id="actor-pp2-norm"
        ),
        pytest.param("actor", 2, 1, 1, ACTOR_LOSS, True, id="actor-tp2-sequence-parallel"),
        pytest.param("critic", 1, 1, 1, CRITIC_LOSS, False, id="critic-tp1"),
    ],
)
def test_savings_equal_the_plain_path(pool, tiny_models, ckpts, rl_batch, role, tp, pp, mbs, loss, sp):
    """Micro-batches sorted by length and cut to their own widths, the output layer on the response positions
    only, and (entropy_coeff 0) the entropy as a grad-free metric give the plain path's logprobs / values,
    metrics within 1e-6 relative, gradients within 1e-5 per tensor (measured 1.2e-6: other GEMM shapes round
    otherwise) and the weight update within 1e-4 (measured 1.5e-5 to 4.4e-5), while computing fewer positions (the rows'
    lengths differ 8x). PP2 keeps one width per schedule call (the batch's longest row); seq-mean-token-sum-norm keeps
    the batch's R as its constant; sequence parallelism rounds each width up to a multiple of TP (and keeps the
    output layer on every position)."""
    runs = pool.run(ppo_rank_fns.savings_vs_plain_rank, ckpts[role], tp, pp, rl_batch, role, loss, mbs, sp)
    check_savings(runs, rl_batch, role, tiny_models, shared=False)


@pytest.mark.parametrize(
    "role,tp,pp,mbs,sp",
    [
        pytest.param("actor", 1, 1, 2, False, id="actor-tp1-groups-of-2"),
        pytest.param("actor", 2, 1, 4, False, id="actor-tp2-groups-of-4"),
        pytest.param("actor", 1, 2, 4, False, id="actor-pp2"),
        pytest.param("actor", 2, 1, 4, True, id="actor-tp2-sequence-parallel"),
        pytest.param("critic", 2, 2, 8, False, id="critic-tp2pp2-two-groups"),
    ],
)
def test_prefix_groups_equal_the_plain_path(pool, tiny_models, ckpts, grouped_batch, role, tp, pp, mbs, sp):
    """Rows that share a prompt, run as prefix groups (the prompt once, each response attending to it and to
    itself, RoPE at the rows' own positions), give the plain path's logprobs / values, metrics, gradients and weight
    update within the bounds of test_savings_equal_the_plain_path, and count the prompts' copies they did not
    compute. Each DP rank's shard holds whole groups of 2 or 4 rows, one or two per micro-batch."""
    loss = ACTOR_LOSS if role == "actor" else CRITIC_LOSS
    runs = pool.run(ppo_rank_fns.savings_vs_plain_rank, ckpts[role], tp, pp, grouped_batch, role, loss, mbs, sp)
    check_savings(runs, grouped_batch, role, tiny_models, shared=True)


def test_prompt_groups_come_from_the_batchs_group_size():
    """prompt_group_size: the largest n dividing both the batch's group size and the micro-batch size; rows that
    contradict the group size (a differently padded copy of a prompt is another prompt) fail loudly."""
    from mindrl.workers.rl_model import prompt_group_size

    def batch(prompts, group_size):
        ids, mask = pad_rows(prompts, pad=0, left=True)
        responses = torch.ones(len(prompts), 3, dtype=torch.long)
        return Batch(
            {"input_ids": torch.cat([ids, responses], 1), "attention_mask": torch.cat([mask, responses], 1)},
            meta={"prompt_length": ids.shape[1]},
            group_size=group_size,
        )

    a, b, c = [5, 6, 7], [8, 9], [5, 6, 7, 7]
    assert prompt_group_size(batch([a] * 4 + [b] * 4, 4), 16) == 4
    assert prompt_group_size(batch([a] * 4 + [b] * 4, 4), 2) == 2
    assert prompt_group_size(batch([a] * 4 + [b] * 4, 4), 6) == 2
    assert prompt_group_size(batch([a] * 8, 8), 8) == 8
    assert prompt_group_size(batch([a] * 4 + [b] * 2 + [c] * 2, 2), 8) == 2
    assert prompt_group_size(batch([a, b, a, b], 1), 4) == 1
    assert prompt_group_size(batch([a] * 3 + [b] * 3, 3), 4) == 1
    with pytest.raises(ValueError, match="groups of 2 with the same prompt, but they do not"):
        prompt_group_size(batch([a, b, a, b], 2), 4)
    with pytest.raises(ValueError, match="groups of 4 with the same prompt"):
        prompt_group_size(batch([a] * 4 + [b] * 2 + [c] * 2, 4), 8)


def test_prefix_sharing_switch(monkeypatch):
    """MINDRL_PREFIX_SHARING: unset or 1 shares, 0 does not, anything else is an error naming the variable."""
    from mindrl.workers import rl_model

    monkeypatch.delenv("MINDRL_PREFIX_SHARING", raising=False)
    assert rl_model.prefix_sharing()
    monkeypatch.setenv("MINDRL_PREFIX_SHARING", "0")
    assert not rl_model.prefix_sharing()
    monkeypatch.setenv("MINDRL_PREFIX_SHARING", "1")
    assert rl_model.prefix_sharing()
    monkeypatch.setattr(rl_model, "PREFIX_SHARING", False)
    assert not rl_model.prefix_sharing()
    monkeypatch.setenv("MINDRL_PREFIX_SHARING", "off")
    with pytest.raises(ValueError, match="MINDRL_PREFIX_SHARING='off' must be 0 or 1"):
        rl_model.prefix_sharing()


def check_savings(runs: list, batch: Batch, role: str, tiny_models, shared: bool) -> None:
    """The saving path's results in `runs` (savings_vs_plain_rank's) against the plain path's; shared: whether its
    rows shared prompts (prefix groups) or each ran on its own."""

    def close(got: torch.Tensor | float, want: torch.Tensor | float) -> bool:  # 1e-6 of the magnitude (fp32)
        got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
        return (got - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item())

    plain, saved = runs[0]["plain"]["metrics"], runs[0]["savings"]["metrics"]
    assert sorted(plain) == sorted(saved)
    for k in plain:
        if k == "_tokens":
            computed, real, untrimmed, not_recomputed = saved[k]
            assert plain[k] == (untrimmed, real, untrimmed, 0)
            assert real == batch["attention_mask"].sum().item() and computed < untrimmed, saved[k]
            assert (not_recomputed > 0) == shared, saved[k]
            assert computed >= real - not_recomputed, saved[k]
        else:
            assert close(saved[k], plain[k]), (k, plain[k], saved[k])
    forwards = [(r["plain"]["forward"], r["savings"]["forward"]) for r in runs if r["plain"]["forward"] is not None]
    assert forwards
    for want, got in forwards:
        assert close(got, want), (got - want).abs().max().item()
    merged = {
        (name, what): {k: v for r in runs if r[name][what] for k, v in r[name][what].items()}
        for name in ("plain", "savings")
        for what in ("grads", "weights")
    }
    grad_diffs = rel_diffs(merged["savings", "grads"], merged["plain", "grads"])
    want, got = merged["plain", "weights"], merged["savings", "weights"]
    before = HFCheckpoint(tiny_models["untied" if role == "actor" else "orm"])
    num = sum(((got[k] - want[k]).norm() ** 2).item() for k in want)
    den = sum(((want[k] - before.get(k).float()).norm() ** 2).item() for k in want)
    update_diff = math.sqrt(num / den)
    print(f"savings vs plain: gradient {max(grad_diffs.values()):.2g}, weight update {update_diff:.2g} (relative)")
    assert max(grad_diffs.values()) < 1e-5, sorted(grad_diffs.items(), key=lambda kv: -kv[1])[:5]
    # Adam's first step is ~lr * g / (|g| + eps): where g is near eps it magnifies the gradients' rounding (as
    # in test_bf16_distopt's distributed-optimizer bound).
    assert update_diff < 1e-4


def test_nonfinite_update_is_skipped(pool, tiny_models, ckpts, rl_batch):
    """A NaN in the advantages (so in the loss and every gradient) skips the optimizer step on every rank,
    counts it, and leaves the weights exactly as loaded."""
    from safetensors.torch import load_file

    bad = rl_batch.index(range(len(rl_batch)))
    adv = bad["advantages"].clone()
    adv[1, 0] = float("nan")
    bad["advantages"] = adv
    _, _, after = run_update(pool, ckpts["actor"], 2, 1, bad, "actor", ACTOR_LOSS, 4, weights=True, skipped=1)
    loaded = load_file(os.path.join(tiny_models["untied"], "model.safetensors"))
    assert after.keys() == loaded.keys()
    assert all(torch.equal(after[k], loaded[k].float()) for k in after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_finds_any_nonfinite_element(dtype):
    """The skip check's fast path (one sum) agrees with isfinite().all(): a NaN, +inf, -inf, or +inf and -inf
    together anywhere; finite elements whose sum overflows (fp16's 65504 many times over, fp32's 3.4e38) still
    count as finite; an empty buffer is finite."""
    from mindrl.workers.rl_model import all_finite

    base = torch.randn(10_001).to(dtype)
    assert all_finite(base) and all_finite(torch.empty(0, dtype=dtype))
    for values in ([float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")]):
        t = base.clone()
        for i, v in zip((17, 9_000), values):
            t[i] = v
        assert not all_finite(t), values
        assert not all_finite(t[10:].view(-1, 1)), values  # a view, any shape
    big = torch.full((4096,), torch.finfo(dtype).max, dtype=dtype)
    assert torch.isfinite(big).all() and all_finite(big)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("tp", [1, 2])
def test_weight_grads_added_into_main_grad(pool, tiny_models, ckpts, rl_batch, tmp_path, tp, tied):
    """The linear layers add their weight grads straight into DDP's main_grad (megatron's gradient accumulation
    fusion; mindrl's kernel on CPU): every linear layer does so in every micro-batch, and the accumulated grads
    equal those of the unfused path (a weight-grad tensor per micro-batch that DDP's hook adds), over 4
    micro-batches. Tied embeddings: the shared weight's grad from the embedding is still added (megatron's
    zero_out_wgrad)."""
    load = ckpts["actor"]
    if tied:
        load = str(tmp_path / "tied")
        convert.hf2mcore(tiny_models["tied"], load, 1, 1, pool=pool)
    # every DP rank updates on the whole batch, in micro-batches of 2 rows
    out = [r for r in pool.run(ppo_rank_fns.wgrad_fusion_rank, load, tp, rl_batch, ACTOR_LOSS, 2) if r is not None][0]
    assert out["calls"] == out["linear"] * (ROWS // 2), {k: out[k] for k in ("calls", "linear")}
    worst = max(
        (out["fused"][n] - g).abs().max().item() / max(g.abs().max().item(), 1e-12) for n, g in out["plain"].items()
    )
    print(
        f"tp{tp} {'tied' if tied else 'untied'}: {out['calls']} fused weight-grad GEMMs, max relative diff {worst:.2e}"
    )
    assert worst < 1e-5
    assert all(g.abs().max() > 0 for g in out["fused"].values())
