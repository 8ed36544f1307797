"""The loop's experience: the RL batch built from a rollout (see `mindrl.batch`), and what the loop logs of it
(score, reward, advantage and length stats, the updates' token counts, the sampled rows)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mindrl.algorithms import apply_kl_penalty, get_advantage_estimator, scores_to_token_level
from mindrl.batch import Batch, pad_rows
from mindrl.trainer.metrics import stats_metrics
from mindrl.workers.results import LogprobDiff, Scores, TokenCounts


class TrainingAborted(RuntimeError):
    """The run cannot continue (e.g. too many consecutive non-finite updates, a worker died)."""


FORWARD_KEYS = ("input_ids", "attention_mask", "responses", "response_mask")
"""What the forward passes (old and reference logprobs, values) read."""
CRITIC_KEYS = (*FORWARD_KEYS, "values", "returns")
"""What the critic update reads."""


def actor_keys(batch: Batch) -> list[str]:
    """What the actor update reads: old_log_prob, ref_log_prob and routed_experts where the batch has them."""
    optional = [k for k in ("old_log_prob", "ref_log_prob", "routed_experts") if k in batch]
    return [*FORWARD_KEYS, "rollout_log_prob", "advantages", *optional]


@dataclass
class Response:
    """One response as the trainer learns from it: its tokens with the behaviour logprob and the weight version of
    each, and which of them are trained on."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[int] = field(default_factory=list)
    """The weight version (updates applied) that sampled each token."""
    loss_mask: list[int] | None = None
    """Per token 1 where the policy generated it (trained on), 0 where it is context the policy did not write (an
    agent loop's tool observations): out of the loss, the advantages' token counts and the rollout logprob check.
    None: every token is the policy's (one turn)."""
    ref_logprobs: list[float] | None = None
    """Reference logprobs of each token, where a sampler computed them (async_sampler_ref)."""


def stamp(groups, version: int) -> list[list[Response]]:
    """`groups` (per prompt, its responses: `Response`s or the engine's `RolloutSample`s) as Responses whose every
    token was sampled with weight version `version`."""
    return [[Response(list(s.token_ids), list(s.logprobs), s.finish_reason, [version] * len(s.token_ids),
                      getattr(s, "loss_mask", None)) for s in g] for g in groups]  # fmt: skip


def make_batch(prompt_ids: list[list[int]], samples, n: int, pad_token_id: int | None) -> Batch:
    """The RL batch from prompts and their n samples each (`Response`s, or `RolloutSample`s: every token trained on):
    rows grouped by prompt (`Batch.group_size` = n), rows_meta "uid" (the prompt's index), "response_ids",
    "prompt_ids" and, where every response has them, "rollout_versions" (per token). "response_mask" is the loss
    mask: the tokens trained on; "attention_mask" covers every token of the context."""
    rows_p, rows_r, rows_lp, rows_loss, uid = [], [], [], [], []
    for i, (p, group) in enumerate(zip(prompt_ids, samples)):
        if len(group) != n:
            raise RuntimeError(f"prompt {i}: the rollout returned {len(group)} samples, expected {n}")
        for s in group:
            rows_p.append(p)
            rows_r.append(list(s.token_ids) or [pad_token_id or 0])
            rows_lp.append(list(s.logprobs) or [0.0])
            rows_loss.append(getattr(s, "loss_mask", None))
            uid.append(i)
    rows = [s for group in samples for s in group]
    pad = pad_token_id if pad_token_id is not None else 0
    prompts, prompt_mask = pad_rows(rows_p, pad, left=True)
    responses, present = pad_rows(rows_r, pad, left=False)
    for i, s in enumerate(rows):
        if not s.token_ids:  # an empty response: nothing to learn from
            present[i] = 0
    response_mask = present.clone()
    for i, loss in enumerate(rows_loss):
        if loss is not None:
            response_mask[i, : len(loss)] *= torch.tensor(loss, dtype=response_mask.dtype)
    rollout_lp = torch.zeros(responses.shape, dtype=torch.float32)
    for i, lp in enumerate(rows_lp):
        rollout_lp[i, : len(lp)] = torch.tensor(lp)
    rows_meta = {"uid": uid, "response_ids": rows_r, "prompt_ids": rows_p}
    if rows and all(getattr(s, "versions", None) for s in rows if s.token_ids):
        rows_meta["rollout_versions"] = [list(getattr(s, "versions", [])) for s in rows]
    batch = Batch(
        {
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, present], dim=1),
            "responses": responses,
            "response_mask": response_mask,
            "rollout_log_prob": rollout_lp * response_mask,
            "prompt_lengths": prompt_mask.sum(-1),
        },
        rows_meta,
        {"prompt_length": prompts.shape[1]},
        group_size=n,
    )
    if rows and all(getattr(s, "ref_logprobs", None) is not None for s in rows):
        ref = torch.zeros_like(rollout_lp)
        for i, s in enumerate(rows):
            ref[i, : len(s.ref_logprobs)] = torch.tensor(s.ref_logprobs, dtype=torch.float32)
        batch["ref_log_prob"] = ref * response_mask
    return batch


def advantages(batch: Batch, scores: torch.Tensor, penalty: torch.Tensor | None, rl, kl_ctrl) -> dict[str, float]:
    """token_level_scores (each response's score `scores` (rows,) on its last trained token), token_level_rewards
    (with the KL penalty where rl_config puts it in the reward and `kl_ctrl` is the run's KL controller, updated
    here; None: no reference model), advantages and returns by rl_config.adv_estimator into `batch`; returns their
    metrics, with the overlong `penalty` (rows,) (None: off)'s. Every token count is the loss mask's."""
    mask = batch["response_mask"]
    token_scores = scores_to_token_level(scores, mask)
    metrics: dict[str, float] = {}
    if penalty is not None:
        metrics["reward/overlong_penalty"] = penalty.mean().item()
        metrics["reward/overlong_ratio"] = (penalty < 0).float().mean().item()
    if rl.kl_in_reward and kl_ctrl is not None:
        old = batch["old_log_prob"] if "old_log_prob" in batch else batch["rollout_log_prob"]
        rewards, kl_metrics = apply_kl_penalty(
            token_scores, old, batch["ref_log_prob"], mask, kl_ctrl.value, rl.kl_penalty
        )
        kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=len(batch))
        metrics.update(kl_metrics)
    else:
        rewards = token_scores
    estimator = get_advantage_estimator(rl.adv_estimator)
    available = {"gamma": rl.gamma, "lam": rl.lam, "index": batch.rows_meta["uid"],
                 "norm_adv_by_std": rl.norm_adv_by_std_in_grpo}  # fmt: skip
    if "values" in batch:
        available["values"] = batch["values"]
    wanted = inspect.signature(estimator).parameters
    adv, ret = estimator(rewards, response_mask=mask, **{k: v for k, v in available.items() if k in wanted})
    batch["token_level_scores"] = token_scores
    batch["token_level_rewards"] = rewards
    batch["advantages"] = adv
    batch["returns"] = ret
    return metrics


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
