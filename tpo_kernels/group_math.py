"""The group op (layer 2): from per-token log-probs to the TPO loss of each group.

Math, per group of K members (completions, or the K candidate tokens of one state)::

    ell[i] = sum_t m[i,t] * lp[i,t]           sequence log-prob (one term for a candidate)
    u[i]   = (s[i] - mean(s)) / std(s)         population std; u = 0 when all scores tie;
                                               u = s[i] - mean(s) when std(s) <= score_eps
    p      = softmax(ell)                      policy within the group            (Eq. 1)
    q      = softmax(ell_old + u / eta)        anchored target (ell_old = ell on-policy);
                                               softmax(u / eta) without the anchor
    L      = -sum_i q[i] log p[i]              q held constant                    (Eq. 3)
    dL / d ell[i] = p[i] - q[i]

Ties are detected as ``max(s) == min(s)`` rather than ``std == 0``: the float mean of equal
values can differ from them in the last bit, which would turn a tie into u = +-1 noise. p and q
go through the same softmax, so a tied on-policy group gets ``q == p`` bit for bit and
``p - q == 0`` exactly: its tokens carry no gradient and the backward can skip them.

Near ties (the authors' rule): a group whose population std is at most ``score_eps`` keeps its
centered scores undivided, so reward noise of 1e-7 gives a signal of 1e-7, not a full-strength
one (dividing would blow any nonzero spread up to unit variance). ``score_eps = 0`` divides by
every nonzero std; an exact tie is ``u = 0`` either way.

Precision: ``ell`` and everything after it are computed in float64 whatever the token dtype
(a 32k-token completion has ``|ell| ~ 1e5``, where fp32 spacing is 0.008, enough to move p by
1e-3); the results are returned in the token log-probs' dtype. Scores are standardized from
``(s - min s) / (max s - min s)`` (halved first so the difference cannot overflow), so spreads
from 1e-300 to 1e300 and float64 scores closer than fp32 resolution keep their u. Loss terms
with ``q == 0`` count 0 (their limit), so a member with ``log p = -inf`` (a ``-inf`` label logit)
that the target also gives 0 leaves the loss finite.

This module holds the portable PyTorch group op (every backend's default; the Triton and CUDA
backends fuse it into one kernel with the same contract) and :class:`GroupObjective`, the group
stage every loss runs: group op, reduction over groups and the optional k3 KL term. Everything
is deterministic: segmented sums go through dense padded tensors (each slot written once) and
fixed-order reductions, never atomics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from .layout import BatchLayout


@dataclass
class GroupResult:
    """What the group op returns; every tensor is in the compute dtype of the token log-probs."""

    seq_logprobs: Tensor  # [N] ell
    u: Tensor  # [N] standardized scores
    p: Tensor  # [N] policy distribution within each group
    q: Tensor  # [N] target distribution within each group
    group_loss: Tensor  # [G] -sum q log p
    # [N] p - q, the gradient of group_loss on ell, formed before p and q are rounded (when p ~ q,
    # e.g. a large eta, the difference of the rounded fp32 values keeps only a few digits).
    # None: p - q of the fields above.
    coef: Optional[Tensor] = None

    def to(self, dtype: torch.dtype) -> "GroupResult":
        """Every tensor in ``dtype`` (``coef`` formed first when it is None)."""
        coef = self.p - self.q if self.coef is None else self.coef
        return GroupResult(seq_logprobs=self.seq_logprobs.to(dtype), u=self.u.to(dtype), p=self.p.to(dtype),
                           q=self.q.to(dtype), group_loss=self.group_loss.to(dtype), coef=coef.to(dtype))

    def to_op(self) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The six tensors the group custom op returns (``coef`` formed when None); :meth:`from_op`
        reads them back."""
        coef = self.p - self.q if self.coef is None else self.coef
        return self.seq_logprobs, self.u, self.p, self.q, self.group_loss, coef

    @staticmethod
    def from_op(outputs: Tuple[Tensor, ...]) -> "GroupResult":
        seq_logprobs, u, p, q, group_loss, coef = outputs
        return GroupResult(seq_logprobs=seq_logprobs, u=u, p=p, q=q, group_loss=group_loss, coef=coef)


def segment_sum(token_values: Tensor, layout: BatchLayout) -> Tensor:
    """Deterministic per-completion sum of a flat ``[M]`` tensor (rows that do not count must
    hold 0). Differentiable."""
    if layout.padded_len is not None:
        return token_values.view(layout.num_seqs, layout.padded_len).sum(dim=1)
    # Packed: scatter into a dense [N + 1, max_len] tensor (row N collects rows outside every
    # completion) and sum each row in order.
    seq = torch.where(layout.token_seq >= 0, layout.token_seq, layout.num_seqs)
    pos = torch.arange(layout.num_tokens, device=token_values.device) - torch.where(
        layout.token_seq >= 0, layout.seq_start[layout.token_seq.clamp(min=0)], 0
    )
    pos = torch.where(layout.token_seq >= 0, pos, 0)
    width = max(layout.max_seq_len, 1)
    dense = token_values.new_zeros(layout.num_seqs + 1, width)
    dense = dense.index_put((seq, pos.clamp(max=width - 1)), token_values)
    return dense[: layout.num_seqs].sum(dim=1)


def length_weights(valid: Tensor, layout: BatchLayout, dtype: torch.dtype) -> Tensor:
    """Per-token weights ``1 / n_i`` (``n_i`` the counted tokens of the token's completion i; 0
    at tokens that do not count), so that the sequence sum of ``weights * token_logprobs`` is
    the mean over counted tokens (``length_normalize``). Applied to the token log-probs before
    the group op, it is a product autograd differentiates exactly, and zero-signal tokens keep
    an exactly zero gradient. ``valid``: ``[M]`` bool of counted tokens."""
    counted = valid.reshape(-1)
    n = segment_sum(counted.to(torch.float64), layout)  # exact integer counts
    per_seq = 1.0 / n.clamp(min=1.0)
    inside = counted & (layout.token_seq >= 0)
    return torch.where(inside, per_seq[layout.token_seq.clamp(min=0)], 0.0).to(dtype)


def _dense_slots(layout: BatchLayout):
    """(group, slot) of each entry of ``group_members`` in a dense ``[G, max_group_size]`` layout."""
    rows = layout.seq_group[layout.group_members]
    cols = torch.arange(layout.group_members.numel(), device=rows.device) - layout.group_offsets[rows]
    return rows, cols


def group_sum(seq_values: Tensor, layout: BatchLayout) -> Tensor:
    """Deterministic per-group sum of a per-completion ``[N]`` tensor. Differentiable."""
    if layout.group_size is not None:
        return seq_values.view(layout.num_groups, layout.group_size).sum(dim=1)
    rows, cols = _dense_slots(layout)
    dense = seq_values.new_zeros(layout.num_groups, layout.max_group_size)
    dense = dense.index_put((rows, cols), seq_values[layout.group_members])
    return dense.sum(dim=1)


def standardize_dense(scores: Tensor, valid: Tensor, score_eps: float = 0.0) -> Tensor:
    """u = (s - mean) / std (population std) per row of a dense ``[G, K]`` layout; ``u = s -
    mean`` (not divided) for a row whose std is at most ``score_eps``; 0 for a row whose scores
    tie (``max == min``) and at invalid slots. Computed from ``x = (s/2 - min/2) / spread`` with
    ``spread = max/2 - min/2``: halving is exact and keeps the difference finite, the difference
    of nearby scores is exact, and the scale-free x neither underflows nor overflows when
    squared. ``std(s) = 2 * spread * std(x)`` and ``s - mean = 2 * spread * (x - mean(x))``, so the
    near-tie test (``std(x) <= (score_eps / 2) / spread``: never true for ``score_eps = 0``) and
    the centered scores come from the same accurate x. Use float64."""
    s_max = torch.where(valid, scores, float("-inf")).amax(dim=1, keepdim=True)
    s_min = torch.where(valid, scores, float("inf")).amin(dim=1, keepdim=True)
    tied = s_max == s_min
    shifted = torch.where(valid, scores * 0.5 - torch.where(tied, 0.0, s_min) * 0.5, 0.0)
    spread = shifted.amax(dim=1, keepdim=True)
    flat = tied | (spread == 0)  # a spread lost to subnormal halving counts as a tie
    safe_spread = torch.where(flat, 1.0, spread)
    x = shifted / safe_spread
    count = valid.sum(dim=1, keepdim=True).to(scores.dtype)
    mean = x.sum(dim=1, keepdim=True) / count
    centered = torch.where(valid, x - mean, 0.0)
    std = torch.sqrt((centered * centered).sum(dim=1, keepdim=True) / count)
    near_tie = std <= (score_eps * 0.5) / safe_spread
    u = torch.where(near_tie, centered * (safe_spread * 2.0), centered / torch.where(flat, 1.0, std))
    return torch.where(flat | ~valid, 0.0, u)


def dense_group_math(ell: Tensor, scores: Tensor, old_ell: Optional[Tensor], valid: Optional[Tensor],
                     eta: float, anchor: bool, score_eps: float = 0.0):
    """The group math on a dense ``[G, K]`` layout (``valid`` marks real members; None = all).
    Returns ``(u, p, q, group_loss)`` in the inputs' dtype (float64 in :func:`portable_group_targets`)."""
    neg_inf = float("-inf")
    if valid is None:
        valid = torch.ones_like(scores, dtype=torch.bool)
    u = standardize_dense(scores, valid, score_eps)
    policy = torch.where(valid, ell, neg_inf)
    log_p = torch.log_softmax(policy, dim=1)
    p = torch.softmax(policy, dim=1)
    base = (ell if old_ell is None else old_ell) if anchor else torch.zeros_like(ell)
    q = torch.softmax(torch.where(valid, base + u / eta, neg_inf), dim=1)
    # q == 0 terms are 0 (their limit), not 0 * -inf when log p = -inf.
    group_loss = -(q * torch.where(valid & (q > 0), log_p, 0.0)).sum(dim=1)
    return u, p, q, group_loss


def portable_group_targets(
    token_logprobs: Tensor,
    layout: BatchLayout,
    scores: Tensor,
    *,
    old_seq_logprobs: Optional[Tensor] = None,
    eta: float,
    anchor: bool,
    score_eps: float = 0.0,
) -> GroupResult:
    """The portable group op: flat ``[M]`` token log-probs (0 on rows that do not count) ->
    :class:`GroupResult` in the token log-probs' dtype, computed in float64. Not differentiable by
    itself: the autograd rule lives with the ``tpo_kernels::group_targets`` op
    (:mod:`tpo_kernels.ops.group`)."""
    out_dtype = token_logprobs.dtype
    ell = segment_sum(token_logprobs.to(torch.float64), layout)
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
            out = x.new_zeros(layout.num_seqs)  # completions outside every group: 0
            out[members] = x[rows, cols]
            return out

    u, p, q, group_loss = dense_group_math(
        to_dense(ell), to_dense(scores), None if old is None else to_dense(old), valid, eta, anchor,
        score_eps,
    )
    return GroupResult(seq_logprobs=ell, u=from_dense(u), p=from_dense(p), q=from_dense(q), group_loss=group_loss,
                       coef=from_dense(p - q)).to(out_dtype)
