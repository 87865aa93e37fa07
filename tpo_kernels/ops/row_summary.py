"""The per-row summary of a vocabulary range and its one exact merge.

Every row op returns, per row, the raw max of its logits and the log-sum of ``exp((z - max) /
tau)`` (the row statistics), the label's log-prob and, on request, the entropy. A range of the
vocabulary (a block of the fused-linear tiles, or one rank's vocabulary shard) gives the same
summary over its part; :meth:`RowSummary.merge` combines two disjoint ranges exactly. Both the
fused-linear tiles and the vocabulary shards merge through it, so a new per-row quantity lands
in the kernels, this summary and this merge only.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


class RowSummary(NamedTuple):
    """Per-row summary of one vocabulary range (``[M]`` tensors in the compute dtype)."""

    row_max: Tensor
    log_sum: Tensor
    label_logprob: Tensor  # meaningful where has_label
    entropy: Optional[Tensor]
    has_label: Tensor  # bool: the label lies in this range

    def merge(self, other: "RowSummary", inv_temperature: float) -> "RowSummary":
        """The summary of the union of two disjoint ranges.

        With ``c = (row_max - m) * it + log_sum`` each range's log-mass relative to the common max
        ``m``, the merged ``log_sum`` is ``logaddexp(c_a, c_b)``, the label's log-prob moves by
        ``-softplus(c_other - c_own)`` (both terms <= 0: no cancellation, and ``1 - p`` of a
        confident token keeps its relative accuracy), and the entropy is the mixture's, ``sum_k
        w_k (H_k - log w_k)`` with ``w_k = exp(c_k - log_sum)``: non-negative terms only (the ``lse -
        sum p z`` form cancels catastrophically for large logits). A range of only ``-inf`` logits
        (``row_max == -inf``, e.g. a masked block) adds nothing; a label inside it has log-prob
        ``-inf``."""
        neg_inf = float("-inf")
        empty_a, empty_b = self.row_max == neg_inf, other.row_max == neg_inf
        m = torch.maximum(self.row_max, other.row_max)
        shift = torch.where(m == neg_inf, 0.0, m)
        c_a = torch.where(empty_a, neg_inf, (self.row_max - shift) * inv_temperature + self.log_sum)
        c_b = torch.where(empty_b, neg_inf, (other.row_max - shift) * inv_temperature + other.log_sum)
        log_sum = torch.logaddexp(c_a, c_b)
        lp_a = torch.where(empty_a, neg_inf, self.label_logprob)
        lp_b = torch.where(empty_b, neg_inf, other.label_logprob)
        log_w_a = -F.softplus(c_b - c_a)  # log of range a's share of the mass
        log_w_b = -F.softplus(c_a - c_b)
        logprob = torch.where(other.has_label, lp_b + log_w_b, lp_a + log_w_a)
        entropy = None
        if self.entropy is not None:
            mixed = torch.exp(log_w_a) * (self.entropy - log_w_a) + torch.exp(log_w_b) * (other.entropy - log_w_b)
            entropy = torch.where(empty_b, self.entropy, torch.where(empty_a, other.entropy, mixed))
        return RowSummary(row_max=m, log_sum=log_sum, label_logprob=logprob, entropy=entropy,
                          has_label=self.has_label | other.has_label)
