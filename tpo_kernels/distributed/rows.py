"""What a trainer adapter exchanges over its data-parallel ranks, through the counted collectives.

A trainer that splits a step's groups over ranks needs, besides the loss's own gathers, a few
things of its own: every rank's per-completion rows (a record of a mini-batch, the groups of a
micro-step to check, a metrics table), sums over the ranks (counts, a controller's statistics) and
a mean over every rank's counted tokens (an entropy bonus). All go through :func:`~tpo_kernels.distributed.collectives.all_gather_stacked` and
:func:`~tpo_kernels.distributed.collectives.all_reduce_sum`, so :func:`count_collectives` logs
them with the loss's own; none pickles. The integration kit (:mod:`tpo_kernels.kit`) exports
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import all_gather_ragged, all_gather_stacked, all_reduce_sum


@dataclass(frozen=True)
class RowGather:
    """Every rank's rows, in group rank order. ``rows``: ``[sum N_r, ...]``; ``sizes``: the rows
    each rank sent; ``rank``: this rank's place in the group (0 without a group)."""

    rows: Tensor
    sizes: Tuple[int, ...]
    rank: int

    @property
    def offset(self) -> int:
        """Where this rank's rows start in :attr:`rows`."""
        return sum(self.sizes[: self.rank])

    @property
    def mine(self) -> slice:
        """This rank's rows in :attr:`rows`."""
        return slice(self.offset, self.offset + self.sizes[self.rank])


def gather_rows(local: Tensor, process_group=None, purpose: str = "rows") -> RowGather:
    """Every rank's ``local`` rows (``[N_r, ...]``: the same trailing shape and dtype on every
    rank, ``N_r`` free) concatenated in group rank order, on ``local``'s device (the one the
    group's backend takes: CUDA for NCCL). Two all-gathers: the ``[1]`` int64 row counts
    (``purpose + "_counts"``), then the rows padded to the largest count (``purpose``).
    ``process_group=None``: this process alone, no collective."""
    if process_group is None:
        return RowGather(rows=local, sizes=(local.shape[0],), rank=0)
    count = torch.tensor([local.shape[0]], dtype=torch.int64, device=local.device)
    sizes = tuple(int(n) for n in all_gather_stacked(count, process_group, purpose + "_counts").view(-1).tolist())
    rows = all_gather_ragged(local, sizes, process_group, purpose)
    return RowGather(rows=rows, sizes=sizes, rank=dist.get_rank(process_group))


def sum_over_ranks(values: Tensor, process_group=None, purpose: str = "sums") -> Tensor:
    """``values`` summed elementwise over the ranks of ``process_group`` (every rank gets the
    sums; ``values`` itself is left as it is), not differentiable; ``values`` when None. One
    all-reduce of ``values``' size, on its device."""
    if process_group is None:
        return values
    return all_reduce_sum(values.detach().clone(), process_group, purpose)


def token_mean(values: Tensor, mask: Tensor, process_group=None) -> Tensor:
    """The mean of ``values`` over the counted tokens (``mask``) of every rank of ``process_group``
    (this process's alone when None; 0 when no token counts), as the losses reduce a token mean.

    Rows of ``values`` that carry no gradient (a loss call's constant members) count in the value
    and the denominator only. With ``process_group``, every rank returns the same value and its
    tokens get ``P`` times their gradient of it (``P`` the group's size), the losses' contract
    (:mod:`tpo_kernels.distributed`): after data parallelism averages the parameter gradients,
    each has the gradient of the mean over all ranks' tokens. One all-reduce of three float64
    numbers (this rank's sums with and without gradient, its token count)."""
    counted = mask.to(values.dtype)
    local_sum = (values * counted).sum()
    count = counted.sum()
    if process_group is None:
        return local_sum / count.clamp(min=1.0)
    totals = sum_over_ranks(torch.stack([local_sum.detach(), count]).double(), process_group, "token_mean")
    world = dist.get_world_size(process_group)
    # Value: the sum over every rank's tokens; gradient: P times this rank's own tokens'.
    scaled = world * local_sum
    return (scaled + (totals[0].to(local_sum.dtype) - scaled).detach()) / totals[1].to(local_sum.dtype).clamp(min=1.0)


__all__ = ["RowGather", "gather_rows", "sum_over_ranks", "token_mean"]
