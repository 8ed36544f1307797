"""Masked reductions over padded (batch, response_length) tensors.
Every PPO quantity is a statistic over valid tokens only; these are the one place that knows how."""

from __future__ import annotations

import torch


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming every argument when the given tensors do not share one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch, these must all be (batch, response_length): {listed}")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is 1. values, mask: same shape; mask is 0/1 (1 = valid)."""
    total = values * mask
    return total.sum() if dim is None else total.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is 1; 0 where nothing is valid (never NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all valid positions (a scalar). Unbiased uses count - 1; fewer than 2 valid
    positions give 0 rather than NaN/inf, so a degenerate batch cannot poison the whitening."""
    count = mask.sum()
    mean = masked_sum(values, mask) / count.clamp(min=1)
    sq = masked_sum((values - mean) ** 2, mask)
    denom = count - 1 if unbiased else count
    if denom <= 0:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return sq / denom


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) with mean and unbiased var over valid positions.

    values, mask: (batch, response_length). Masked positions are returned as 0.
    With shift_mean=False the mean is added back (scale only)."""
    check_same_shape(values=values, mask=mask)
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def last_valid_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of response_mask (batch, response_length) -> (batch,).

    Not mask.sum() - 1: with gaps (tool tokens masked mid-response) the two differ.
    Rows with no valid token give -1."""
    length = response_mask.shape[-1]
    positions = torch.arange(length, device=response_mask.device).expand_as(response_mask)
    marked = torch.where(response_mask.bool(), positions, torch.full_like(positions, -1))
    return marked.max(dim=-1).values


def scores_to_token_level(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score (batch,) on the last valid token of response_mask (batch, response_length).

    Rows without any valid token get no score (they contribute nothing to any loss)."""
    if scores.dim() != 1 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores must be (batch,) matching response_mask (batch, response_length); got scores="
            f"{tuple(scores.shape)}, response_mask={tuple(response_mask.shape)}"
        )
    token_level = torch.zeros(response_mask.shape, dtype=scores.dtype, device=scores.device)
    last = last_valid_index(response_mask)
    rows = torch.nonzero(last >= 0, as_tuple=True)[0]
    token_level[rows, last[rows]] = scores[rows]
    return token_level
