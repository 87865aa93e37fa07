"""Vocabulary-parallel heads and logits: the seam that joins the shards (per-token partials merged
in rank order, ``dH`` summed). Where this rank's shard lies is resolved with the call's plan
(:mod:`tpo_kernels.plan.vocabulary`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist
from torch import Tensor

from ..backends.rows import RowSummary
from ..checks import placement
from ..plan.vocabulary import ShardRequest  # what a rank asked for, resolved by the plan
from .collectives import all_gather_stacked, all_reduce_sum


@dataclass(frozen=True)
class VocabShard:
    """This rank's contiguous slice ``[start, start + size)`` of a vocabulary of ``vocab_size``
    ids, split over ``group``: the seam the row ops of :mod:`tpo_kernels.ops.vocab_shard` call to
    join the shards."""

    group: object
    start: int
    size: int
    vocab_size: int

    @classmethod
    def place(cls, request: "ShardRequest", sizes: List[int], starts: List[int]) -> "VocabShard":
        """This rank's shard from every rank's (size, start | -1) in group rank order, as agreed
        (the shards must tile ``[0, V)``: the same error on every rank otherwise)."""
        starts = placement.check_shard_tiling(sizes, starts)
        return cls(request.group, starts[dist.get_rank(request.group)], request.size, sum(sizes))

    def merge(self, summary: RowSummary, inv_temperature: float) -> RowSummary:
        """The whole vocabulary's summary from every rank's: one all-gather of the ``[C, M]``
        partials (one row per present field, each as the compute dtype: exact for the bool
        ``has_label``), merged in rank order (the fused-linear tiles' exact merge), so every rank
        gets the same bits."""
        present = {name: value for name, value in summary.items() if value is not None}
        stacked = torch.stack([value.to(summary.log_sum.dtype) for value in present.values()])
        gathered = all_gather_stacked(stacked, self.group, "partials")  # [P, C, M]
        ranks = [dataclasses.replace(summary, **{name: part.to(value.dtype)
                                                 for (name, value), part in zip(present.items(), parts)})
                 for parts in gathered]
        merged = ranks[0]
        for other in ranks[1:]:
            merged = merged.merge(other, inv_temperature)
        return merged

    def sum_hidden_grad(self, grad_hidden: Tensor) -> Tensor:
        """``dH`` summed over the shards (the all-reduce of any tensor-parallel linear layer)."""
        return all_reduce_sum(grad_hidden, self.group, "hidden_grad")
