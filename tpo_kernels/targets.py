"""The group op (layer 2) in portable PyTorch: sequence log-probs, standardized scores, p, q,
per-group loss and the per-sequence coefficients ``c = w * (p - q)``.

Math (DESIGN.md section 1), per group of K completions::

    ell[i] = sum_t m[i,t] * lp[i,t]
    u[i]   = (s[i] - mean(s)) / std(s)    population std; u = 0 when all scores tie
    p      = softmax(ell)
    q      = softmax(ell_old + u/eta)     anchored (ell_old = ell on-policy), softmax(u/eta) if not
    L      = -sum_i q[i] log p[i]
    c[i]   = w * (p[i] - q[i])            w = 1/G for reduction="mean", 1 otherwise

Ties are detected as ``max(s) == min(s)`` rather than ``std == 0``: the float mean of equal values
can differ from them in the last bit, which would turn a tie into u = +-1 noise. p and q go through
the same softmax, so a tied on-policy group gets ``q == p`` bit for bit and ``c == 0`` exactly.

Everything here is deterministic: segmented sums go through dense padded tensors (every slot
written once) and fixed-order reductions, never atomics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .layout import BatchLayout


@dataclass
class GroupTargets:
    seq_logprobs: Tensor  # [N] ell
    u: Tensor  # [N] standardized scores
    p: Tensor  # [N] policy distribution within each group
    q: Tensor  # [N] target distribution within each group
    group_loss: Tensor  # [G] -sum q log p
    coef: Tensor  # [N] dL/d ell = w * (p - q)


def segment_sum(token_values: Tensor, layout: BatchLayout) -> Tensor:
    """Deterministic per-completion sum of a flat ``[M]`` tensor (masked rows must hold 0)."""
    if layout.padded_len is not None:
        return token_values.view(layout.num_seqs, layout.padded_len).sum(dim=1)
    dense = token_values.new_zeros(layout.num_seqs, max(layout.max_seq_len, 1))
    rows = torch.nonzero(layout.token_seq >= 0).squeeze(1)
    seq = layout.token_seq[rows]
    dense[seq, rows - layout.seq_start[seq]] = token_values[rows]
    return dense.sum(dim=1)


def dense_group_targets(
    logits: Tensor,
    scores: Tensor,
    old_logits: Optional[Tensor],
    valid: Optional[Tensor],
    eta: float,
    anchor: bool,
):
    """Group math on a dense ``[G, K]`` layout (``valid`` marks real members; None = all).

    ``logits`` are the group-softmax inputs of p (sequence log-probs, or candidate logits for
    token-level TPO); ``old_logits`` those of p_old (None: on-policy, p_old = p).
    Returns ``(u, p, q, log_p, group_loss)``.
    """
    neg_inf = float("-inf")
    if valid is None:
        valid = torch.ones_like(scores, dtype=torch.bool)
    count = valid.sum(dim=1, keepdim=True).to(scores.dtype)
    s = torch.where(valid, scores, 0.0)
    mean = s.sum(dim=1, keepdim=True) / count
    centered = torch.where(valid, scores - mean, 0.0)
    std = torch.sqrt((centered * centered).sum(dim=1, keepdim=True) / count)
    s_max = torch.where(valid, scores, neg_inf).amax(dim=1, keepdim=True)
    s_min = torch.where(valid, scores, float("inf")).amin(dim=1, keepdim=True)
    tied = s_max == s_min
    u = torch.where(tied | ~valid, 0.0, centered / torch.where(tied, 1.0, std))

    policy = torch.where(valid, logits, neg_inf)
    log_p = torch.log_softmax(policy, dim=1)
    p = torch.softmax(policy, dim=1)
    if anchor:
        base = logits if old_logits is None else old_logits
        target = torch.where(valid, base + u / eta, neg_inf)
    else:
        target = torch.where(valid, u / eta, neg_inf)
    q = torch.softmax(target, dim=1)
    group_loss = -torch.where(valid, q * log_p, 0.0).sum(dim=1)
    return u, p, q, log_p, group_loss


def _dense_slots(layout: BatchLayout):
    """(group, slot) of each entry of ``group_members`` in a dense ``[G, max_group_size]`` layout."""
    rows = layout.seq_group[layout.group_members]
    cols = torch.arange(layout.num_seqs, device=rows.device) - layout.group_offsets[rows]
    return rows, cols


def loss_weight(reduction: str, num_groups: int) -> float:
    return 1.0 / num_groups if reduction == "mean" else 1.0


def group_targets(
    token_logprobs: Tensor,
    layout: BatchLayout,
    scores: Tensor,
    old_seq_logprobs: Optional[Tensor],
    eta: float,
    anchor: bool,
    reduction: str,
) -> GroupTargets:
    """Sequence-level TPO group op for a flat ``[M]`` token log-prob tensor (0 on masked rows)."""
    ell = segment_sum(token_logprobs, layout)
    scores = scores.to(ell.dtype)
    old = None if old_seq_logprobs is None else old_seq_logprobs.to(ell.dtype)
    g, kmax = layout.num_groups, layout.max_group_size

    if layout.group_size is not None:  # contiguous groups of K: plain views
        def to_dense(x):
            return x.view(g, kmax)

        def from_dense(x):
            return x.reshape(-1)

        valid = None
    else:
        members = layout.group_members
        rows, cols = _dense_slots(layout)
        valid = torch.zeros(g, kmax, dtype=torch.bool, device=ell.device)
        valid[rows, cols] = True

        def to_dense(x):
            dense = x.new_zeros(g, kmax)
            dense[rows, cols] = x[members]
            return dense

        def from_dense(x):
            out = x.new_empty(layout.num_seqs)
            out[members] = x[rows, cols]
            return out

    u, p, q, _, group_loss = dense_group_targets(
        to_dense(ell), to_dense(scores), None if old is None else to_dense(old), valid, eta, anchor
    )
    p, q = from_dense(p), from_dense(q)
    coef = (p - q) * loss_weight(reduction, g)
    return GroupTargets(ell, from_dense(u), p, q, group_loss, coef)


def group_sum(seq_values: Tensor, layout: BatchLayout) -> Tensor:
    """Deterministic per-group sum of a per-completion ``[N]`` tensor."""
    if layout.group_size is not None:
        return seq_values.view(layout.num_groups, layout.group_size).sum(dim=1)
    rows, cols = _dense_slots(layout)
    dense = seq_values.new_zeros(layout.num_groups, layout.max_group_size)
    dense[rows, cols] = seq_values[layout.group_members]
    return dense.sum(dim=1)
