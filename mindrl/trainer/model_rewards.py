"""A response's reward beyond the rule verifiers: the reward model's scores of any rows outside the scoring phase
(dynamic sampling's generation batches, the held-out evaluation's responses), mixed in as configured, and DAPO's
overlong penalty. See docs/reward_model.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mindrl.algorithms import overlong_penalty
from mindrl.rewards.model_scores import RewardModelMix, RunningMoments, mix_rewards, shaped_model_scores
from mindrl.rollout.base import RolloutSample
from mindrl.trainer import experience
from mindrl.workers.results import Scores
from mindrl.workers.reward_worker import SCORE_KEYS


class Rewards:
    """The run's rewards: `client` (the rule verifiers' `RewardClient`), the reward model's `scorer` and `mix`
    (None without one; `moments`: normalize_reward's running statistics), and DAPO's overlong penalty (rl_config)."""

    def __init__(self, client, scorer: RewardModelScorer | None, mix: RewardModelMix | None, rl):
        self.client, self.scorer, self.mix_cfg, self.rl = client, scorer, mix, rl
        self.moments = RunningMoments()

    def mix(self, scored: Scores, model_scores: list[float], update: bool = True) -> Scores:
        """The rule rewards with the reward model's scores mixed in (normalised and clipped as configured, weighted;
        `mindrl.rewards.model_scores`; update=False leaves the running statistics as they are); the raw scores kept
        in `Scores.model_scores`."""
        shaped = shaped_model_scores(model_scores, self.mix_cfg, self.moments, update)
        return dataclasses.replace(
            scored, rewards=mix_rewards(scored.rewards, shaped, self.mix_cfg), model_scores=model_scores
        )

    def shaped(self, scored: Scores, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows,) each response's score: its reward, plus DAPO's overlong penalty (returned second; None when off)
        from its length `lengths` (rows,) in tokens."""
        rl = self.rl
        scores = torch.tensor(scored.rewards, dtype=torch.float32)
        if not rl.overlong_buffer_enable:
            return scores, None
        penalty = overlong_penalty(
            lengths, int(rl.rollout_max_tokens), rl.overlong_buffer, rl.overlong_buffer_penalty_factor
        ).float()
        return scores + penalty, penalty


@dataclass
class RewardModelScorer:
    """Scores rows with the RewardWorker group `group`, whose ranks take `micro_rows` rows per forward micro-batch."""

    group: object
    """The reward model's WorkerGroup (set up: it knows its DP size)."""
    micro_rows: int
    pad_token_id: int | None

    def score_rows(
        self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]
    ) -> tuple[list[float], float]:
        """(each row's raw score, seconds of the slowest rank) of prompt + response rows, any number of them: the
        rows are padded with copies of the last to a multiple of DP x micro-batch rows, whose scores are dropped.
        An empty response is scored at its prompt's last token, as in training."""
        rows = len(response_ids)
        if rows == 0:
            return [], 0.0
        multiple = self.group.dp_size * self.micro_rows
        pad = -rows % multiple
        prompts = [list(p) for p in prompt_ids] + [list(prompt_ids[-1])] * pad
        responses = [list(r) for r in response_ids] + [list(response_ids[-1])] * pad
        samples = [[RolloutSample(r, [0.0] * len(r), "stop")] for r in responses]
        batch = experience.make_batch(prompts, samples, 1, self.pad_token_id)
        got = self.group.compute_scores(batch.select(SCORE_KEYS))
        return got.tensor[:rows, 0].tolist(), got.seconds
