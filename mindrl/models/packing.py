"""Rows packed into one row without padding (`PackedRows`): positions restarting per row, a block-diagonal causal
mask, the packed columns that predict each row's response tokens; and cutting rows into micro-batches by a token budget."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

_ROWS_ATTR = "_mindrl_packed_rows"


@dataclass(frozen=True)
class RowGroup:
    """Rows of similar length laid out as padded rows: `length` x `rows` slots, position-major (slot t * rows + j is
    the group's row j's token t)."""

    gather: torch.Tensor
    """[length * rows] the packed column behind each slot (a slot past its row's end: the row's first column)."""
    mask: torch.Tensor
    """[rows, 1, length, length] megatron's mask of the slots, True = hidden: causal within the row's tokens."""
    rows: int
    length: int


@dataclass(frozen=True)
class RowAttention:
    """A packed row's attention as groups of padded rows, for a core attention that reads it (`packed_rows_of`): the
    packed rows (each padding column a row of its own), longest first, in groups whose rows are at least half as
    long as the group's longest, so that padding at most quadruples a group's attention."""

    groups: tuple[RowGroup, ...]
    scatter: torch.Tensor
    """[s] the slot of each packed column in the groups' slots, one group after another."""


def packed_rows_of(mask: torch.Tensor | None) -> RowAttention | None:
    """The `RowAttention` marked on a packed row's full mask by `PackedRows.mask`, else None."""
    return getattr(mask, _ROWS_ATTR, None) if mask is not None else None


@dataclass(frozen=True)
class PackedRows:
    """The real tokens of `rows` RL rows (left-padded prompts of width P, right-padded responses of width R) one row
    after another in one packed row of `width` columns: `real` real tokens, then padding columns up to a multiple
    (sequence parallelism splits the packed row over TP). Each row keeps its own positions (0, 1, ... over its real
    tokens) and attends only to itself, causally: the padded rows' attention in the packed layout."""

    ids: torch.Tensor
    """[1, width] the packed token ids (0 on the padding columns)."""
    positions: torch.Tensor
    """[width] each column's position in its own row (0 on the padding columns)."""
    segments: torch.Tensor
    """[width] each column's row; the padding columns rows + 0, rows + 1, ... (each its own segment)."""
    sources: torch.Tensor
    """[rows * R] the packed column whose output predicts each row's response token t (row-major); one whose
    predicting column is padding points at column 0 (a padding token's output, which the caller masks out)."""
    rows: int
    response: int
    real: int

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    def mask(self) -> torch.Tensor:
        """megatron's boolean mask [1, 1, s, s], True = masked: a query sees the keys of its own row at or before its
        position (a padding column sees itself only); right for any core attention. Marked with its `RowAttention`,
        with which `SDPAttention` attends row by row instead, computing no score the mask would hide."""
        seg, pos = self.segments, self.positions
        seen = (seg.view(1, -1) == seg.view(-1, 1)) & (pos.view(1, -1) <= pos.view(-1, 1))
        mask = ~seen.view(1, 1, self.width, self.width)
        setattr(mask, _ROWS_ATTR, self.row_attention())
        return mask

    def row_attention(self) -> RowAttention:
        seg, pos, device = self.segments, self.positions, self.segments.device
        lengths = torch.bincount(seg)
        starts = lengths.cumsum(0) - lengths
        longest_first = sorted(range(len(lengths)), key=lambda r: -int(lengths[r]))
        members: list[list[int]] = []
        for r in longest_first:
            if members and 2 * int(lengths[r]) >= int(lengths[members[-1][0]]):
                members[-1].append(r)
            else:
                members.append([r])
        groups = []
        index_in_group, group_width, base = (torch.empty_like(lengths) for _ in range(3))
        offset = 0
        for rows in members:
            idx = torch.tensor(rows, device=device)
            n, length = len(rows), int(lengths[rows[0]])
            t = torch.arange(length, device=device).view(-1, 1)
            gather = (starts[idx].view(1, -1) + t * (t < lengths[idx].view(1, -1))).flatten()
            key = torch.arange(length, device=device)
            hidden = (key.view(1, -1) > key.view(-1, 1)).view(1, length, length) | (
                key.view(1, 1, -1) >= lengths[idx].view(-1, 1, 1)
            )
            groups.append(RowGroup(gather, hidden.view(n, 1, length, length), n, length))
            index_in_group[idx], group_width[idx], base[idx] = torch.arange(n, device=device), n, offset
            offset += n * length
        # packed column c (row r, position p) sits in slot base(r) + p * rows of r's group + r's index in it
        scatter = base[seg] + pos * group_width[seg] + index_in_group[seg]
        return RowAttention(tuple(groups), scatter)


def pack_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int, multiple: int = 1
) -> PackedRows:
    """`PackedRows` of rows (input_ids and attention_mask [rows, P + R], 1 = real token, P = prompt_width), the packed
    width rounded up to a multiple of `multiple`. The tokens keep their order; row i's response token t (column P + t)
    is predicted by the output at its column P + t - 1."""
    rows, s = input_ids.shape
    device = input_ids.device
    valid = attention_mask.bool()
    real = int(valid.sum())
    width = max(1, real + -real % multiple)
    pad = width - real
    where = torch.full((rows, s), -1, dtype=torch.long, device=device)
    where[valid] = torch.arange(real, device=device)
    sources = where[:, prompt_width - 1 : s - 1].clamp(min=0).flatten()
    own_positions = valid.long().cumsum(1) - 1
    zeros = torch.zeros(pad, dtype=torch.long, device=device)
    row_of = torch.arange(rows, device=device).view(-1, 1).expand(rows, s)
    return PackedRows(
        ids=torch.cat([input_ids[valid], zeros.to(input_ids.dtype)]).view(1, width),
        positions=torch.cat([own_positions[valid], zeros]),
        segments=torch.cat([row_of[valid], rows + torch.arange(pad, device=device)]),
        sources=sources,
        rows=rows,
        response=s - prompt_width,
        real=real,
    )


def cut_by_budget(
    order: Sequence[int], cost: Callable[[list[int]], int], budget: int, max_rows: int | None = None
) -> list[list[int]]:
    """Rows (in `order`, longest first) cut into micro-batches whose cost (`cost(rows)`: the tokens the model computes
    on them) stays within `budget`, with at most `max_rows` rows each: first fit, each row into the first micro-batch
    it fits in. A row over the budget on its own gets a micro-batch of its own (as MindSpeed-RL does; the config
    checks that no row can be, see rl_config.max_packing_token_size)."""
    bins: list[list[int]] = []
    for row in order:
        for rows in bins:
            if (max_rows is None or len(rows) < max_rows) and cost([*rows, row]) <= budget:
                rows.append(row)
                break
        else:
            bins.append([row])
    return bins
