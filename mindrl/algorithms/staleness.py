"""Off-policy correction for stale experiences: the truncated importance ratio between the trainer's proximal
policy and the behaviour policy that sampled a response, and staleness statistics. Pure tensor math."""

from __future__ import annotations

import torch

from mindrl.algorithms.masked import check_same_shape

MAX_LOG_RATIO = 20.0
"""exp of an unbounded log-ratio overflows; any threshold in use is far below exp(20)."""


def truncated_importance_ratio(
    log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token min(pi(y_t) / mu(y_t), threshold), 0 on padding; no gradient flows through it.

    log_prob: (batch, response_length) log pi under the policy the update is anchored to (the proximal /
    "old" policy of decoupled PPO, or the current one). behaviour_log_prob: (batch, response_length) log mu
    under the weights that sampled the response (the experience's behaviour logprobs). response_mask: 0/1.
    The result multiplies the clipped surrogate (`policy_loss(..., is_weights=...)`), as in truncated
    importance sampling (TIS) and AReaL's decoupled PPO.

    metrics: is_ratio_mean (over valid tokens, before truncation), is_truncated_frac (share of valid tokens
    at the threshold)."""
    check_same_shape(log_prob=log_prob, behaviour_log_prob=behaviour_log_prob, response_mask=response_mask)
    if not threshold > 0:
        raise ValueError(f"the importance-ratio threshold must be positive, got {threshold}")
    with torch.no_grad():
        log_ratio = (log_prob - behaviour_log_prob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        ratio = torch.exp(log_ratio)
        mask = response_mask.to(ratio.dtype)
        weights = ratio.clamp(max=threshold) * mask
        count = mask.sum().clamp(min=1)
        metrics = {
            "is_ratio_mean": (ratio * mask).sum() / count,
            "is_truncated_frac": ((ratio >= threshold).to(ratio.dtype) * mask).sum() / count,
        }
    return weights, metrics


def staleness(trainer_version: int, weight_versions: torch.Tensor) -> torch.Tensor:
    """Per-experience staleness in weight versions: trainer_version - weight_versions (batch,), never negative
    (a version from the future is a bug upstream and raises)."""
    lag = trainer_version - weight_versions
    if (lag < 0).any():
        raise ValueError(
            f"an experience claims weight version {int(weight_versions.max())}, newer than the trainer's {trainer_version}"
        )
    return lag


def keep_fresh(trainer_version: int, weight_versions: torch.Tensor, max_staleness: int) -> torch.Tensor:
    """(batch,) bool: experiences at most `max_staleness` versions old (the rest are dropped as stale)."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return staleness(trainer_version, weight_versions) <= max_staleness
