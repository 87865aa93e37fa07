"""``tpo_kernels::group_targets``: the group op as a custom op with its autograd rule, and
:class:`GroupObjective`, the group stage (group op, reduction, KL term) shared by every loss.

Forward: the backend's group op (:func:`tpo_kernels.group_math.portable_group_targets` or a fused kernel)
from flat token log-probs to ``(seq_logprobs, u, p, q, group_loss, coef)``. Backward: q is a
constant of the loss, so ``d group_loss[g] / d ell[i] = p[i] - q[i]`` (``coef``, formed by the
group op in float64 before rounding) for the members of g, and every token of completion i
receives ``d ell[i]`` (the token sums are linear). A tied on-policy group
has ``p == q`` bit for bit, so its tokens get exactly zero.

Over ranks the group stage has two seams (:class:`RankSeams`), and ``ops`` knows nothing else of
ranks: a :class:`RowGather` when the completions are split over ranks (each rank's per-completion
rows gathered), a :class:`RowSum` when each completion's positions are (each rank's per-completion
partial sums added up). Both feed a computation every rank runs alike on the same rows, which is why
their backward is a scale and no collective (see :class:`_Replicated`, :class:`_Summed`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Protocol, Tuple

import torch
from torch import Tensor

from ..backends import backend_by_key
from ..group_math import (BatchLayout, GroupResult, GroupRule, build_layout, group_sum, length_weights,
                          segment_sum)


def layout_op_args(layout: BatchLayout) -> tuple:
    """The layout as the op's tensors and ints, in its schema's order (0 stands for None)."""
    return (layout.seq_start, layout.seq_len, layout.token_seq, layout.seq_group, layout.group_offsets,
            layout.group_members, layout.num_groups, layout.max_seq_len, layout.max_group_size,
            layout.group_size or 0, layout.padded_len or 0)


@torch.library.custom_op("tpo_kernels::group_targets", mutates_args=())
def _group_targets_op(
    token_logprobs: Tensor,
    seq_start: Tensor,
    seq_len: Tensor,
    token_seq: Tensor,
    seq_group: Tensor,
    group_offsets: Tensor,
    group_members: Tensor,
    num_groups: int,
    max_seq_len: int,
    max_group_size: int,
    group_size: int,
    padded_len: int,
    scores: Tensor,
    old_seq_logprobs: Optional[Tensor],
    seq_log_weights: Optional[Tensor],
    rule: List[float],
    backend: str,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    layout = BatchLayout(
        num_tokens=token_seq.numel(), num_seqs=seq_start.numel(), num_groups=num_groups, seq_start=seq_start,
        seq_len=seq_len, max_seq_len=max_seq_len, token_seq=token_seq, seq_group=seq_group,
        group_offsets=group_offsets, group_members=group_members, max_group_size=max_group_size,
        group_size=group_size or None, padded_len=padded_len or None,
    )
    result = backend_by_key(backend).group_targets(token_logprobs, layout, scores, old_seq_logprobs=old_seq_logprobs,
                                                   seq_log_weights=seq_log_weights,
                                                   **GroupRule.from_op(rule).kernel_args())
    return result.to_op()


@_group_targets_op.register_fake
def _(token_logprobs, seq_start, seq_len, token_seq, seq_group, group_offsets, group_members,
      num_groups, max_seq_len, max_group_size, group_size, padded_len, scores, old_seq_logprobs, seq_log_weights, rule,
      backend):
    n = seq_start.shape[0]
    per_seq = [token_logprobs.new_empty(n) for _ in range(4)]
    return (*per_seq, token_logprobs.new_empty(num_groups), token_logprobs.new_empty(n))


def _setup_context(ctx, inputs, output):
    _token_logprobs, _seq_start, _seq_len, token_seq, seq_group, *_ = inputs  # the op schema
    _seq_logprobs, _u, _p, _q, _group_loss, coef = output  # GroupResult.to_op's order
    ctx.save_for_backward(coef, token_seq, seq_group)


def _backward(ctx, grad_seq_logprobs, grad_u, grad_p, grad_q, grad_group_loss, grad_coef):
    coef, token_seq, seq_group = ctx.saved_tensors
    grad_seq = coef * grad_group_loss[seq_group]  # coef = p - q
    if grad_seq_logprobs is not None:
        grad_seq = grad_seq + grad_seq_logprobs
    inside = token_seq >= 0
    grad_tokens = torch.where(inside, grad_seq[token_seq.clamp(min=0)], 0.0)
    return (grad_tokens,) + (None,) * (len(ctx.needs_input_grad) - 1)  # layout fields and settings


_group_targets_op.register_autograd(_backward, setup_context=_setup_context)


def group_targets(token_logprobs: Tensor, layout: BatchLayout, scores: Tensor, *,
                  old_seq_logprobs: Optional[Tensor], rule: GroupRule, backend: str,
                  seq_log_weights: Optional[Tensor] = None) -> GroupResult:
    """The group op through the dispatcher: differentiable in ``token_logprobs`` (through
    ``seq_logprobs`` and ``group_loss``) and traceable by ``torch.compile``; ``rule`` travels
    whole (:meth:`GroupRule.to_op`); ``seq_log_weights``: ``[N]`` float64 ``lw``, or None."""
    outputs = _group_targets_op(token_logprobs, *layout_op_args(layout), scores, old_seq_logprobs, seq_log_weights,
                                rule.to_op(), backend)
    return GroupResult.from_op(outputs)


@dataclass(frozen=True)
class LossWeights:
    """How the group stage weighs and reduces its terms around the group op: the reduction over
    groups, and the weights of the token-mean terms beside the group term (``beta``: the k3
    KL-to-reference term; ``entropy_coef``: the entropy bonus, subtracted)."""

    reduction: str = "mean"
    beta: float = 0.0
    entropy_coef: float = 0.0


def reduce_groups(group_loss: Tensor, reduction: str) -> Tensor:
    """The loss from per-group losses: mean over groups (weight 1/G), sum, or none."""
    if reduction == "mean":
        return group_loss.mean()
    if reduction == "sum":
        return group_loss.sum()
    return group_loss


class RowGather(Protocol):
    """Where the group stage's completions live when they are split over ranks
    (:class:`tpo_kernels.distributed.GroupGather`)."""

    world: int
    mine: slice

    def rows(self, local: Tensor) -> Tensor: ...

    def layout(self, kept: Optional[Tensor], device: torch.device) -> BatchLayout: ...


class RowSum(Protocol):
    """Where the tokens of each completion live when its positions are split over ranks
    (:class:`tpo_kernels.distributed.ContextSum`): ``sum`` returns every rank's ``[N, C]``
    partials added up (the same on every rank; ``partials`` is left as it is), ``world`` ranks."""

    world: int

    def sum(self, partials: Tensor) -> Tensor: ...


@dataclass(frozen=True)
class CompletionInputs:
    """The per-completion inputs of the group stage, ``[N]`` each.

    ``scores``; ``seq_log_weights``: the log-weights ``lw`` (float64, finite or -inf; replicated
    over context ranks and never summed, like the scores); ``old_seq_logprobs``: the old sequence
    log-probs as the group op takes them (summed
    or, with ``length_normalize``, averaged; replicated over context ranks, never summed there);
    ``old_token_sums``: with the positions split over ranks, this rank's sums of per-token old
    log-probs over its counted tokens (unweighted; summed over the ranks, then divided by the
    global count with ``length_normalize``), in place of ``old_seq_logprobs``. ``kept``: the
    completions with a counted token (None: all, or unchecked); ``kept_after_sum``: decided on
    the summed counts instead (positions split, ``validate=True``)."""

    scores: Tensor
    seq_log_weights: Optional[Tensor] = None
    old_seq_logprobs: Optional[Tensor] = None
    old_token_sums: Optional[Tensor] = None
    kept: Optional[Tensor] = None
    kept_after_sum: bool = False


@dataclass(frozen=True)
class RankSeams:
    """How the batch of this call is split over ranks: ``gather``, its completions (data
    parallel); ``context``, each completion's positions (context parallel). Neither: one rank."""

    gather: Optional[RowGather] = None
    context: Optional[RowSum] = None


class _Replicated(torch.autograd.Function):
    """Every rank's ``[N_r, C]`` rows, gathered. The computation downstream is replicated (every
    rank runs it on the same rows), so the gradient of the gathered rows is the same on every
    rank and its true backward, a sum over ranks of identical slices, is ``P`` times this rank's
    slice: no collective in the backward."""

    @staticmethod
    def forward(ctx, local: Tensor, gather: RowGather) -> Tensor:
        ctx.mine, ctx.world = gather.mine, gather.world
        return gather.rows(local)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[ctx.mine] * ctx.world, None


class _Summed(torch.autograd.Function):
    """Every rank's ``[N, C]`` partials, summed. As for :class:`_Replicated`, everything after
    the sum is computed alike on every rank, so each holds the same gradient ``G`` of the sum;
    the true backward of a sum that feeds ``S`` identical copies is the sum of their ``S``
    identical gradients, ``S * G``, for every rank's partials: no collective in the backward."""

    @staticmethod
    def forward(ctx, partials: Tensor, seam: RowSum) -> Tensor:
        ctx.world = seam.world
        return seam.sum(partials)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.world, None


class LocalRows:
    """The gather's stand-in when the completions are all on this rank (their positions split
    over context ranks): identity rows, and the groups of the token layout as one-"token"
    completions ``[N, 1]``, left-out completions decided on the summed counts."""

    world = 1

    def __init__(self, token_layout: BatchLayout) -> None:
        self.token_layout = token_layout
        self.mine = slice(0, token_layout.num_seqs)

    def rows(self, local: Tensor) -> Tensor:
        return local

    def layout(self, kept: Optional[Tensor], device: torch.device) -> BatchLayout:
        """``kept`` None: every completion takes part (no read-back); else one read-back
        (``kept.all()``) and, when some are left out, the layout of the kept ones (three more)."""
        groups, n = self.token_layout, self.token_layout.num_seqs
        if kept is None or bool(kept.all()):  # the same groups, their completions one row each
            rows = torch.arange(n, device=device, dtype=torch.int64)
            return dataclasses.replace(groups, num_tokens=n, seq_start=rows, seq_len=torch.ones_like(rows),
                                       max_seq_len=1, token_seq=rows, padded_len=1)
        grouping = (dict(group_size=groups.group_size) if groups.group_size is not None
                    else dict(group_ids=groups.seq_group))
        return build_layout(n, device, padded_shape=(n, 1), members=kept, **grouping)


class GroupObjective:
    """The group stage every TPO loss runs on the output of its row op: the group op, the
    reduction over groups and, for sequence-level TPO, the optional k3 KL-to-reference term
    ``beta * mean_t(exp(r - lp) - (r - lp) - 1)`` over counted tokens (per group for
    ``reduction="none"``). Token-level TPO is the special case of one-token "completions" with
    the K candidates of a state as a group (:func:`tpo_kernels.group_math.candidate_layout`).

    ``completions`` (:class:`CompletionInputs`): scores, old sequence log-probs, kept.
    ``seams`` (:class:`RankSeams`): with a ``gather`` the completions are split over ranks: each
    rank's per-completion rows (sequence log-prob, score, kept, old sequence log-prob, token-term
    sums) are gathered and every rank runs the same group op on the whole batch, in float64 (the
    group op's own precision). With a ``context`` sum each completion's positions are split over
    ranks: each rank sums its counted tokens per completion in float64 (:meth:`partials`), the
    ranks' partials are summed, and what needs the whole completion is decided on the sums: kept
    iff a token counts on some rank, length normalization by the global count, token means over
    every rank's tokens. The KL term, the reduction, the ``1/G`` weight and the aux are the same
    code every way. Everything is differentiable through autograd; :meth:`aux` gives detached
    results.

    ``rule`` (:class:`~tpo_kernels.group_math.GroupRule`): the group op's settings, carried to it
    whole; with ``rule.length_normalize`` (sequence-level, needs ``valid``) each sequence log-prob
    is the mean over its counted tokens, through per-token weights ``1/n_i`` applied before the
    group op (exact gradients; ``old_seq_logprobs`` are expected in the same convention), or,
    with a ``context`` sum, the summed log-probs divided by the summed count (a constant: ``d ell
    / d lp_t = 1/n``, as in one process). The KL term and ``aux["token_logprobs"]`` keep the token
    log-probs themselves. ``weights`` (:class:`LossWeights`): the reduction and the weights of the
    token-mean terms."""

    def __init__(self, layout: BatchLayout, completions: CompletionInputs, *, rule: GroupRule, weights: LossWeights,
                 backend: str, ref_logprobs: Optional[Tensor] = None, valid: Optional[Tensor] = None,
                 seams: RankSeams = RankSeams()) -> None:
        self.layout, self.completions = layout, completions
        self.scores, self.old_seq_logprobs = completions.scores, completions.old_seq_logprobs
        self.kept = completions.kept
        self.rule, self.weights, self.reduction, self.backend = rule, weights, weights.reduction, backend
        self.ref_logprobs, self.valid = ref_logprobs, valid
        self.seams, self.gather = seams, seams.gather
        self.token_logprobs: Optional[Tensor] = None
        self.result: Optional[GroupResult] = None
        self.group_layout: BatchLayout = layout  # the layout of the groups: of the rows with a seam
        self.mine = slice(0, layout.num_seqs)  # this rank's completions in group_layout

    def _token_terms(self, token_logprobs: Tensor, token_entropy: Optional[Tensor]):
        """The token-mean terms beside the group term (the k3 KL term, the entropy bonus): their
        weights and their ``[M]`` values, 0 at tokens that do not count."""
        weights, token_terms = [], []
        if self.weights.beta > 0:
            weights.append(self.weights.beta)
            token_terms.append(self._k3_terms(token_logprobs))
        if self.weights.entropy_coef > 0:
            weights.append(-self.weights.entropy_coef)
            token_terms.append(torch.where(self.valid, token_entropy.to(token_logprobs.dtype), 0.0))
        return weights, token_terms

    def forward(self, token_logprobs: Tensor, token_entropy: Optional[Tensor] = None) -> Tensor:
        """The loss from flat ``[M]`` token log-probs (0 on rows that do not count) and, with
        ``entropy_coef > 0``, the ``[M]`` token entropies of the same row op (differentiable)."""
        self.token_logprobs = token_logprobs
        weights, token_terms = self._token_terms(token_logprobs, token_entropy)
        if self.seams.context is not None:
            sums, seq_counted = self._context_rows(token_logprobs, token_terms)
        else:
            # The token terms' per-completion sums with the counted tokens', in one segment sum.
            sums, seq_counted = [], None
            if token_terms:
                token_terms.append(self.valid.to(token_logprobs.dtype))
                seq_columns = segment_sum(torch.stack(token_terms, dim=1), self.layout)
                sums, seq_counted = list(seq_columns[:, :-1].unbind(1)), seq_columns[:, -1]
            if self.rule.length_normalize:  # the sequence sums become means over counted tokens
                token_logprobs = token_logprobs * length_weights(self.valid, self.layout, token_logprobs.dtype)
            if self.gather is None:
                self.result = group_targets(token_logprobs, self.layout, self.scores,
                                            old_seq_logprobs=self.old_seq_logprobs, rule=self.rule,
                                            backend=self.backend,
                                            seq_log_weights=self.completions.seq_log_weights)
            else:
                wide = torch.float64
                kept = torch.ones(self.layout.num_seqs, dtype=torch.bool, device=token_logprobs.device) \
                    if self.kept is None else self.kept
                sums, seq_counted = self._group_on_rows(
                    segment_sum(token_logprobs.to(wide), self.layout), kept, self.old_seq_logprobs,
                    [seq_sums.to(wide) for seq_sums in sums], None if seq_counted is None else seq_counted.to(wide))
        loss = reduce_groups(self.result.group_loss, self.reduction)
        for weight, seq_sums in zip(weights, sums):
            loss = loss + weight * self._token_mean(seq_sums, seq_counted)
        return loss.to(token_logprobs.dtype)

    def partials(self, token_logprobs: Tensor, token_entropy: Optional[Tensor] = None) -> Tensor:
        """This rank's ``[N, C]`` float64 per-completion sums over its counted tokens, the columns
        a ``context`` sum adds up: the log-probs, the count, the old log-probs (per-token old
        only), then the token terms (k3, entropy; those enabled). Differentiable."""
        _, token_terms = self._token_terms(token_logprobs, token_entropy)
        return self._partials(token_logprobs, token_terms)

    def _partials(self, token_logprobs: Tensor, token_terms: List[Tensor]) -> Tensor:
        wide = torch.float64
        columns = [token_logprobs.to(wide), self.valid.reshape(-1).to(wide)] + [t.to(wide) for t in token_terms]
        sums = segment_sum(torch.stack(columns, dim=1), self.layout)
        if self.completions.old_token_sums is None:
            return sums
        return torch.cat([sums[:, :2], self.completions.old_token_sums.to(wide)[:, None], sums[:, 2:]], dim=1)

    def _context_rows(self, token_logprobs: Tensor, token_terms: List[Tensor]):
        """Every rank's partials summed (:class:`_Summed`), the completion-wide decisions taken on
        the sums, then the group stage on the completion rows; returns the token terms' summed
        per-completion sums and counts."""
        summed = _Summed.apply(self._partials(token_logprobs, token_terms), self.seams.context)
        counted = summed[:, 1].detach()  # exact integer counts
        per_count = 1.0 / counted.clamp(min=1.0)
        ell = summed[:, 0] * per_count if self.rule.length_normalize else summed[:, 0]
        first_term, old = 2, self.old_seq_logprobs
        if self.completions.old_token_sums is not None:
            first_term, old = 3, summed[:, 2].detach()
            old = old * per_count if self.rule.length_normalize else old
        kept = self.kept
        if self.completions.kept_after_sum:  # left out everywhere: no counted token on any rank, or w = 0
            kept = counted > 0
            if self.completions.seq_log_weights is not None:
                kept = kept & (self.completions.seq_log_weights > float("-inf"))
        decided = kept is not None
        if kept is None:
            kept = torch.ones(self.layout.num_seqs, dtype=torch.bool, device=token_logprobs.device)
        return self._group_on_rows(ell, kept, old, list(summed[:, first_term:].unbind(1)), counted,
                                   decided=decided)

    def _group_on_rows(self, ell: Tensor, kept: Tensor, old: Optional[Tensor], sums: List[Tensor],
                       seq_counted: Optional[Tensor], decided: bool = True):
        """The group op on completion rows (float64): every rank's, gathered with a ``gather``,
        this rank's otherwise. ``decided``: ``kept`` was checked (else every completion takes part
        and the gather's stand-in reads nothing back). Returns the rows of the token terms' sums
        and of the counts."""
        wide = torch.float64
        columns = [ell, self.scores.to(wide), kept.to(wide)]
        lw = self.completions.seq_log_weights
        for extra in (old, lw):  # one float64 column each, after the kept flag
            if extra is not None:
                columns.append(extra.to(wide))
        first_sum = len(columns)
        columns += sums
        if seq_counted is not None:
            columns.append(seq_counted)
        stacked = torch.stack(columns, dim=1)
        if self.gather is None:
            gather = LocalRows(self.layout)
            rows = stacked
            self.group_layout = gather.layout(kept if decided else None, stacked.device)
        else:
            gather = self.gather
            rows = _Replicated.apply(stacked, gather)
            self.group_layout = gather.layout(rows[:, 2] != 0, stacked.device)
        self.mine = gather.mine
        old_rows = rows[:, 3].detach().contiguous() if old is not None else None
        lw_rows = rows[:, first_sum - 1].detach().contiguous() if lw is not None else None
        self.result = group_targets(rows[:, 0].contiguous(), self.group_layout, rows[:, 1].detach().contiguous(),
                                    old_seq_logprobs=old_rows, rule=self.rule, backend=self.backend,
                                    seq_log_weights=lw_rows)
        gathered_sums = [rows[:, first_sum + i] for i in range(len(sums))]
        return gathered_sums, (None if seq_counted is None else rows[:, -1].detach())

    def _k3_terms(self, token_logprobs: Tensor) -> Tensor:
        """Per token: the k3 estimate of KL(pi || pi_ref), 0 where not counted."""
        diff = self.ref_logprobs - token_logprobs
        return torch.where(self.valid, torch.exp(diff) - diff - 1.0, 0.0)

    def _token_mean(self, seq_sums: Tensor, seq_counted: Tensor) -> Tensor:
        """A token term's reduction: the mean over every counted token of the batch (every
        rank's with a seam) for ``"mean"``, their sum for ``"sum"``, the mean over each group's
        counted tokens for ``"none"``. A term over no counted token is 0."""
        if self.reduction == "mean":
            return seq_sums.sum() / seq_counted.sum().clamp(min=1)
        if self.reduction == "sum":
            return seq_sums.sum()
        return group_sum(seq_sums, self.group_layout) / group_sum(seq_counted, self.group_layout).clamp(min=1)

    def loss_weight(self) -> float:
        return 1.0 / self.group_layout.num_groups if self.reduction == "mean" else 1.0

    def aux(self) -> dict:
        """Detached per-token and per-member results of this rank's completions and per-group
        results of every group; ``coef`` is ``dLoss/d ell`` of the group term, ``w * (p - q)``
        with ``w = 1/G`` for the mean. With a gather, ``seq_offset`` is the index of this rank's
        first completion in the gathered batch."""
        r, layout, mine, out = self.result, self.group_layout, self.mine, self.token_logprobs.dtype
        p, q = r.p.detach(), r.q.detach()
        # Per-group metrics; 0 * log 0 = 0.
        log_p, log_q = torch.log(p), torch.log(q)
        q_log_q = torch.where(q > 0, q * log_q, 0.0)
        aux = {
            "token_logprobs": self.token_logprobs.detach(),
            "seq_logprobs": r.seq_logprobs.detach()[mine],
            "p": p[mine],
            "q": q[mine],
            "u": r.u.detach()[mine],
            "coef": r.coef.detach()[mine] * self.loss_weight(),
            "group_loss": r.group_loss.detach(),
        }
        # The per-group metrics in one group sum.
        per_member = torch.stack([q_log_q - torch.where(q > 0, q * log_p, 0.0), torch.where(p > 0, p * log_p, 0.0),
                                  q_log_q, (p != q).to(p.dtype)], dim=1)
        kl_q_p, p_log_p, q_log_q_sum, differing = group_sum(per_member, layout).unbind(1)
        aux.update(kl_q_p=kl_q_p, entropy_p=-p_log_p, entropy_q=-q_log_q_sum)
        aux = {name: value.to(out) for name, value in aux.items()}
        aux["zero_signal"] = differing == 0
        if self.gather is not None:
            aux["seq_offset"] = mine.start
        return aux
