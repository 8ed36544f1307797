"""The trainer's one door to rollout, whatever serves it: the engines inside the integrated workers today, a
remote rollout server or an asynchronous sampler later. The loop only calls `generate`."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

from mindrl.rollout.base import RolloutSample, SamplingConfig


@dataclass
class RolloutResult:
    samples: list[list[RolloutSample]]
    """Per prompt (in prompt order), `sampling.n` samples with token ids and logprobs."""
    timing: dict[str, float] = field(default_factory=dict)
    """timing/reshard_to_infer, timing/rollout, timing/reshard_to_train (seconds, slowest rank)."""


class RolloutSource(abc.ABC):
    @abc.abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seeds: Sequence[int]
    ) -> RolloutResult:
        """Samples from the current policy (its weights are the trainer's latest). seeds: one per prompt, so
        the samples do not depend on how the prompts are spread over engine replicas."""


class IntegratedRollout(RolloutSource):
    """The engines inside the integrated worker group: each engine replica (infer-TP ranks) takes a
    contiguous slice of the prompts; the actor weights are resharded into them on every call."""

    def __init__(self, group, infer_tp: int):
        self.group = group
        self.infer_tp = infer_tp

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seeds: Sequence[int]
    ) -> RolloutResult:
        replicas = self.group.world_size // self.infer_tp
        if len(prompts) % replicas:
            raise ValueError(f"{len(prompts)} prompts do not split over {replicas} engine replicas")
        size = len(prompts) // replicas
        args = []
        for rank in range(self.group.world_size):
            r = rank // self.infer_tp
            first = rank % self.infer_tp == 0
            part = (list(prompts[r * size : (r + 1) * size]), list(seeds[r * size : (r + 1) * size]))
            args.append((*(part if first else (None, None)), sampling))
        results = self.group.call("generate", args)
        samples = [group for s, _ in results if s is not None for group in s]
        timing: dict[str, float] = {}
        for _, t in results:
            for k, v in t.items():
                timing[k] = max(timing.get(k, 0.0), v)
        return RolloutResult(samples, timing)
