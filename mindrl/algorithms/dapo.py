"""DAPO's reward shaping and batch filtering (Yu et al. 2025): the overlong penalty and the dynamic-sampling group
filter. Pure functions on per-response tensors."""

from __future__ import annotations

import torch


def overlong_penalty(
    response_lengths: torch.Tensor, max_tokens: int, buffer: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, (batch,) float: 0 up to max_tokens - buffer tokens, then falling linearly to
    -penalty_factor at max_tokens (and staying there beyond it).

    response_lengths: (batch,) generated tokens per response. penalty = min(-(L - (max_tokens - buffer)) / buffer *
    penalty_factor, 0), with the excess capped at buffer as MindSpeed-RL does."""
    if buffer < 1 or buffer >= max_tokens:
        raise ValueError(f"overlong buffer must be in [1, max_tokens={max_tokens}), got {buffer}")
    expected = max_tokens - buffer
    excess = (response_lengths.to(torch.float64) - expected).clamp(max=buffer)
    return (-excess / buffer * penalty_factor).clamp(max=0.0)


def keep_groups(metric: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic sampling's filter, (num_groups,) bool: a group of `group_size` consecutive responses is kept when its
    samples do not all score the same on `metric` (batch,), or when it has a single sample. "The same" is exact
    equality (max == min), not a std under rounding: n copies of 0.1 have a mean that is not 0.1 in floating point."""
    if metric.dim() != 1 or metric.numel() % group_size:
        raise ValueError(f"metric of shape {tuple(metric.shape)} does not split into groups of {group_size}")
    if group_size == 1:
        return torch.ones(metric.numel(), dtype=torch.bool)
    groups = metric.view(-1, group_size)
    return groups.amax(dim=1) > groups.amin(dim=1)
