"""rl_config.async_mode one_step_off: the rollout runs one batch ahead of the update, so each batch trains one
weight version after the one that sampled it; its staleness metrics, and its pending batch in the checkpoint."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from mindrl.algorithms.staleness import staleness
from mindrl.data.prompt_dataset import PromptBatch
from mindrl.rollout.base import RolloutSample
from mindrl.serving import experience as wire
from mindrl.trainer.experience import Response, stamp
from mindrl.trainer.pipeline import schedule
from mindrl.trainer.pipeline.schedule import Schedule, Sync, generated, refuse_pending

GenerateFn = Callable[[PromptBatch, int, dict], list]
"""generate(prompts, iteration, timing) -> per prompt its n RolloutSamples, sampled with the rollout's current
weights and the seeds of `iteration` (the one that will train them); the rollout's timings added to `timing`."""

SAMPLER_ID = "integrated"
"""The sampler named in a checkpointed experience: the engines inside the actor's workers."""


@dataclass
class Generated:
    """A generated batch waiting for its update."""

    prompts: PromptBatch
    samples: list[list[RolloutSample]]
    version: int
    """Weight version that sampled it: the number of updates applied before the rollout."""
    iteration: int
    """The iteration that trains it (its sampling seeds are that iteration's)."""


@dataclass
class OneStepOff:
    """Keeps `depth` generated batches ahead of the update (1; 0 is the synchronous order). At iteration t (version
    t-1: t-1 updates done) it generates the batch of iteration t+depth with the current weights, then hands over the
    batch of iteration t, generated at version t-1-depth (t-1 at the start, before anything could be ahead)."""

    depth: int
    last_iteration: int
    """No batch is generated for an iteration after this one (train_iters): none is wasted at the end."""
    pending: deque = field(default_factory=deque)

    def take(
        self, batches: Iterator[PromptBatch], generate: GenerateFn, iteration: int, timing: dict[str, float]
    ) -> tuple[Generated, dict[str, float]]:
        """The batch iteration `iteration` trains (the prompts drawn from `batches` in order), after generating what
        the pipeline keeps ahead; returns it with the async/* metrics of this iteration."""
        version = iteration - 1
        waited, tokens = 0.0, 0
        while self._next_iteration(iteration) <= min(iteration + self.depth, self.last_iteration):
            it = self._next_iteration(iteration)
            prompts = next(batches)
            t0 = time.perf_counter()
            samples = generate(prompts, it, timing)
            waited += time.perf_counter() - t0
            tokens += sum(len(s.token_ids) for group in samples for s in group)
            self.pending.append(Generated(prompts, samples, version, it))
        got = self.pending.popleft()
        if got.iteration != iteration:
            raise RuntimeError(f"iteration {iteration} got the batch generated for iteration {got.iteration}")
        lag = float(staleness(version, torch.tensor([got.version]))[0])
        metrics = {
            "async/staleness/mean": lag,  # one version per batch here; per experience with samplers
            "async/staleness/max": lag,
            "async/queue_depth": float(len(self.pending)),
            "async/dropped_stale": 0.0,  # nothing is older than max_staleness
            # the same devices generate and train: the update waits for the whole rollout
            "async/trainer_idle_s": waited,
            "async/sampler_tps": tokens / waited if waited > 0 else 0.0,
        }
        return got, metrics

    def _next_iteration(self, iteration: int) -> int:
        return self.pending[-1].iteration + 1 if self.pending else iteration

    # ------------------------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> tuple[dict, bytes | None]:
        """(JSON-able state, the pending responses as one experience message or None): with the data loader's state
        (which has drawn the pending prompts) a resume continues exactly."""
        meta = {"depth": self.depth, "batches": []}
        records = []
        for g in self.pending:
            meta["batches"].append(
                {
                    "version": g.version,
                    "iteration": g.iteration,
                    "indices": g.prompts.indices.tolist(),
                    "extras": {k: [t.tolist() for t in v] for k, v in g.prompts.extras.items()},
                    "group_sizes": [len(group) for group in g.samples],
                    # the wire format has no loss mask: an agent loop's observation tokens as [start, end) spans
                    "observations": [_spans(getattr(s, "loss_mask", None)) for group in g.samples for s in group],
                }
            )
            for i, (prompt, group) in enumerate(zip(g.prompts.prompts, g.samples)):
                for s in group:
                    records.append(
                        wire.Experience(
                            prompt_ids=prompt.numpy().astype("<i8"),
                            response_ids=torch.tensor(s.token_ids, dtype=torch.int64).numpy(),
                            behaviour_logprobs=torch.tensor(s.logprobs, dtype=torch.float64).numpy(),
                            rewards={},
                            finish_reason=s.finish_reason if s.finish_reason in wire.FINISH_REASONS else "abort",
                            prompt_index=int(g.prompts.indices[i]),
                            epoch=0,
                            sampler_id=SAMPLER_ID,
                            weight_version=g.version,
                        )
                    )
        return meta, (wire.encode(records) if records else None)

    def load_state_dict(self, meta: dict, blob: bytes | None) -> None:
        if meta.get("depth") != self.depth:
            raise ValueError(
                f"the checkpoint was written with {meta.get('depth')} batch(es) generated ahead (rl_config.async_mode"
                f" / max_staleness), this run keeps {self.depth}: resume with the same async settings"
            )
        records = wire.decode(blob) if blob is not None else []
        self.pending.clear()
        pos = 0
        for b in meta["batches"]:
            prompts, samples = [], []
            observations = iter(b.get("observations") or [])
            for size in b["group_sizes"]:
                group = records[pos : pos + size]
                pos += size
                prompts.append(torch.from_numpy(group[0].prompt_ids.astype("int64")))
                samples.append([_sample(e, next(observations, None)) for e in group])
            extras = {k: [torch.tensor(x, dtype=torch.long) for x in v] for k, v in b["extras"].items()}
            batch = PromptBatch(prompts, torch.tensor(b["indices"], dtype=torch.long), extras)
            self.pending.append(Generated(batch, samples, int(b["version"]), int(b["iteration"])))
        if pos != len(records):
            raise ValueError(f"the checkpoint's pending experiences hold {len(records)} responses, its state {pos}")


def _spans(loss_mask: list[int] | None) -> list[list[int]] | None:
    """The [start, end) runs of 0 in `loss_mask`; None when every token is the policy's."""
    if loss_mask is None or all(loss_mask):
        return None
    spans: list[list[int]] = []
    for i, m in enumerate(loss_mask):
        if m:
            continue
        if spans and spans[-1][1] == i:
            spans[-1][1] = i + 1
        else:
            spans.append([i, i + 1])
    return spans


def _sample(e: wire.Experience, spans: list[list[int]] | None) -> RolloutSample | Response:
    ids, lps = e.response_ids.tolist(), e.behaviour_logprobs.tolist()
    if not spans:
        return RolloutSample(ids, lps, e.finish_reason)
    mask = [1] * len(ids)
    for start, end in spans:
        mask[start:end] = [0] * (end - start)
    return Response(ids, lps, e.finish_reason, [], mask)


def one_step_off(cfg) -> OneStepOff | None:
    """The pipeline of `cfg` (validated), or None in the synchronous mode."""
    rl = cfg.rl_config
    if rl.async_mode != "one_step_off":
        return None
    return OneStepOff(depth=rl.max_staleness, last_iteration=cfg.megatron_training.train_iters)


def trainer_state(ahead: OneStepOff | None) -> dict:
    """TrainerState's async fields for the pipeline `ahead` (None: synchronous, nothing pending)."""
    if ahead is None:
        return {}
    meta, blob = ahead.state_dict()
    return {"async_rollout": meta, "async_pending": blob}


def restore(ahead: OneStepOff | None, state) -> None:
    """The pending batches of a checkpoint's TrainerState `state` back into `ahead`."""
    if ahead is None:
        refuse_pending(state)
    elif state.async_rollout is not None:
        ahead.load_state_dict(state.async_rollout, state.async_pending)


class OneStepOffSchedule(Schedule):
    """async_mode one_step_off as a schedule: `OneStepOff` over the data loader, each batch sampled with the seeds of
    the iteration that trains it."""

    def __init__(self, ahead: OneStepOff, sync: Sync):
        self.ahead, self.sync = ahead, sync

    def next(self, iteration: int, gen_batch: int, timing: dict[str, float]) -> schedule.Generated:
        def generate(prompts, it, timing):
            ids = [p.tolist() for p in prompts.prompts]
            return self.sync.episode.run(ids, self.sync.sampling, self.sync.seeds(it, 0, prompts.indices), timing)

        got, metrics = self.ahead.take(self.sync, generate, iteration, timing)
        n = self.sync.seeds.n
        out = generated(got.prompts, stamp(got.samples, got.version), n,
                        weight_version=[got.version] * (len(got.samples) * n))  # fmt: skip
        out.metrics.update(metrics)
        out.metrics.update(self.sync.episode.metrics)  # the episodes run in this call (the batch trained next)
        return out

    def state_dict(self) -> dict:
        return trainer_state(self.ahead)

    def load_state_dict(self, state, iteration: int) -> None:
        restore(self.ahead, state)
