"""PPO actor/critic losses, entropy, and the loss aggregation that keeps micro-batching exact.
All inputs are (batch, response_length) with a 0/1 response_mask unless stated; metrics are detached."""

from __future__ import annotations

import torch

from mindrl.algorithms.masked import check_same_shape, masked_mean, masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSS_MODES = ("vanilla", "gspo")
"""rl_config.policy_loss_mode: PPO's token-level ratio (`policy_loss`) or GSPO's sequence-level one (`gspo_policy_loss`)."""


def count_tokens_and_seqs(response_mask: torch.Tensor) -> tuple[int, int]:
    """(valid tokens, sequences with at least one valid token) of a (batch, response_length) mask.

    Sum these over every micro-batch of a mini-batch (and all-reduce over data-parallel ranks) and pass
    them to `agg_loss` as global_num_tokens / global_num_seqs to make the split exact."""
    return int(response_mask.sum().item()), int((response_mask.sum(dim=-1) > 0).sum().item())


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """Reduce a per-token loss (batch, response_length) to a scalar over positions where loss_mask is 1.

    Modes:
      token-mean               sum of all valid token losses / number of valid tokens
      seq-mean-token-sum       per sequence: sum over its tokens; then mean over sequences
      seq-mean-token-mean      per sequence: mean over its tokens; then mean over sequences
      seq-mean-token-sum-norm  per sequence: sum / loss_scale_factor (default response_length, a
                               constant as Dr.GRPO asks); then mean over sequences
    Sequences without any valid token are not counted.

    Without the global_* arguments the denominators are local to this tensor. When a mini-batch is
    split into micro-batches or data-parallel ranks, pass the mini-batch totals (see
    `count_tokens_and_seqs`) so that the sum of the micro-batch losses equals the one-big-batch loss;
    dp_size multiplies the result because data-parallel gradient reduction averages over ranks.
    """
    check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    mask = loss_mask.to(loss_mat.dtype)
    has_tokens = (mask.sum(dim=-1) > 0).to(loss_mat.dtype)
    num_seqs = global_num_seqs if global_num_seqs is not None else has_tokens.sum().clamp(min=1)
    if loss_agg_mode == "token-mean":
        num_tokens = global_num_tokens if global_num_tokens is not None else mask.sum().clamp(min=1)
        loss = masked_sum(loss_mat, mask) / num_tokens
    elif loss_agg_mode == "seq-mean-token-sum":
        loss = masked_sum(loss_mat, mask, dim=-1).sum() / num_seqs
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_means = masked_sum(loss_mat, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)
        loss = (seq_means * has_tokens).sum() / num_seqs
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        scale = loss_scale_factor if loss_scale_factor is not None else loss_mat.shape[-1]
        loss = masked_sum(loss_mat, mask) / (scale * num_seqs)
    else:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known: {', '.join(LOSS_AGG_MODES)}")
    return loss * dp_size


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017), to be minimised.

    old_log_prob, log_prob, advantages, response_mask: (batch, response_length).
    ratio = exp(log_prob - old_log_prob); per token: max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high)).
    clip_ratio_high > clip_ratio_low is DAPO's clip-higher. clip_ratio_c > 1 enables dual-clip
    (Ye et al. 2020): for A < 0 the loss is also capped at -A * clip_ratio_c.
    is_weights: (batch, response_length) per-token importance weights multiplied into the clipped loss, e.g.
    truncated importance sampling min(pi_old / pi_rollout, C) for the rollout/trainer mismatch (no gradient).
    agg_kwargs (global_num_tokens, global_num_seqs, loss_scale_factor, dp_size) go to `agg_loss`.

    metrics: pg_clipfrac (share of valid tokens where the clip was the active term), pg_clipfrac_lower
    (share where the dual-clip cap was active), ppo_kl (mean of old_log_prob - log_prob, the k1 KL).
    """
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip (or None to disable), got {clip_ratio_c}")
    negative_approx_kl = log_prob - old_log_prob
    # exp of an unbounded log-ratio can overflow to inf and then NaN the whole batch; +-20 is far outside any clip range
    ratio = torch.exp(negative_approx_kl.clamp(min=-20.0, max=20.0))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).float(), response_mask)
    if clip_ratio_c is not None:
        pg_losses3 = -advantages * clip_ratio_c
        dual = torch.minimum(clipped, pg_losses3)
        lower_active = (clipped > pg_losses3) & (advantages < 0)
        pg_losses = torch.where(advantages < 0, dual, clipped)
    else:
        lower_active = torch.zeros_like(clipped, dtype=torch.bool)
        pg_losses = clipped
    if is_weights is not None:
        check_same_shape(is_weights=is_weights, response_mask=response_mask)
        pg_losses = pg_losses * is_weights.detach()
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    metrics = {
        "pg_clipfrac": pg_clipfrac.detach(),
        "pg_clipfrac_lower": masked_mean(lower_active.float(), response_mask).detach(),
        "ppo_kl": masked_mean(-negative_approx_kl, response_mask).detach(),
    }
    return loss, metrics


def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    is_weights: torch.Tensor | None = None,
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): the PPO clip on the sequence-level importance ratio, to be minimised.

    Inputs as `policy_loss`. Per response i: s_i = exp(mean over its valid tokens of (log_prob - old_log_prob)),
    loss_i = max(-A_i * s_i, -A_i * clip(s_i, 1 - low, 1 + high)), and the loss is the mean over responses
    (seq-mean-token-mean: every token of a response carries loss_i, whatever loss_agg_mode says). The gradient of
    s_i is s_i times the mean of the tokens' log-prob gradients (the paper's), obtained by giving each token the
    ratio sg(s_i) * pi / sg(pi). The log-ratio is capped at 10 before exp. agg_kwargs: `agg_loss`'s global counts
    (global_num_seqs, dp_size; the others are unused here).

    metrics: pg_clipfrac (share of valid tokens, i.e. length-weighted, whose response was clipped),
    pg_clipfrac_lower (0: no dual clip), ppo_kl (mean of old_log_prob - log_prob over valid tokens)."""
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    mask = response_mask.to(log_prob.dtype)
    negative_approx_kl = log_prob - old_log_prob
    lengths = mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (negative_approx_kl * mask).sum(dim=-1) / lengths
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(log_ratio.clamp(max=10.0))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if is_weights is not None:
        check_same_shape(is_weights=is_weights, response_mask=response_mask)
        pg_losses = pg_losses * is_weights.detach()
    agg = {k: v for k, v in agg_kwargs.items() if k in ("global_num_seqs", "dp_size")}
    loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **agg)
    metrics = {
        "pg_clipfrac": masked_mean((pg_losses2 > pg_losses1).float(), response_mask).detach(),
        "pg_clipfrac_lower": torch.zeros((), dtype=log_prob.dtype, device=log_prob.device),
        "ppo_kl": masked_mean(-negative_approx_kl, response_mask).detach(),
    }
    return loss, metrics


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * max((v - R)^2, (clip(v, V - c, V + c) - R)^2).

    vpreds (new critic output), returns (targets), values (critic output at rollout time), response_mask:
    (batch, response_length). cliprange_value=None disables the clip. metrics: vf_clipfrac (share of
    valid tokens where the clipped term was larger).
    """
    check_same_shape(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    vf_losses1 = (vpreds - returns) ** 2
    if cliprange_value is None:
        vf_losses = vf_losses1
        vf_clipfrac = torch.zeros((), dtype=vpreds.dtype, device=vpreds.device)
    else:
        # clamp(v, V - c, V + c), not V + clamp(v - V, -c, c): inside the range it is v itself, so both terms are
        # equal there and the token does not count as clipped (V + (v - V) can round 1 ulp away from v, and then
        # the "clipped" term wins by rounding alone). The gradient is the same: v's where it is inside, none outside.
        vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        vf_losses2 = (vpredclipped - returns) ** 2
        vf_losses = torch.maximum(vf_losses1, vf_losses2)
        vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), response_mask)
    loss = 0.5 * agg_loss(vf_losses, response_mask, loss_agg_mode, **agg_kwargs)
    return loss, {"vf_clipfrac": vf_clipfrac.detach()}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: (batch, response_length, vocab) -> (batch, response_length).

    H = logsumexp(z) - sum(softmax(z) * z), which avoids materialising log_softmax."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels) under softmax(logits): logits (batch, response_length, vocab), labels (batch, response_length)."""
    picked = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", **agg_kwargs
) -> torch.Tensor:
    """Aggregated entropy of the policy; the actor subtracts entropy_coeff * this from its loss."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, **agg_kwargs)
