"""The batch layout and the group op (layer 2): from per-token log-probs to the TPO loss of each group.

Math, per group of K members (completions, or the K candidate tokens of one state)::

    ell[i] = sum_t m[i,t] * lp[i,t]           sequence log-prob (one term for a candidate)
    u[i]   = (s[i] - mean(s)) / std(s)         population std; u = 0 when all scores tie;
                                               u = s[i] - mean(s) when std(s) <= score_eps
    p      = softmax(ell + lw)                 policy within the group            (Eq. 1)
    q      = softmax(ell_old + lw + u / eta)   anchored target (ell_old = ell on-policy);
                                               softmax(lw + u / eta) without the anchor
    L      = -sum_i q[i] log p[i]              q held constant                    (Eq. 3)
    dL / d ell[i] = p[i] - q[i]

``lw`` are the optional per-completion log-weights (``seq_log_weights``, 0 when absent):
``p ∝ w exp(ell)`` and ``q ∝ w p_old exp(u / eta)``, and ``dL / d ell = p - q`` still (``sum q =
1``). ``u`` is unweighted, over the members with ``w > 0``; a member with ``lw = -inf`` has
``p = q = 0`` and no loss term (a group whose members all have it adds 0). ``ell + lw`` and
``base + lw`` are formed by one same add, so the tied on-policy group below keeps ``q == p``.

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

This module holds the batch layout every stage shares (:class:`BatchLayout`, below), its
segment and group sums, and the portable PyTorch group op (every backend's default; the Triton
and CUDA backends fuse it into one kernel with the same contract); the group stage built on it
(reduction over groups, the k3 KL term, the entropy bonus) is
:class:`tpo_kernels.ops.group.GroupObjective`. Everything is deterministic: segmented sums go
through dense padded tensors (each slot written once) and fixed-order reductions, never atomics.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor


# ----------------------------------------------------------------------------- the group rule


@dataclass(frozen=True)
class GroupRule:
    """The settings of the group stage, checked once by the plan and carried whole to the
    ``tpo_kernels::group_targets`` op (:meth:`to_op`) and from there to the backends' group op,
    whose launchers copy them into the C++ ``GroupArgs`` / Triton kernel arguments
    (:meth:`kernel_args`). A new field is agreed on across ranks and reaches every backend's
    group op without another edit on the way; a field marked ``before_op`` is applied by the
    group stage around the op instead (:class:`tpo_kernels.ops.group.GroupObjective`)."""

    eta: float = 1.0  # the target's temperature: q = softmax(ell_old + u / eta)
    anchor: bool = True  # q anchored at the old (on-policy: current) sequence log-probs
    score_eps: float = 0.0  # near-tie tolerance on a group's score std (see standardize_dense)
    # Sequence log-probs as means over counted tokens: per-token weights 1/n_i before the op.
    length_normalize: bool = dataclasses.field(default=False, metadata={"before_op": True})

    def to_op(self) -> List[float]:
        """Every field as a float, in declaration order: the op schema's ``float[]`` argument."""
        return [float(getattr(self, name)) for name, _ in _RULE_FIELDS]

    @classmethod
    def from_op(cls, values: List[float]) -> "GroupRule":
        """The rule :meth:`to_op` flattened (a bool field is 0.0 or 1.0 there)."""
        return cls(**{name: (value != 0.0 if flag else value) for (name, flag), value in zip(_RULE_FIELDS, values)})

    def kernel_args(self) -> Dict[str, object]:
        """The keywords of a backend's group op (:func:`portable_group_targets`): every field
        the op itself applies."""
        return {name: getattr(self, name) for name in _KERNEL_FIELDS}


# (name, is a flag) of every field, and the names of those the group op applies, read once.
_RULE_FIELDS = tuple((field.name, field.type in (bool, "bool")) for field in dataclasses.fields(GroupRule))
_KERNEL_FIELDS = tuple(field.name for field in dataclasses.fields(GroupRule) if not field.metadata.get("before_op"))


# ----------------------------------------------------------------------------- the batch layout

# Batch layout: which flat token belongs to which completion, and which completion to which group.
#
# Every path flattens tokens to ``M`` rows (padded ``[N, T]`` -> ``M = N*T``; packed: the rows given,
# split by ``cu_seqlens``). Completion ``n`` owns rows ``[seq_start[n], seq_start[n] + seq_len[n])``.
# Groups are listed as ``group_members[group_offsets[g]:group_offsets[g+1]]`` (completion indices in
# ascending order), so both contiguous ``group_size`` batches and arbitrary ``group_ids`` share one
# description. Group ``g`` of ``group_ids`` is the g-th smallest distinct id.


@dataclass
class BatchLayout:
    num_tokens: int  # M, rows of the flat token matrix
    num_seqs: int  # N
    num_groups: int  # G
    seq_start: Tensor  # [N] int64, first row of each completion
    seq_len: Tensor  # [N] int64
    max_seq_len: int
    token_seq: Tensor  # [M] int64, completion of each row, -1 for rows outside every completion
    seq_group: Tensor  # [N] int64, group of each completion
    group_offsets: Tensor  # [G+1] int64
    group_members: Tensor  # [N] int64, completions sorted by group (stable)
    max_group_size: int
    group_size: Optional[int]  # K when every group is K contiguous completions, else None
    padded_len: Optional[int]  # T for a padded [N, T] batch, None for packed


def build_layout(
    num_tokens: int,
    device: torch.device,
    *,
    padded_shape: Optional[tuple] = None,
    cu_seqlens: Optional[Tensor] = None,
    packed_extent: Optional[Tuple[int, int]] = None,
    group_size: Optional[int] = None,
    group_ids: Optional[Tensor] = None,
    members: Optional[Tensor] = None,
) -> BatchLayout:
    """Build the layout from a padded ``(N, T)`` shape or packed ``cu_seqlens`` (already validated)
    with its ``packed_extent``: the rows covered (``cu_seqlens[-1]``) and the longest completion,
    host ints the caller reads back together with its checks (read here when not given).

    Read-backs: none with ``group_size``; two with ``group_ids`` (the number of groups and the
    largest); three with ``members`` (the kept completions, the groups, the largest).

    ``members`` (``[N]`` bool) leaves completions out of every group: they get no probability
    mass and no gradient (completions with no counted token). A group left with no member is
    dropped."""
    if padded_shape is not None:
        n, t = padded_shape
        seq_start = torch.arange(n, device=device, dtype=torch.int64) * t
        seq_len = torch.full((n,), t, device=device, dtype=torch.int64)
        token_seq = torch.arange(n, device=device, dtype=torch.int64).repeat_interleave(t)
        max_seq_len = t
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        n = cu.numel() - 1
        seq_start = cu[:-1].contiguous()
        seq_len = (cu[1:] - cu[:-1]).contiguous()
        token_seq = torch.full((num_tokens,), -1, device=device, dtype=torch.int64)
        if packed_extent is None:  # one read-back; the public functions pass it with their checks
            packed_extent = torch.stack([cu[-1], seq_len.max()]).tolist() if n > 0 else (int(cu[-1]), 0)
        covered, max_seq_len = packed_extent
        token_seq[:covered] = torch.arange(n, device=device, dtype=torch.int64).repeat_interleave(
            seq_len, output_size=covered
        )

    if members is not None:
        ids = group_ids.to(device) if group_ids is not None else torch.arange(n, device=device) // group_size
        kept = torch.nonzero(members.to(device)).squeeze(1)
        _, kept_group, counts = torch.unique(ids[kept], sorted=True, return_inverse=True, return_counts=True)
        seq_group = torch.zeros(n, device=device, dtype=torch.int64)  # 0 for the left-out: p = q = 0
        seq_group[kept] = kept_group.to(torch.int64)
        g = counts.numel()
        group_offsets = torch.zeros(g + 1, device=device, dtype=torch.int64)
        group_offsets[1:] = torch.cumsum(counts, 0)
        group_members = kept[torch.sort(kept_group, stable=True).indices]
        max_group_size = int(counts.max())
        contiguous_k = None
    elif group_ids is None:
        k = group_size
        g = n // k
        seq_group = torch.arange(n, device=device, dtype=torch.int64) // k
        group_offsets = torch.arange(g + 1, device=device, dtype=torch.int64) * k
        group_members = torch.arange(n, device=device, dtype=torch.int64)
        max_group_size = k
        contiguous_k = k
    else:
        _, seq_group, counts = torch.unique(group_ids.to(device), sorted=True, return_inverse=True,
                                            return_counts=True)
        seq_group = seq_group.to(torch.int64)
        g = counts.numel()
        group_offsets = torch.zeros(g + 1, device=device, dtype=torch.int64)
        group_offsets[1:] = torch.cumsum(counts, 0)
        group_members = torch.sort(seq_group, stable=True).indices
        max_group_size = int(counts.max())
        contiguous_k = None

    return BatchLayout(
        num_tokens=num_tokens,
        num_seqs=n,
        num_groups=g,
        seq_start=seq_start,
        seq_len=seq_len,
        max_seq_len=max_seq_len,
        token_seq=token_seq,
        seq_group=seq_group,
        group_offsets=group_offsets,
        group_members=group_members,
        max_group_size=max_group_size,
        group_size=contiguous_k,
        padded_len=padded_shape[1] if padded_shape is not None else None,
    )


def candidate_layout(num_states: int, num_candidates: int, device: torch.device) -> BatchLayout:
    """Token-level TPO as a sequence-level batch: each of the ``R * K`` candidates is a
    "completion" of one token, and each state's K candidates form a group."""
    return build_layout(
        num_states * num_candidates,
        device,
        padded_shape=(num_states * num_candidates, 1),
        group_size=num_candidates,
    )


def pair_runs(candidates: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The (r, k) candidate pairs, numbered ``r * K + k``, stably sorted by token id:
    ``(order, tokens, offsets)``. The pairs of the distinct id ``tokens[i]`` are
    ``order[offsets[i]:offsets[i+1]]`` in ascending (r, k) order, so that per-token sums over
    them (weight and bias gradients) run in a fixed order."""
    flat = candidates.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens, lengths = torch.unique_consecutive(flat[order], return_counts=True)
    offsets = torch.zeros(tokens.numel() + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return order, tokens, offsets


# ----------------------------------------------------------------------------- the group op


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
        return GroupResult.from_op(tuple(t.to(dtype) for t in self.to_op()))

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
    """Deterministic per-completion sum of a flat ``[M]`` tensor, or of ``[M, C]`` columns at once
    (one call for several per-token quantities); rows that do not count must hold 0.
    Differentiable."""
    columns = token_values.shape[1:]
    if layout.padded_len is not None:
        return token_values.view(layout.num_seqs, layout.padded_len, *columns).sum(dim=1)
    # Packed: scatter into a dense [N + 1, max_len] tensor (row N collects rows outside every
    # completion) and sum each row in order.
    seq = torch.where(layout.token_seq >= 0, layout.token_seq, layout.num_seqs)
    pos = torch.arange(layout.num_tokens, device=token_values.device) - torch.where(
        layout.token_seq >= 0, layout.seq_start[layout.token_seq.clamp(min=0)], 0
    )
    pos = torch.where(layout.token_seq >= 0, pos, 0)
    width = max(layout.max_seq_len, 1)
    dense = token_values.new_zeros(layout.num_seqs + 1, width, *columns)
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
    """Deterministic per-group sum of a per-completion ``[N]`` tensor, or of ``[N, C]`` columns
    at once. Differentiable."""
    columns = seq_values.shape[1:]
    if layout.group_size is not None:
        return seq_values.view(layout.num_groups, layout.group_size, *columns).sum(dim=1)
    rows, cols = _dense_slots(layout)
    dense = seq_values.new_zeros(layout.num_groups, layout.max_group_size, *columns)
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
                     eta: float, anchor: bool, score_eps: float = 0.0, log_weights: Optional[Tensor] = None):
    """The group math on a dense ``[G, K]`` layout (``valid`` marks real members; None = all;
    ``log_weights``: ``lw``, None = 0). Returns ``(u, p, q, group_loss)`` in the inputs' dtype
    (float64 in :func:`portable_group_targets`)."""
    neg_inf = float("-inf")
    if valid is None:
        valid = torch.ones_like(scores, dtype=torch.bool)
    base = (ell if old_ell is None else old_ell) if anchor else torch.zeros_like(ell)
    if log_weights is not None:  # one same add into both softmax inputs: a tied group keeps q == p
        valid = valid & (log_weights > neg_inf)
        ell, base = ell + log_weights, base + log_weights
    u = standardize_dense(scores, valid, score_eps)
    policy = torch.where(valid, ell, neg_inf)
    log_p = torch.log_softmax(policy, dim=1)
    p = torch.softmax(policy, dim=1)
    q = torch.softmax(torch.where(valid, base + u / eta, neg_inf), dim=1)
    if log_weights is not None:  # a row whose every weight is 0 (no valid member) has p = q = 0, not NaN
        p, q = torch.where(valid, p, 0.0), torch.where(valid, q, 0.0)
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
    seq_log_weights: Optional[Tensor] = None,
) -> GroupResult:
    """The portable group op: flat ``[M]`` token log-probs (0 on rows that do not count) ->
    :class:`GroupResult` in the token log-probs' dtype, computed in float64 (``seq_log_weights``:
    ``[N]`` ``lw``, finite or -inf). Not differentiable by itself: the autograd rule lives with the
    ``tpo_kernels::group_targets`` op (:mod:`tpo_kernels.ops.group`)."""
    out_dtype = token_logprobs.dtype
    ell = segment_sum(token_logprobs.to(torch.float64), layout)
    scores = scores.to(ell.dtype)
    old = None if old_seq_logprobs is None else old_seq_logprobs.to(ell.dtype)
    lw = None if seq_log_weights is None else seq_log_weights.to(ell.dtype)
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
        score_eps, None if lw is None else to_dense(lw),
    )
    return GroupResult(seq_logprobs=ell, u=from_dense(u), p=from_dense(p), q=from_dense(q), group_loss=group_loss,
                       coef=from_dense(p - q)).to(out_dtype)
