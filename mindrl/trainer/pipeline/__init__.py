"""The experience pipeline: the trainer asks `Pipeline.next` for an iteration's batch of experience and never learns
which mode made it. Four layers, each behind one small interface (docs/architecture.md):

- engine (`engines`): who samples tokens: the integrated workers' engines, an engine group, rollout servers, or
  (bounded) sampler processes;
- episode (`episode.Episode`): how a prompt becomes responses: one turn, or the agent loop (`agent_loop`);
- schedule (`schedule.Schedule`): when each generation batch is sampled relative to the updates: sync,
  one_step_off, bounded, partial;
- filter (`filter.DynamicSampling`, optional): which generated groups are trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindrl.batch import Batch
from mindrl.trainer import experience
from mindrl.trainer.pipeline.schedule import Generated, Schedule
from mindrl.workers.results import Scores


@dataclass
class Experience:
    """An iteration's batch of experience, whatever produced it."""

    batch: Batch
    """The RL batch (`experience.make_batch`): tokens, the loss mask ("response_mask"), behaviour logprobs; rows_meta
    with the weight version of each token ("rollout_versions")."""
    labels: list[list[int]]
    """Per row, its prompt's label token ids."""
    metrics: dict[str, float]
    """What the schedule and the filter did (async/*, partial_rollout/*, train/* of dynamic sampling)."""
    scored: Scores | None = None
    """The rule rewards (with the reward model's mixed in), where the filter scored them already."""
    untrained_rows: list[dict] | None = None
    """With a filter: the rollouts.jsonl rows of the generated groups not trained on."""

    def log_rows(self, rows: list[dict]) -> list[dict]:
        """rollouts.jsonl rows of the batch, tagged with where each came from: a sampler's prompt index and ledger
        epoch (bounded), and with a filter the fate of every generated group."""
        if "epoch" in self.batch.rows_meta:
            meta = self.batch.rows_meta
            for row, prompt, epoch in zip(rows, meta["prompt_index"], meta["epoch"]):
                row["prompt_index"], row["epoch"] = int(prompt), int(epoch)
        if self.untrained_rows is None:
            return rows
        return [{**row, "dynamic_sampling": "trained"} for row in rows] + self.untrained_rows


class Pipeline:
    """A schedule's generation batches, through the filter if there is one, as `Experience`."""

    def __init__(self, schedule: Schedule, n: int, pad_token_id: int | None, keep=None, episode=None):
        self.schedule, self.n, self.pad, self.keep = schedule, n, pad_token_id, keep
        self.episode = episode
        """The trainer's episode (`episode.Episode`), which the evaluation runs too; None where the trainer samples
        nothing itself (bounded)."""

    def next(self, iteration: int, timing: dict[str, float]) -> Experience:
        """The batch iteration `iteration` trains (the weights hold iteration - 1 updates); the rollout's timings
        added to `timing`."""
        if self.keep is not None:
            return self.keep.fill(self.schedule, iteration, timing, self.batch)
        gen = self.schedule.next(iteration, 0, timing)
        return Experience(self.batch(gen), gen.labels, gen.metrics)

    def batch(self, gen: Generated) -> Batch:
        out = experience.make_batch(gen.prompt_ids, gen.responses, self.n, self.pad)
        out.rows_meta.update(gen.rows_meta)
        return out

    def after_update(self, iteration: int, timing: dict[str, float]) -> None:
        """The weights now hold `iteration` updates."""
        self.schedule.after_update(iteration, timing)

    def state_dict(self) -> dict:
        """TrainerState fields of what is in flight."""
        return self.schedule.state_dict()

    def load_state_dict(self, state, iteration: int) -> None:
        self.schedule.load_state_dict(state, iteration)

    def close(self) -> None:
        self.schedule.close()
