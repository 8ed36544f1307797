"""Context parallelism (megatron_cp_algo): each row's columns split over the CP group in megatron's load-balanced
chunks, K/V all-gathered for attention, per-token outputs gathered back to full rows (docs/parallelism.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps


def cp_size() -> int:
    return ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1


@dataclass(frozen=True)
class CPSplit:
    """A row of `width` columns over `size` CP ranks: 2 x size chunks of width / (2 size); rank r keeps chunks r and
    2 size - 1 - r (megatron's load balancing: every rank gets as many causal scores), in that order."""

    width: int
    size: int
    rank: int

    def __post_init__(self):
        if self.width % (2 * self.size):
            raise ValueError(
                f"a row of {self.width} columns does not split into 2 x {self.size} context-parallel chunks"
            )

    def columns(self, rank: int | None = None, device=None) -> torch.Tensor:
        """[width / size] the global columns rank `rank` (default: this one) holds, in its local order."""
        r = self.rank if rank is None else rank
        c = self.width // (2 * self.size)
        first = torch.arange(r * c, (r + 1) * c)
        second = torch.arange((2 * self.size - 1 - r) * c, (2 * self.size - r) * c)
        return torch.cat([first, second]).to(device)

    def gathered(self, device=None) -> torch.Tensor:
        """[width] the global column behind each position of an all-gather over the group (ranks' columns in turn)."""
        return torch.cat([self.columns(r, device) for r in range(self.size)])

    def local(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's columns of `t` along `dim`."""
        return t.index_select(dim, self.columns(device=t.device))

    def local_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """megatron's full mask [b, 1, s, s] -> [b, 1, s / size, s]: this rank's queries over the keys in gathered
        order (the K/V all-gather's order, so attention needs no reordering)."""
        rows = mask.index_select(2, self.columns(device=mask.device))
        return rows.index_select(3, self.gathered(mask.device))

    def full(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's columns along `dim` -> the full row in natural order, on every rank. Every rank then computes
        the same loss on the full rows, so backward keeps this rank's columns of the gradient without summing them
        over the group (megatron's schedule multiplies the loss by CP, and its DDP averages over DP x CP)."""
        gathered = _GatherCP.apply(local.movedim(dim, 0), False).movedim(0, dim)
        inverse = torch.empty(self.width, dtype=torch.long, device=local.device)
        inverse[self.gathered(local.device)] = torch.arange(self.width, device=local.device)
        return gathered.index_select(dim, inverse)


class _GatherCP(torch.autograd.Function):
    """All-gather over the CP group along dim 0 (ranks in turn). Backward: reduce-scatter (sum the ranks' gradients,
    keep this rank's part), or with reduce False this rank's part of its own gradient."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, reduce: bool):
        group, n = ps.get_context_parallel_group(), ps.get_context_parallel_world_size()
        ctx.reduce = reduce
        t = t.contiguous()
        out = t.new_empty(n * t.shape[0], *t.shape[1:])
        torch.distributed.all_gather_into_tensor(out, t, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, n = ps.get_context_parallel_group(), ps.get_context_parallel_world_size()
        if not ctx.reduce:
            return grad.chunk(n)[ps.get_context_parallel_rank()].contiguous(), None
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[0] // n, *grad.shape[1:])
        torch.distributed.reduce_scatter_tensor(out, grad, group=group)
        return out, None


def gather_along(t: torch.Tensor, dim: int) -> torch.Tensor:
    """All-gather `t` over the CP group along `dim` (ranks in turn); backward reduce-scatters its gradient (K/V: each
    rank's keys get the gradients of every rank's queries)."""
    return _GatherCP.apply(t.movedim(dim, 0), True).movedim(0, dim)
