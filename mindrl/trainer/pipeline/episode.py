"""The episode layer: how a prompt becomes the responses the trainer learns from. `OneTurn` samples once. An agent
loop (generate, parse tool calls, run the tools, append their observations, generate again) is another `Episode`:
its responses carry a loss mask with 0 on the observation tokens (`experience.Response.loss_mask`)."""

from __future__ import annotations

import abc
from collections.abc import Sequence

from mindrl.rollout.base import SamplingConfig


class Episode(abc.ABC):
    metrics: dict[str, float]
    """The last `run`'s metrics (the agent loop's agent/*), which the schedule hands to the trainer with the batch."""

    @abc.abstractmethod
    def run(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seeds: Sequence[int], timing: dict[str, float]
    ) -> list:
        """Per prompt, `sampling.n` responses (`experience.Response`s, or the engine's `RolloutSample`s when every
        token is the policy's), each prompt's from its seed; the engine's timings added to `timing`."""


class OneTurn(Episode):
    """One engine call: the response is the policy's sample."""

    def __init__(self, engine):
        self.engine = engine
        self.metrics = {}

    def run(self, prompts, sampling, seeds, timing) -> list:
        return self.engine.generate(prompts, sampling, seeds, timing)
