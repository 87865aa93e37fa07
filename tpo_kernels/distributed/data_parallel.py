"""Groups split over data-parallel ranks: the gather the group stage runs when a batch's
completions live on several ranks.

The row op (the vocabulary-sized work) stays local; the group stage needs only per-completion
numbers, so each rank sends its ``[N_r, C]`` rows and every rank runs the same group stage on
the gathered ``[N, C]`` (:class:`tpo_kernels.ops.group.GroupObjective` with a ``gather``). The
sizes were exchanged with the call's agreement record, so the gather is one all-gather (two with
``group_ids``). The gather's backward is the group stage's concern (a replicated computation:
``P`` times this rank's slice, see :mod:`tpo_kernels.distributed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..group_math import BatchLayout, build_layout
from .collectives import all_gather_ragged


@dataclass(frozen=True)
class GroupGather:
    """Every rank's completions, in group rank order. ``sizes``: completions per rank (agreed);
    ``group_size`` (K contiguous completions of the concatenation) or this rank's global
    ``group_ids``; ``all_kept``: no rank left a completion out of its group (None: not known
    before the gather, the positions being split over context ranks; the gathered kept column
    is read back once)."""

    group: object
    sizes: Tuple[int, ...]
    group_size: Optional[int]
    group_ids: Optional[Tensor]
    all_kept: Optional[bool]

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def mine(self) -> slice:
        """This rank's completions in the gathered order."""
        start = sum(self.sizes[: self.rank])
        return slice(start, start + self.sizes[self.rank])

    def _cat(self, local: Tensor, purpose: str) -> Tensor:
        return all_gather_ragged(local, self.sizes, self.group, purpose)

    def rows(self, local: Tensor) -> Tensor:
        """``[sum N_r, C]`` from every rank's ``[N_r, C]`` (not differentiable by itself)."""
        return self._cat(local, "rows")

    def layout(self, kept: Optional[Tensor], device: torch.device) -> BatchLayout:
        """The gathered batch as one-"token" completions (``[N, 1]``) and their groups; ``kept``
        (``[N]`` bool, gathered) leaves completions with no counted token out of their group."""
        total = sum(self.sizes)
        all_kept = bool(kept.all()) if self.all_kept is None else self.all_kept  # one read-back when unknown
        members = None if all_kept else kept
        if self.group_ids is None:
            return build_layout(total, device, padded_shape=(total, 1), group_size=self.group_size, members=members)
        ids = self._cat(self.group_ids.to(torch.int64), "group_ids")
        return build_layout(total, device, padded_shape=(total, 1), group_ids=ids, members=members)


__all__: List[str] = ["GroupGather"]
