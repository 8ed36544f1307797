"""A learned reward model's scores mixed into the rule rewards: optional running normalisation, clipping, a weight
(rl_config.normalize_reward / reward_clip_range / reward_model_weight). Plain floats; see docs/reward_model.md."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RewardModelMix:
    weight: float = 1.0
    """The score's weight in the reward, beside the verifiers' weights."""
    normalize: bool = False
    """Scores normalised by the running mean and std of every score seen so far (this batch's included)."""
    clip_range: tuple[float, float] | None = None
    """[low, high] the (normalised) scores are clipped to; None: no clipping."""


@dataclass
class RunningMoments:
    """Mean and variance of every value `update` has seen (Chan et al.'s parallel merge of batch moments)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    """Sum of squared deviations from the mean."""

    def update(self, values: Sequence[float]) -> None:
        n = len(values)
        if n == 0:
            return
        mean = sum(values) / n
        m2 = sum((v - mean) ** 2 for v in values)
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        """The population standard deviation (0 before two values)."""
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 0.0

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def shaped_model_scores(
    scores: Sequence[float], mix: RewardModelMix, moments: RunningMoments, update: bool = True
) -> list[float]:
    """Each score as it enters the reward, before its weight: normalised with `moments` updated by this batch first
    (when mix.normalize; a std below 1e-8 leaves the centred scores unscaled), then clipped. update=False: the
    moments as they stand (the held-out evaluation, which must not change training)."""
    out = [float(s) for s in scores]
    if mix.normalize:
        if update:
            moments.update(out)
        std = moments.std
        out = [(s - moments.mean) / (std if std > 1e-8 else 1.0) for s in out]
    if mix.clip_range is not None:
        low, high = mix.clip_range
        out = [min(max(s, low), high) for s in out]
    return out


def mix_rewards(rule: Sequence[float], shaped: Sequence[float], mix: RewardModelMix) -> list[float]:
    """rule reward (already the verifiers' weighted sum) + mix.weight * shaped score, per response."""
    if len(rule) != len(shaped):
        raise ValueError(f"{len(rule)} rule rewards but {len(shaped)} reward-model scores")
    return [r + mix.weight * s for r, s in zip(rule, shaped)]
