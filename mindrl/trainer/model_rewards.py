"""The reward model outside the scoring phase: scores of any rows (dynamic sampling's generation batches, the held-out
evaluation's responses), padded to the reward model's DP x micro-batch and cut back. See docs/reward_model.md."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mindrl.rollout.base import RolloutSample
from mindrl.trainer import experience
from mindrl.workers.reward_worker import SCORE_KEYS


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
