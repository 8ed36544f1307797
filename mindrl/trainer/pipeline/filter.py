"""The filter layer: DAPO's dynamic sampling on the driver. Each generation batch of the schedule is scored and the
groups whose samples all score alike are dropped, until an iteration's train batch is full (`DynamicSampling`,
`KeptGroups`); and what it logs."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mindrl.algorithms import keep_groups
from mindrl.config.rl import SEQ_REWARD_METRIC
from mindrl.trainer import experience
from mindrl.trainer.experience import TrainingAborted
from mindrl.trainer.pipeline import Experience
from mindrl.trainer.pipeline.schedule import Generated, Schedule
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
    rows_meta: dict[str, list] = field(default_factory=dict)
    """Per kept row: the schedule's row metadata (bounded: weight_version, prompt_index, epoch)."""
    schedule_metrics: list[dict[str, float]] = field(default_factory=list)
    """Per generation batch: the schedule's metrics (bounded: async/*)."""
    gen_batches: int = 0
    generated_groups: int = 0
    filtered_groups: int = 0
    generated_reward_sum: float = 0.0
    """Sum of the shaped rewards of every generated response (trained or dropped)."""

    @property
    def num_groups(self) -> int:
        return len(self.prompt_ids)

    def add(self, gen: Generated, scored: Scores, metric: torch.Tensor, shaped: torch.Tensor, rows_out: list) -> None:
        """One generation batch `gen` (G prompts, G * n rows) with its rows' Scores, filter metric and shaped rewards
        (G * n,), and their rows for rollouts.jsonl (G * n)."""
        prompt_ids, samples, labels = gen.prompt_ids, gen.responses, gen.labels
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
        for k, v in gen.rows_meta.items():
            self.rows_meta.setdefault(k, []).extend(v[r] for r in rows)
        self.schedule_metrics.append(gen.metrics)

    def take(self, groups: int) -> tuple[Generated, Scores]:
        """The first `groups` kept groups (their rows' metadata; the schedule's metrics over every generation batch,
        `merge_metrics`), and the Scores of their rows: those of the trained rows, with the counters (timeouts, ...)
        and the scoring time of every generation batch."""
        rows = groups * self.n
        merged = _concat(self.scores)
        trained = _subset(merged, list(range(rows)), self.verifier_names)
        trained.metrics.update({k: merged.metrics[k] for k in _COUNTS if k in merged.metrics})
        meta = {k: v[:rows] for k, v in self.rows_meta.items()}
        gen = Generated(self.prompt_ids[:groups], self.samples[:groups], self.labels[:rows],
                        merge_metrics(self.schedule_metrics), meta)  # fmt: skip
        return gen, trained

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


class DynamicSampling:
    """Generation batches of the schedule (global_batch_size prompts each), each scored with `rewards`
    (`model_rewards.Rewards`), its groups whose samples all score the same on filter_groups_metric dropped, until
    train_batch_size groups are kept (the surplus of the last batch is dropped too). The prompt sampler advances once
    per generation batch, so a resume continues after the last one drawn."""

    def __init__(self, rl, n: int, verifier_names: Sequence[str], rewards, tokenizer,
                 enter_phase: Callable[[str, dict], None]):  # fmt: skip
        self.rl, self.n, self.names, self.rewards = rl, n, verifier_names, rewards
        self.tokenizer, self.enter_phase = tokenizer, enter_phase

    def fill(self, schedule: Schedule, iteration: int, timing: dict[str, float], make_batch) -> Experience:
        """Iteration `iteration`'s kept groups as Experience (scored, with the rows of the groups not trained on);
        `make_batch(Generated)` builds the RL batch."""
        rl, n, names = self.rl, self.n, self.names
        want, limit = rl.train_batch_size, rl.filter_groups_max_batches
        kept = KeptGroups(n, names)
        while kept.num_groups < want:
            if limit > 0 and kept.gen_batches >= limit:
                raise TrainingAborted(
                    f"iteration {iteration}: dynamic sampling kept {kept.num_groups} of the "
                    f"filter_groups_train_batch_size={want} prompts after rl_config.filter_groups_max_batches={limit} "
                    f"generation batches ({kept.filtered_groups} of {kept.generated_groups} groups scored alike on "
                    f"{rl.filter_groups_metric}); raise filter_groups_max_batches (<= 0: no limit) or use easier / "
                    "more varied prompts"
                )
            gen = schedule.next(iteration, kept.gen_batches, timing)
            pad = self.tokenizer.pad_token_id or 0
            responses = [list(s.token_ids) or [pad] for group in gen.responses for s in group]
            t0 = time.perf_counter()
            scored = self.rewards.client.collect(self.rewards.client.score(responses, gen.labels), iteration)
            timing["timing/non_overlap_rule_reward"] = (
                timing.get("timing/non_overlap_rule_reward", 0.0) + time.perf_counter() - t0
            )
            if self.rewards.scorer is not None:  # the filter sees the whole reward, the reward model's score mixed in
                self.enter_phase("score", timing)
                rows_prompts = [gen.prompt_ids[r // n] for r in range(len(responses))]
                raw, seconds = self.rewards.scorer.score_rows(rows_prompts,
                                                              [s.token_ids for g in gen.responses for s in g])  # fmt: skip
                timing["timing/reward_model"] = timing.get("timing/reward_model", 0.0) + seconds
                scored = self.rewards.mix(scored, raw)
            lengths = torch.tensor([len(s.token_ids) for group in gen.responses for s in group])
            shaped, _ = self.rewards.shaped(scored, lengths)
            metric = filter_metric(scored, shaped, rl.filter_groups_metric, names)
            texts = self.tokenizer.batch_decode(gen.prompt_ids, skip_special_tokens=False)
            rows = experience.sample_rows([texts[r // n] for r in range(len(responses))], scored, lengths.tolist(),
                                          names)  # fmt: skip
            kept.add(gen, scored, metric, shaped, rows)
        trained, scored = kept.take(want)
        timing["timing/rule_reward"] = scored.metrics.get("timing/rule_reward", 0.0)
        metrics = {**trained.metrics, **kept.metrics(want)}
        return Experience(make_batch(trained), trained.labels, metrics, scored, kept.dropped_rows(want))


def merge_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """A schedule's metrics over several generation batches: maxima (".../max") the largest, means (".../mean") the
    average over the batches, counts and seconds ("dropped", "_s") summed, the rest (a queue's depth, a rate) the
    last batch's."""
    out: dict[str, float] = {}
    for k in dict.fromkeys(k for p in parts for k in p):
        values = [p[k] for p in parts if k in p]
        if k.endswith("/max"):
            out[k] = max(values)
        elif k.endswith("/mean"):
            out[k] = sum(values) / len(values)
        elif "dropped" in k or k.endswith("_s"):
            out[k] = sum(values)
        else:
            out[k] = values[-1]
    return out


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
