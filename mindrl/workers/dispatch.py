"""How a worker method is called on a group of ranks, declared where the method is defined (`@register`): what
each rank receives and what the driver gets back. `WorkerGroup` reads the declaration and builds the call."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class Dispatch(enum.Enum):
    ALL = "all"
    """Every rank, the same arguments; the driver gets the ranks' results as a list (rank order)."""
    PER_RANK = "per_rank"
    """Rank i gets the i-th of a list of argument tuples; the driver gets the ranks' results as a list."""
    DP_ROWS = "dp_rows"
    """Rows in, rows out: the first argument (a Batch) is cut into DP shards (`mindrl.batch.shard_rows`, by the
    method's `num_mini_batches` argument if it has one) sent to each DP group's source rank; the output ranks'
    `RowTensor`s are put back at their rows, one (rows, R) result for the batch."""
    DP_OUTPUT = "dp_output"
    """DP-sharded rows in as DP_ROWS; the result of DP group 0's output rank (the method returns the same on every
    DP rank, e.g. metrics reduced over DP)."""


DISPATCH_ATTR = "__mindrl_dispatch__"


def register(mode: Dispatch) -> Callable[[F], F]:
    """Declare how the worker method is dispatched and collected; the group's stub of the same name uses it."""

    def mark(fn: F) -> F:
        setattr(fn, DISPATCH_ATTR, mode)
        return fn

    return mark


def dispatch_mode(cls: type, name: str) -> Dispatch | None:
    """The mode `cls.name` was registered with; None for a method that was not (or no such method)."""
    return getattr(getattr(cls, name, None), DISPATCH_ATTR, None)
