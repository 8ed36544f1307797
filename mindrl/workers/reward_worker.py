"""RewardWorker: a reward model (a value-head checkpoint) run forward only, a process per device on the actor's bundles
with its own megatron world and TP x PP; its weights on the device only while scoring. Score: docs/reward_model.md."""

from __future__ import annotations

import time

import torch

from mindrl.batch import Batch
from mindrl.workers.dispatch import Dispatch, register
from mindrl.workers.rank import MegatronRank, RankInfo
from mindrl.workers.results import RowTensor
from mindrl.workers.settings import MicroBatching, RewardModelSettings

SCORE_KEYS = ("input_ids", "attention_mask", "responses", "response_mask")
"""What `last_token_scores` reads."""


class RewardScores(RowTensor):
    """(rows, 1) the reward model's score of each response: its value at the response's last token."""


def scoring_batch(batch: Batch) -> tuple[Batch, torch.Tensor]:
    """(`batch` with one more response column, each row's response length L). In the new batch row i's response
    mask also covers column L (a pad token there, attended to): the value "before" response position L is then the
    model's output at the last response token (P + L - 1), which nothing after it can change (causal attention)."""
    width = batch["responses"].shape[1]
    mask = batch["attention_mask"][:, -width:]  # every response token, trained on or not (an agent's observations)
    rows = mask.shape[0]
    lengths = mask.sum(-1).long()
    extended = torch.cat([mask, torch.zeros(rows, 1, dtype=mask.dtype)], dim=1)
    extended[torch.arange(rows), lengths] = 1
    pad = torch.zeros(rows, 1, dtype=batch["responses"].dtype)
    prompt_width = batch["input_ids"].shape[1] - width
    out = Batch(
        {
            "input_ids": torch.cat([batch["input_ids"], pad], dim=1),
            "attention_mask": torch.cat([batch["attention_mask"][:, :prompt_width], extended], dim=1),
            "responses": torch.cat([batch["responses"], pad], dim=1),
            "response_mask": extended,
        },
        meta=dict(batch.meta),
        group_size=batch.group_size,
    )
    return out, lengths


@torch.no_grad()
def last_token_scores(model, batch: Batch, micro: int | MicroBatching) -> torch.Tensor | None:
    """(rows,) the value model's output at each row's last response token (a row without response tokens: at its
    last prompt token); None off the last pipeline stage. Collective over the model's world."""
    from mindrl.workers.rl_model import response_values

    extended, lengths = scoring_batch(batch.select(SCORE_KEYS))
    values = response_values(model, extended, micro)
    return None if values is None else values.gather(1, lengths.view(-1, 1)).squeeze(1)


class RewardWorker(MegatronRank):
    def setup(self, s: RewardModelSettings) -> RankInfo:
        from mindrl.checkpoint.loading import build_and_load
        from mindrl.resharding import OffloadConfig, TrainStateOffloader
        from mindrl.workers.profiling import StageProfiler

        self.settings = s
        self.profiler = StageProfiler(s.profile, self.rank)
        info = self.init_layout(s.tp, s.pp, s.seed)
        _, _, self.model = build_and_load(s.load, s.tp, s.pp, s.dtype)
        if getattr(self.model, "mindrl_role", None) != "critic":
            raise ValueError(
                f"reward_config.load {s.load!r} holds an actor (LM head), not a reward model: convert the "
                "*ForSequenceClassification checkpoint with `mindrl-convert hf2mcore --orm`"
            )
        self.model.eval()
        self.offloader = TrainStateOffloader([self.model], None, OffloadConfig(offload_train_param=True))
        self.offloader.place(s.residency.on_entry("reward", "rollout"))
        return info

    def _offloaders(self) -> dict:
        return {"reward": self.offloader}

    @register(Dispatch.DP_ROWS)
    def compute_scores(self, shard: Batch | None) -> RewardScores | None:
        """This DP shard's reward-model scores, (shard rows, 1)."""
        shard = self.receive(shard)
        t0 = time.perf_counter()
        with self.profiler.stage("reward_compute_scores"), self.offloader.holding(["param"], read_only=True):
            scores = last_token_scores(self.model, shard, self.settings.micro_batching)
            self._note_held()
        out = None if scores is None else RewardScores(scores.view(-1, 1), time.perf_counter() - t0)
        return self.output(out)
