"""The loop's experience: the RL batch built from a rollout (see `mindrl.batch`), and what the loop logs of it
(score, reward, advantage and length stats, the updates' token counts, the sampled rows)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mindrl.batch import Batch, pad_rows
from mindrl.trainer.metrics import stats_metrics
from mindrl.workers.results import LogprobDiff, Scores, TokenCounts

FORWARD_KEYS = ("input_ids", "attention_mask", "responses", "response_mask")
"""What the forward passes (old and reference logprobs, values) read."""
CRITIC_KEYS = (*FORWARD_KEYS, "values", "returns")
"""What the critic update reads."""


def actor_keys(batch: Batch) -> list[str]:
    """What the actor update reads: old_log_prob and ref_log_prob where the batch has them."""
    optional = [k for k in ("old_log_prob", "ref_log_prob") if k in batch]
    return [*FORWARD_KEYS, "rollout_log_prob", "advantages", *optional]


def make_batch(prompt_ids: list[list[int]], samples, n: int, pad_token_id: int | None) -> Batch:
    """The RL batch from prompts and their n samples each (`RolloutSample`s): rows grouped by prompt
    (`Batch.group_size` = n), rows_meta "uid" (the prompt's index), "response_ids" and "prompt_ids"."""
    rows_p, rows_r, rows_lp, uid = [], [], [], []
    for i, (p, group) in enumerate(zip(prompt_ids, samples)):
        if len(group) != n:
            raise RuntimeError(f"prompt {i}: the rollout returned {len(group)} samples, expected {n}")
        for s in group:
            rows_p.append(p)
            rows_r.append(list(s.token_ids) or [pad_token_id or 0])
            rows_lp.append(list(s.logprobs) or [0.0])
            uid.append(i)
    pad = pad_token_id if pad_token_id is not None else 0
    prompts, prompt_mask = pad_rows(rows_p, pad, left=True)
    responses, response_mask = pad_rows(rows_r, pad, left=False)
    for i, s in enumerate(g for group in samples for g in group):
        if not s.token_ids:  # an empty response: nothing to learn from
            response_mask[i] = 0
    rollout_lp = torch.zeros(responses.shape, dtype=torch.float32)
    for i, lp in enumerate(rows_lp):
        rollout_lp[i, : len(lp)] = torch.tensor(lp)
    return Batch(
        {
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "responses": responses,
            "response_mask": response_mask,
            "rollout_log_prob": rollout_lp * response_mask,
            "prompt_lengths": prompt_mask.sum(-1),
        },
        {"uid": uid, "response_ids": rows_r, "prompt_ids": rows_p},
        {"prompt_length": prompts.shape[1]},
        group_size=n,
    )


def row_labels(extras: dict, n: int, rows: int) -> list[list[int]]:
    """Each row's label token ids (its prompt's "labels", if the dataset has them; else empty)."""
    labels = [lab.tolist() for lab in extras.get("labels", [])]
    return [labels[i // n] for i in range(rows)] if labels else [[] for _ in range(rows)]


def _masked_stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return stats_metrics(prefix, values[mask.bool()])


def advantage_metrics(batch: Batch, scores: torch.Tensor, scored: Scores, verifier_names) -> dict[str, float]:
    """critic/score, rewards, advantages, returns (and values), the lengths, and the rule rewards' own metrics, of a
    batch that holds its token_level_rewards, advantages and returns."""
    mask = batch["response_mask"]
    metrics = stats_metrics("critic/score", scores)
    metrics.update(_masked_stats("critic/rewards", batch["token_level_rewards"].sum(-1), mask.sum(-1) > 0))
    metrics.update(_masked_stats("critic/advantages", batch["advantages"], mask))
    metrics.update(_masked_stats("critic/returns", batch["returns"], mask))
    if "values" in batch:
        metrics.update(_masked_stats("critic/values", batch["values"], mask))
    metrics.update(stats_metrics("response_length", mask.sum(-1)))
    metrics.update(stats_metrics("prompt_length", batch["prompt_lengths"]))
    metrics["reward/mean"] = scores.mean().item()
    if scored.model_scores is not None:
        metrics.update(stats_metrics("reward_model/score", scored.model_scores))
    for name in verifier_names:
        metrics[f"{name}_rewards/mean"] = scored.metrics.get(f"reward/{name}/mean", 0.0)
    for k in ("reward/timeouts", "reward/errors", "reward/crashes", "reward/worker_restarts"):
        metrics[k] = float(scored.metrics.get(k, 0.0))
    return metrics


def rollout_gap(batch: Batch) -> LogprobDiff:
    """|old_log_prob - rollout_log_prob| over the sampled tokens, and |sum of a response's differences| over the
    responses: the rollout-vs-trainer gap under the same weights, from the recomputed old logprobs."""
    mask = batch["response_mask"]
    signed = (batch["old_log_prob"] - batch["rollout_log_prob"]) * mask
    d = signed.abs()[mask.bool()]
    seq = signed.sum(-1).abs()[mask.sum(-1) > 0]
    return LogprobDiff(
        d.sum().item(), d.numel(), d.max().item() if d.numel() else 0.0,
        seq.sum().item(), seq.numel(), seq.max().item() if seq.numel() else 0.0,
    )  # fmt: skip


def token_metrics(role: str, counts: TokenCounts) -> dict[str, float]:
    """perf/* for the update's positions (see `mindrl.workers.rl_model._Plan`): the actor's unprefixed, the
    critic's as perf/critic_*. Its forward passes cut micro-batches the same way."""
    computed, real = counts.computed, counts.real
    prefix = "perf/" if role == "actor" else "perf/critic_"
    return {
        f"{prefix}computed_tokens": computed,
        f"{prefix}real_tokens": real,
        f"{prefix}untrimmed_tokens": counts.untrimmed,
        f"{prefix}shared_prompt_tokens": counts.shared,
        f"{prefix}padding_ratio": 1.0 - (real - counts.shared) / computed if computed else 0.0,
    }


def rollout_rows(batch: Batch, scored: Scores, tokenizer, verifier_names: Sequence[str]) -> list[dict]:
    """The sampled rows for rollouts.jsonl: prompt, response, label, reward (and each verifier's), length; with a
    reward model also its raw score; the prompt's and response's token ids and the rollout engine's logprob of each
    response token (what the reward model scored, and what the trainer's logprobs are compared against, offline)."""
    prompts = tokenizer.batch_decode(batch.rows_meta["prompt_ids"], skip_special_tokens=False)
    lengths = batch["response_mask"].sum(-1).tolist()
    rows = sample_rows(prompts, scored, lengths, verifier_names)
    rollout_lp = batch["rollout_log_prob"]
    for i, (row, p, r) in enumerate(zip(rows, batch.rows_meta["prompt_ids"], batch.rows_meta["response_ids"])):
        row["prompt_ids"], row["response_ids"] = [int(t) for t in p], [int(t) for t in r]
        row["rollout_log_prob"] = rollout_lp[i, : len(row["response_ids"])].tolist()
    return rows


def sample_rows(prompts: Sequence[str], scored: Scores, lengths: Sequence[int], verifier_names) -> list[dict]:
    """rollouts.jsonl rows from each row's prompt text, its Scores and its response length in tokens."""
    rows = []
    for i, text in enumerate(scored.texts):
        per = scored.per_verifier[i]
        row = {"prompt": prompts[i], "response": text, "label": scored.labels[i], "reward": scored.rewards[i]}
        row.update({name: (None if per is None else per[k]) for k, name in enumerate(verifier_names)})
        if scored.model_scores is not None:
            row["reward_model_score"] = scored.model_scores[i]
        row["response_length"] = int(lengths[i])
        rows.append(row)
    return rows
