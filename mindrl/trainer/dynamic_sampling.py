"""DAPO's dynamic sampling on the driver: the groups of a generation batch that the filter keeps, gathered over
generation batches until an iteration's train batch is full (`KeptGroups`), and what it logs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mindrl.algorithms import keep_groups
from mindrl.config.rl import SEQ_REWARD_METRIC
from mindrl.workers.results import Scores

_COUNTS = ("reward/timeouts", "reward/errors", "reward/crashes", "reward/worker_restarts", "timing/rule_reward")


def filter_metric(scored: Scores, shaped: torch.Tensor, metric: str, verifier_names: Sequence[str]) -> torch.Tensor:
    """(rows,) what the filter compares: the verifier `metric`'s own score (0 where the sample was not scored, as
    its reward), or with 'seq_reward' the shaped reward (`shaped`: weighted verifiers, the reward model's weighted
    score where there is one, and the overlong penalty)."""
    if metric == SEQ_REWARD_METRIC:
        return shaped.double()
    k = list(verifier_names).index(metric)
    return torch.tensor([0.0 if per is None else float(per[k]) for per in scored.per_verifier], dtype=torch.float64)


@dataclass
class KeptGroups:
    """The groups kept so far in one iteration, in generation order, and the counts behind the dapo metrics."""

    n: int
    """Samples per prompt."""
    verifier_names: Sequence[str]
    prompt_ids: list[list[int]] = field(default_factory=list)
    samples: list[list] = field(default_factory=list)
    """Per kept prompt: its n `RolloutSample`s."""
    labels: list[list[int]] = field(default_factory=list)
    """Per kept row: its label's token ids."""
    scores: list[Scores] = field(default_factory=list)
    """Per generation batch: the Scores of its kept rows."""
    rows: list[dict] = field(default_factory=list)
    """Per kept row: its rollouts.jsonl row (those beyond the train batch are logged as surplus)."""
    filtered_rows: list[dict] = field(default_factory=list)
    """The rollouts.jsonl rows of the filtered groups."""
    gen_batches: int = 0
    generated_groups: int = 0
    filtered_groups: int = 0
    generated_reward_sum: float = 0.0
    """Sum of the shaped rewards of every generated response (trained or dropped)."""

    @property
    def num_groups(self) -> int:
        return len(self.prompt_ids)

    def add(
        self, prompt_ids, samples, labels, scored: Scores, metric: torch.Tensor, shaped: torch.Tensor, rows_out: list
    ) -> None:
        """One generation batch: prompts (G), their samples (G lists of n), row labels and Scores (G * n rows),
        the filter metric and the shaped rewards (G * n,), and the rows for rollouts.jsonl (G * n)."""
        keep = keep_groups(metric, self.n).tolist()
        self.generated_reward_sum += float(shaped.double().sum())
        self.gen_batches += 1
        self.generated_groups += len(keep)
        self.filtered_groups += keep.count(False)
        rows = [g * self.n + j for g, kept in enumerate(keep) if kept for j in range(self.n)]
        dropped = [g * self.n + j for g, kept in enumerate(keep) if not kept for j in range(self.n)]
        self.rows.extend(rows_out[r] for r in rows)
        self.filtered_rows.extend({**rows_out[r], "dynamic_sampling": "filtered"} for r in dropped)
        for g, kept in enumerate(keep):
            if kept:
                self.prompt_ids.append(prompt_ids[g])
                self.samples.append(samples[g])
        self.labels.extend(labels[r] for r in rows)
        self.scores.append(_subset(scored, rows, self.verifier_names))

    def take(self, groups: int) -> tuple[list[list[int]], list[list], list[list[int]], Scores]:
        """The first `groups` kept groups: (prompt ids, samples, row labels, Scores of their rows); the scores'
        metrics are those of the trained rows, with the counters (timeouts, ...) and the scoring time of every
        generation batch."""
        rows = groups * self.n
        merged = _concat(self.scores)
        trained = _subset(merged, list(range(rows)), self.verifier_names)
        trained.metrics.update({k: merged.metrics[k] for k in _COUNTS if k in merged.metrics})
        return self.prompt_ids[:groups], self.samples[:groups], self.labels[:rows], trained

    def dropped_rows(self, train_groups: int) -> list[dict]:
        """rollouts.jsonl rows of the groups not trained on: filtered ones, and kept ones beyond the train batch."""
        surplus = [{**row, "dynamic_sampling": "surplus"} for row in self.rows[train_groups * self.n :]]
        return self.filtered_rows + surplus

    def metrics(self, train_groups: int) -> dict[str, float]:
        """train/num_gen_batches (MindSpeed-RL's and verl's name) and the groups' fate over the iteration."""
        return {
            "train/num_gen_batches": float(self.gen_batches),
            "train/generated_groups": float(self.generated_groups),
            "train/filtered_groups": float(self.filtered_groups),
            "train/filtered_groups_ratio": self.filtered_groups / max(self.generated_groups, 1),
            "train/surplus_groups": float(max(self.num_groups - train_groups, 0)),
            "train/generated_reward_mean": self.generated_reward_sum / max(self.generated_groups * self.n, 1),
        }


def _subset(scored: Scores, rows: list[int], names: Sequence[str]) -> Scores:
    """The Scores of `rows` only; reward/<verifier>/mean recomputed over them, the counters kept."""
    per = [scored.per_verifier[r] for r in rows]
    metrics = {k: v for k, v in scored.metrics.items() if k in _COUNTS}
    for k, name in enumerate(names):
        done = [p[k] for p in per if p is not None]
        metrics[f"reward/{name}/mean"] = sum(done) / len(done) if done else 0.0
    rewards = [scored.rewards[r] for r in rows]
    metrics["reward/mean"] = sum(rewards) / len(rewards) if rewards else 0.0
    model = None if scored.model_scores is None else [scored.model_scores[r] for r in rows]
    return Scores(rewards, per, [scored.texts[r] for r in rows], [scored.labels[r] for r in rows], metrics, model)


def _concat(parts: Sequence[Scores]) -> Scores:
    metrics: dict[str, float] = {}
    for p in parts:
        for k in _COUNTS:
            if k in p.metrics:
                metrics[k] = metrics.get(k, 0.0) + p.metrics[k]
    return Scores(
        [r for p in parts for r in p.rewards],
        [v for p in parts for v in p.per_verifier],
        [t for p in parts for t in p.texts],
        [lab for p in parts for lab in p.labels],
        metrics,
        None if any(p.model_scores is None for p in parts) else [m for p in parts for m in p.model_scores],
    )
