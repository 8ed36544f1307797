"""Partial rollout (`rl_config.partial_rollout_max_split` > 1): responses (one turn, or agent-loop episodes) are
generated in pieces of a share of their length, and one cut short continues in a later iteration with the newer
weights (docs/rollout.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from mindrl.rollout.base import RolloutSample, SamplingConfig
from mindrl.trainer import experience
from mindrl.trainer.pipeline.episode import Episode, Progress
from mindrl.trainer.pipeline.schedule import Generated, Schedule, Sync, refuse_pending


@dataclass
class Group:
    """A prompt in flight: its n responses."""

    index: int
    """The prompt's dataset row."""
    prompt: list[int]
    labels: list[int]
    drawn: int
    """The iteration that drew it."""
    responses: list[Progress]

    @property
    def done(self) -> bool:
        return all(r.finish_reason is not None for r in self.responses)


@dataclass
class Taken:
    """The groups an iteration trains on, oldest first, and the partial_rollout/* metrics of the iteration."""

    groups: list[Group]
    metrics: dict[str, float]

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [g.prompt for g in self.groups]

    @property
    def samples(self) -> list[list[RolloutSample]]:
        return [[RolloutSample(r.token_ids, r.logprobs, r.finish_reason or "length") for r in g.responses]
                for g in self.groups]  # fmt: skip

    @property
    def labels(self) -> list[list[int]]:
        return [g.labels for g in self.groups for _ in g.responses]

    @property
    def versions(self) -> list[list[int]]:
        """Per row, the iteration whose weights sampled each response token."""
        return [r.versions for g in self.groups for r in g.responses]


class PartialRollout:
    """The pool of prompts in flight, MindSpeed-RL's scheme: it holds up to two batches; each iteration draws one
    (two at the first, none once the run's train_iters batches are drawn), then advances every unfinished episode by a
    piece of at most ceil(limit / max_split) tokens (all with the current weights; `limit` is the episode's most
    response tokens, max_tokens for one turn) until `batch_size` prompts have all n responses finished; it trains on
    those, oldest first. The rest stays in flight and continues next iteration, so a response is finished within
    max_split iterations and every drawn prompt is trained on exactly once. The episode (`episode.Episode.resume`)
    makes the pieces: one turn continues the tokens; the agent loop continues its turn, runs the tools of a turn it
    ends and appends their observations, all kept in each response's `episode.Progress`."""

    def __init__(self, n: int, sampling: SamplingConfig, max_split: int, batch_size: int, train_iters: int, seed: int,
                 limit: int | None = None):  # fmt: skip
        if max_split < 2:
            raise ValueError(f"PartialRollout needs partial_rollout_max_split >= 2, got {max_split}")
        self.n = n
        self.sampling = sampling
        self.max_split = max_split
        self.piece = math.ceil((limit or sampling.max_tokens) / max_split)
        self.batch_size = batch_size
        self.train_iters = train_iters
        self.seed = seed
        self.pool: list[Group] = []
        self.drawn_batches = 0

    # ------------------------------------------------------------------------------------------------ step
    def step(self, iteration: int, batches, episode: Episode, timing: dict[str, float] | None = None) -> Taken:
        """Iteration `iteration`'s groups: draws its batch(es) from `batches` (PromptBatch iterator), advances the
        episodes by pieces until batch_size groups are finished (their engine calls within one `episode.awake`), takes
        them out of the pool. `episode.metrics`: those of the iteration's pieces."""
        timing = {} if timing is None else timing
        while self.drawn_batches < min(iteration + 1, self.train_iters):
            self._add(next(batches), iteration)
        episode.reset_metrics()
        rounds = pieces = continued = 0
        with contextlib.ExitStack() as awake:
            while sum(g.done for g in self.pool) < self.batch_size:
                todo = [(g, j, r) for g in self.pool for j, r in enumerate(g.responses) if r.finish_reason is None]
                if not todo:
                    raise RuntimeError(
                        f"partial rollout: {len(self.pool)} prompts in flight, fewer than the {self.batch_size} an "
                        "iteration trains on (the run drew fewer batches than it trains)"
                    )
                if not rounds:  # the weights load once, and only where a piece is sampled
                    awake.enter_context(episode.awake(timing))
                self._generate_round(todo, iteration, rounds, episode, timing)
                rounds += 1
                pieces += len(todo)
                continued += sum(r.pieces > 1 for _, _, r in todo)
        done = [g for g in self.pool if g.done][: self.batch_size]  # the pool is in drawing order: oldest first
        taken_ids = {id(g) for g in done}
        self.pool = [g for g in self.pool if id(g) not in taken_ids]
        return Taken(done, self._metrics(done, iteration, rounds, pieces, continued))

    def _add(self, prompts, iteration: int) -> None:
        labels = [lab.tolist() for lab in prompts.extras.get("labels", [])]
        for k, (p, idx) in enumerate(zip(prompts.prompts, prompts.indices.tolist())):
            responses = [Progress() for _ in range(self.n)]
            self.pool.append(Group(int(idx), p.tolist(), labels[k] if labels else [], iteration, responses))
        self.drawn_batches += 1

    def _generate_round(self, todo, iteration: int, round_: int, episode: Episode, timing) -> None:
        """One piece of every response in `todo` [(group, sample index, response)], each from its own seed."""
        base = self.seed * 1_000_003 + iteration * 7919 + round_ * 104_729
        seeds = [(base + g.index * self.n + j) % (2**31) for g, j, _ in todo]
        episode.resume([(g.prompt, r) for g, _, r in todo], self.sampling, self.piece, seeds, iteration, timing)
        for _, _, r in todo:
            r.pieces += 1

    def _metrics(self, done: list[Group], iteration: int, rounds: int, pieces: int, continued: int) -> dict[str, float]:
        responses = [r for g in done for r in g.responses]
        ages = [iteration - v for r in responses for v, m in zip(r.versions, r.loss_mask or [1] * len(r.versions)) if m]
        unfinished = sum(r.finish_reason is None for g in self.pool for r in g.responses)
        return {
            "partial_rollout/rounds": float(rounds),
            "partial_rollout/pieces": float(pieces),
            "partial_rollout/continued": float(continued),
            "partial_rollout/split_responses": float(sum(r.pieces > 1 for r in responses)),
            "partial_rollout/pieces_per_response": sum(r.pieces for r in responses) / max(len(responses), 1),
            "partial_rollout/staleness/mean": sum(ages) / max(len(ages), 1),
            "partial_rollout/staleness/max": float(max(ages, default=0)),
            "partial_rollout/stale_token_fraction": sum(a > 0 for a in ages) / max(len(ages), 1),
            "partial_rollout/prompt_age/max": float(max((iteration - g.drawn for g in done), default=0)),
            "partial_rollout/in_flight_prompts": float(len(self.pool)),
            "partial_rollout/in_flight_unfinished": float(unfinished),
        }

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything in flight (JSON): part of the trainer's checkpoint, so a resume continues the same responses."""
        return {
            "drawn_batches": self.drawn_batches,
            "pool": [dataclasses.asdict(g) for g in self.pool],
        }

    def load_state_dict(self, state: dict | None, iteration: int) -> None:
        """`state_dict`'s state; None (a checkpoint saved without partial rollout): nothing in flight, the
        `iteration` batches drawn so far all trained on."""
        if state is None:
            self.drawn_batches, self.pool = iteration, []
            return
        self.drawn_batches = int(state["drawn_batches"])
        self.pool = [
            Group(g["index"], g["prompt"], g["labels"], g["drawn"], [Progress(**r) for r in g["responses"]])
            for g in state["pool"]
        ]


class PartialSchedule(Schedule):
    """Partial rollout as a schedule: `PartialRollout`'s pool over the data loader; its pieces sampled by the episode."""

    def __init__(self, pool: PartialRollout, sync: Sync):
        self.pool, self.sync = pool, sync

    def next(self, iteration: int, gen_batch: int, timing: dict[str, float]) -> Generated:
        episode = self.sync.episode
        taken = self.pool.step(iteration, self.sync, episode, timing)
        responses = [
            [
                experience.Response(
                    r.token_ids, r.logprobs, r.finish_reason or "length", [v - 1 for v in r.versions], r.loss_mask
                )
                for r in g.responses
            ]
            for g in taken.groups
        ]  # fmt: skip  (pool versions are iterations; weight versions one less)
        return Generated(taken.prompt_ids, responses, taken.labels, {**taken.metrics, **episode.metrics})

    def state_dict(self) -> dict:
        return {"partial_rollout": self.pool.state_dict()}

    def load_state_dict(self, state, iteration: int) -> None:
        self.pool.load_state_dict(state.partial_rollout, iteration)
        refuse_pending(state)


def from_config(cfg, sampling: SamplingConfig, limit: int | None = None) -> PartialRollout | None:
    """The pool of a validated config with partial_rollout_max_split > 1 (`limit`: the episode's most response
    tokens, `Episode.limit`); None otherwise."""
    rl, mt = cfg.rl_config, cfg.megatron_training
    if rl.partial_rollout_max_split <= 1:
        return None
    return PartialRollout(rl.n_samples_per_prompt, sampling, rl.partial_rollout_max_split, mt.global_batch_size,
                          mt.train_iters, mt.seed, limit)  # fmt: skip


def pieces_of(versions: Sequence[int]) -> list[tuple[int, int, int]]:
    """[(start, end, version)]: the runs of equal versions in a response's per-token versions."""
    out: list[tuple[int, int, int]] = []
    for i, v in enumerate(versions):
        if out and out[-1][2] == v:
            out[-1] = (out[-1][0], i + 1, v)
        else:
            out.append((i, i + 1, v))
    return out
