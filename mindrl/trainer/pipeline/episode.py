"""The episode layer: how a prompt becomes the responses the trainer learns from. `OneTurn` samples once. An agent
loop (generate, parse tool calls, run the tools, append their observations, generate again) is another `Episode`:
its responses carry a loss mask with 0 on the observation tokens (`experience.Response.loss_mask`). Partial rollout
advances every episode in pieces (`Episode.resume`), carrying each unfinished one as a `Progress`."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from mindrl.rollout.base import SamplingConfig


@dataclass
class Progress:
    """An episode generated so far, as partial rollout carries it from piece to piece and iteration to iteration (and
    in its checkpoint, as JSON): the whole state an episode needs to go on where it stopped."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """The behaviour logprob of each token (0 on observation tokens)."""
    versions: list[int] = field(default_factory=list)
    """The iteration whose weights sampled each token (or, for an observation, appended it)."""
    finish_reason: str | None = None
    """None while unfinished; then how the episode ended."""
    pieces: int = 0
    loss_mask: list[int] | None = None
    """The agent loop's: 0 on the observation tokens. None: every token is the policy's."""
    turns: int = 0
    """The agent loop's turns completed (the one being written, from `turn_start` on, is not counted yet)."""
    tool_calls: int = 0
    turn_start: int = 0
    """Where the turn being written began: a turn cut by its piece is continued, then its tool calls are parsed from
    the whole turn's text. A turn's calls run in the piece that ends the turn, so none is ever pending here."""


class Episode(abc.ABC):
    engine: object
    metrics: dict[str, float]
    """The metrics of the last `run` (the agent loop's agent/*), or of the `resume` calls since `reset_metrics`, which
    the schedule hands to the trainer with the batch."""

    @abc.abstractmethod
    def run(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seeds: Sequence[int], timing: dict[str, float]
    ) -> list:
        """Per prompt, `sampling.n` responses (`experience.Response`s, or the engine's `RolloutSample`s when every
        token is the policy's), each prompt's from its seed; the engine's timings added to `timing`."""

    @abc.abstractmethod
    def resume(
        self,
        cuts: Sequence[tuple[Sequence[int], Progress]],
        sampling: SamplingConfig,
        budget: int,
        seeds: Sequence[int],
        version: int,
        timing: dict[str, float],
    ) -> None:
        """Partial rollout: every unfinished episode `(prompt, progress)` goes on, in place, by at most `budget` tokens
        sampled (one trajectory each: `sampling.n` is ignored), from its seed; its new tokens are stamped `version`, its
        finish_reason set if it ended. An episode not ended has sampled exactly `budget` tokens, so an episode of at
        most `limit(sampling)` tokens ends within ceil(limit / budget) calls."""

    def limit(self, sampling: SamplingConfig) -> int:
        """The most tokens a response has."""
        return sampling.max_tokens

    def awake(self, timing: dict[str, float]):
        """The engine's weights loaded once for all the calls within (`engines.Engine.awake`)."""
        return self.engine.awake(timing)

    def reset_metrics(self) -> None:
        self.metrics = {}


class OneTurn(Episode):
    """One engine call: the response is the policy's sample."""

    def __init__(self, engine):
        self.engine = engine
        self.metrics = {}

    def run(self, prompts, sampling, seeds, timing) -> list:
        return self.engine.generate(prompts, sampling, seeds, timing)

    def resume(self, cuts, sampling, budget, seeds, version, timing) -> None:
        """One engine call per piece size (the engine takes one max_tokens per call; a last piece may be shorter)."""
        by_budget: dict[int, list] = {}
        for (prompt, p), seed in zip(cuts, seeds):
            by_budget.setdefault(min(budget, sampling.max_tokens - len(p.token_ids)), []).append((prompt, p, seed))
        for size, items in sorted(by_budget.items()):
            piece = dataclasses.replace(sampling, n=1, max_tokens=size)
            out = self.engine.generate([list(q) + p.token_ids for q, p, _ in items], piece, [s for *_, s in items],
                                       timing)  # fmt: skip
            if len(out) != len(items):
                raise RuntimeError(f"partial rollout: {len(items)} requests, {len(out)} answers")
            for (_, p, _), got in zip(items, out):
                s = got[0]
                p.token_ids += list(s.token_ids)
                p.logprobs += list(s.logprobs)
                p.versions += [version] * len(s.token_ids)
                if s.finish_reason != "length" or len(p.token_ids) >= sampling.max_tokens:
                    p.finish_reason = s.finish_reason
                elif not s.token_ids:  # cannot happen with size >= 1; never loop on it
                    p.finish_reason = "length"
