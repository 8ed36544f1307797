"""rl_config.async_mode bounded, the trainer's side: batches of experience groups from a transport (no older than
max_staleness versions, each prompt once per epoch), their async/* metrics, and the RL batch they make."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mindrl.algorithms.staleness import staleness
from mindrl.batch import Batch
from mindrl.serving.experience import GEN_SECONDS, REF_SECONDS, Experience
from mindrl.serving.transport import TrainerEnd, TransportTimeout
from mindrl.trainer import experience
from mindrl.trainer.experience import Response
from mindrl.trainer.pipeline.schedule import Generated

__all__ = ["GEN_SECONDS", "Intake", "make_batch", "sampler_tps", "to_generated"]


@dataclass
class Intake:
    """Takes `groups` prompts' experience groups per batch from `end`, refusing (and re-issuing) those sampled with
    weights more than `max_staleness` versions older than the trainer's. A group that carries rewards stops the run:
    the trainer scores every response itself, so a sampler's own scores would be ignored."""

    end: TrainerEnd
    groups: int
    max_staleness: int
    timeout_s: float = 600.0
    """How long a batch may take to fill before the run stops (no sampler delivering)."""
    poll_s: float = 1.0

    def take(self, version: int) -> tuple[list[list[Experience]], dict[str, float]]:
        """`groups` accepted groups for the update of weight version `version`, and this batch's async/* metrics."""
        self.end.set_freshness(version, self.max_staleness)
        stale_before, foreign_before = self.end.stats.dropped_stale, self.end.stats.dropped_foreign
        got: list[list[Experience]] = []
        t0 = time.monotonic()
        while len(got) < self.groups:
            left = t0 + self.timeout_s - time.monotonic()
            if left <= 0:
                raise TransportTimeout(
                    f"the experience queue gave {len(got)} of {self.groups} prompts' groups in {self.timeout_s:g}s "
                    f"(samplers silent for {self.poll_s:g}s+: {self.end.silent_samplers(self.poll_s) or 'none'})"
                )
            got += self.end.receive(self.groups - len(got), min(left, self.poll_s))
        waited = time.monotonic() - t0
        _refuse_scored(got)
        lag = staleness(version, torch.tensor([e.weight_version for g in got for e in g])).double()
        metrics = {
            "async/staleness/mean": lag.mean().item(),
            "async/staleness/max": lag.max().item(),
            "async/dropped_stale": float(self.end.stats.dropped_stale - stale_before),
            "async/dropped_foreign": float(self.end.stats.dropped_foreign - foreign_before),
            "async/trainer_idle_s": waited,
        }
        depth = getattr(self.end, "queue_depth", None)
        if depth is not None:  # the Ray hub's queue; ZeroMQ's buffers cannot be counted
            metrics["async/queue_depth"] = float(depth())
        metrics.update(sampler_tps(got))
        ref_s = [float(g[0].meta[REF_SECONDS]) for g in got if REF_SECONDS in g[0].meta]
        if ref_s:  # async_sampler_ref: the samplers' reference passes of this batch's groups, summed
            metrics["async/sampler_ref_s"] = sum(ref_s)
        return got, metrics


def _refuse_scored(groups: Sequence[Sequence[Experience]]) -> None:
    scored = next((e for g in groups for e in g if e.rewards), None)
    if scored is not None:
        raise ValueError(
            f"sampler {scored.sampler_id!r} sent rewards for verifiers {sorted(scored.rewards)} (prompt_index "
            f"{scored.prompt_index}): samplers do not score; the trainer scores every response with its own "
            "rl_config.verifier_function, verifier_weight and verifier_timeout, so a sampler's scores would be ignored "
            "and could disagree with them; send rewards={} (as mindrl-sampler does)"
        )


def sampler_tps(groups: Sequence[Sequence[Experience]]) -> dict[str, float]:
    """async/sampler_tps/{sampler_id}: response tokens per second of generation, of the groups each sampler
    delivered (those whose meta carries GEN_SECONDS)."""
    tokens: dict[str, float] = defaultdict(float)
    seconds: dict[str, float] = defaultdict(float)
    for g in groups:
        if GEN_SECONDS in g[0].meta:
            sid = g[0].sampler_id
            tokens[sid] += sum(e.response_len for e in g)
            seconds[sid] += float(g[0].meta[GEN_SECONDS])
    return {f"async/sampler_tps/{s}": tokens[s] / seconds[s] for s in sorted(tokens) if seconds[s] > 0}


def to_generated(groups: Sequence[Sequence[Experience]], labels: list[list[int]]) -> Generated:
    """The generation batch of `groups`: behaviour logprobs and weight version of each token, reference logprobs where
    the sampler sent them, rows_meta "weight_version", "prompt_index" and "epoch" (the prompt ledger's unit)."""
    responses = [
        [Response(e.response_ids.tolist(), e.behaviour_logprobs.astype("float64").tolist(), e.finish_reason,
                  [e.weight_version] * e.response_len,
                  ref_logprobs=None if e.ref_logprobs is None else e.ref_logprobs.astype("float32").tolist())
         for e in g]
        for g in groups
    ]  # fmt: skip
    rows = [e for g in groups for e in g]
    meta = {"weight_version": [e.weight_version for e in rows], "prompt_index": [e.prompt_index for e in rows],
            "epoch": [e.epoch for e in rows]}  # fmt: skip
    return Generated([g[0].prompt_ids.astype("int64").tolist() for g in groups], responses, labels, {}, meta)


def make_batch(groups: Sequence[Sequence[Experience]], n: int, pad_token_id: int | None) -> Batch:
    """The RL batch of `groups` (`to_generated`; rollout_log_prob = the behaviour logprobs, ref_log_prob where every
    experience carries reference logprobs)."""
    gen = to_generated(groups, [])
    batch = experience.make_batch(gen.prompt_ids, gen.responses, n, pad_token_id)
    batch.rows_meta.update(gen.rows_meta)
    return batch
