"""Kept sets (sampling-mask replay): the one internal ragged record of which token ids each row's
softmax runs over.

A sampler with top-k / top-p keeps, per token, a set S of ids and samples from the softmax
renormalized over S. Replay computes each token's log-prob over the same set,
``lp = z_y / tau - logsumexp_{j in S} z_j / tau``, so that training sees the distribution the sampler
used. :class:`KeptSets` carries the sets as a CSR over the ``M`` rows of a call:

* ``ids [P]`` int64: the pairs' token ids, row by row; a negative id is a hole (no entry: the
  padded ``[M, S]`` form is a CSR with holes, ``offsets = S * arange``, nothing compacted);
* ``offsets [M + 1]``: row ``r``'s pairs are ``ids[offsets[r]:offsets[r + 1]]``;
* ``rows [P]``: each pair's row (``repeat_interleave`` of the counts, sized without a read-back);
* ``label_slot [M]``: the pair index of the row's label; :data:`NOT_COUNTED` (-1): the row does not
  count (outputs 0, never read); :data:`LABEL_OUTSIDE` (-2): the row counts but its label is not in
  its set (statistics computed, label log-prob NaN, ``has_label`` False);
* ``width``: ``S`` for the padded form, None for a CSR.

Token-level TPO's ``[R, K]`` candidate ids are the padded form with ``S = K`` (:meth:`KeptSets.from_candidates`):
the candidate ops are the kept-set ops on it, a negative candidate id (no holes in the dense contract)
mapped to NaN by the caller (:mod:`tpo_kernels.ops.candidates`).

The argument checks build it; the kernels take it whole, and the custom ops flatten it at the
``torch.library`` boundary (:meth:`KeptSets.to_op` / :meth:`KeptSets.from_op`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

NOT_COUNTED = -1  # label_slot of a row that does not count
LABEL_OUTSIDE = -2  # label_slot of a counted row whose label is not in its kept set


@dataclass(frozen=True)
class KeptSets:
    """The kept sets of ``M`` rows as a CSR over ``P`` (row, id) pairs (module docstring)."""

    ids: Tensor  # [P] int64, negative: a hole
    offsets: Tensor  # [M + 1] int64
    rows: Tensor  # [P] int64, the row of each pair
    label_slot: Tensor  # [M] int64, pair index of the label, NOT_COUNTED or LABEL_OUTSIDE
    width: Optional[int] = None  # S of the padded form; None: CSR

    @property
    def num_rows(self) -> int:
        return self.label_slot.shape[0]

    @property
    def num_pairs(self) -> int:
        return self.ids.shape[0]

    def to_op(self) -> Tuple[List[Tensor], int]:
        """``([ids, offsets, rows, label_slot], width)`` (width 0: CSR), the arguments of a custom op."""
        return [self.ids, self.offsets, self.rows, self.label_slot], int(self.width or 0)

    @staticmethod
    def from_op(tensors: Sequence[Tensor], width: int) -> "KeptSets":
        ids, offsets, rows, label_slot = tensors
        return KeptSets(ids=ids, offsets=offsets, rows=rows, label_slot=label_slot, width=width or None)

    def shard(self, start: int, size: int) -> "KeptSets":
        """The sets seen by the vocabulary shard ``[start, start + size)``: ids shifted by ``-start``,
        ids off the shard made holes, and a counted label off the shard LABEL_OUTSIDE (the shard
        computes its statistics; :meth:`RowSummary.merge` takes the label from the shard holding
        it, and a shard holding none of a row's ids has ``row_max = -inf``: it adds nothing)."""
        local = self.ids - start
        on_shard = (self.ids >= 0) & (local >= 0) & (local < size)
        ids = torch.where(on_shard, local, -1)
        # No pairs: every row is NOT_COUNTED (an empty set does not count), nothing to look up.
        on_label = on_shard[self.label_slot.clamp(min=0)] if self.num_pairs else torch.zeros_like(self.label_slot, dtype=torch.bool)
        label_here = (self.label_slot >= 0) & on_label
        label_slot = torch.where(label_here | (self.label_slot == NOT_COUNTED), self.label_slot, LABEL_OUTSIDE)
        return KeptSets(ids=ids, offsets=self.offsets, rows=self.rows, label_slot=label_slot, width=self.width)

    # ------------------------------------------------------------------ builders

    @staticmethod
    def from_csr(ids: Tensor, offsets: Tensor, labels: Tensor) -> "KeptSets":
        """The sets ``ids[offsets[r]:offsets[r + 1]]`` of the rows with ``labels`` (``[M]``; a negative
        label: the row does not count). An empty set does not count either."""
        ids = ids.reshape(-1).to(torch.int64)
        offsets = offsets.reshape(-1).to(device=ids.device, dtype=torch.int64)
        counts = offsets[1:] - offsets[:-1]
        rows = torch.repeat_interleave(torch.arange(counts.numel(), device=ids.device), counts,
                                       output_size=ids.numel())
        slots = label_slots(ids, rows, labels.reshape(-1).to(device=ids.device, dtype=torch.int64), counts)
        return KeptSets(ids=ids, offsets=offsets, rows=rows, label_slot=slots)

    @staticmethod
    def from_padded(ids: Tensor, labels: Tensor) -> "KeptSets":
        """The sets of a padded ``[..., S]`` id tensor (negative: no entry), without compaction."""
        width = ids.shape[-1]
        flat = ids.reshape(-1, width).to(torch.int64)
        num_rows = flat.shape[0]
        device = flat.device
        pair_ids = flat.reshape(-1).clamp(min=-1)
        offsets = torch.arange(num_rows + 1, device=device) * width
        rows = torch.arange(num_rows, device=device).repeat_interleave(width)
        present = (flat >= 0).sum(1)
        slots = label_slots(pair_ids, rows, labels.reshape(-1).to(device=device, dtype=torch.int64), present)
        return KeptSets(ids=pair_ids, offsets=offsets, rows=rows, label_slot=slots, width=width)

    @staticmethod
    def from_candidates(candidates: Tensor) -> "KeptSets":
        """The ``[R, K]`` candidate ids of token-level TPO as sets of K pairs per row (``offsets = K
        arange(R + 1)``): ids a view of ``candidates`` (contiguous int64: no copy), no label (every
        row NOT_COUNTED; the gather, scatter and dot products read no label). No read-back."""
        num_rows, width = candidates.shape
        device = candidates.device
        ids = candidates.to(torch.int64).reshape(-1)
        offsets = torch.arange(num_rows + 1, device=device) * width
        rows = torch.arange(num_rows, device=device).repeat_interleave(width)
        label_slot = torch.full((num_rows,), NOT_COUNTED, dtype=torch.int64, device=device)
        return KeptSets(ids=ids, offsets=offsets, rows=rows, label_slot=label_slot, width=width)


def label_slots(ids: Tensor, rows: Tensor, labels: Tensor, present: Tensor) -> Tensor:
    """``[M]`` label slots: the largest pair index of row ``r`` whose id is ``labels[r]``;
    LABEL_OUTSIDE when none; NOT_COUNTED where the label is negative or the row has no entry
    (``present[r] == 0``). No read-back."""
    pair_index = torch.arange(ids.numel(), device=ids.device)
    hit = (ids >= 0) & (ids == labels[rows])
    slots = torch.full_like(labels, LABEL_OUTSIDE)
    slots.scatter_reduce_(0, rows, torch.where(hit, pair_index, LABEL_OUTSIDE), reduce="amax")
    return torch.where((labels < 0) | (present == 0), NOT_COUNTED, slots)


__all__ = ["KeptSets", "LABEL_OUTSIDE", "NOT_COUNTED", "label_slots"]
