"""``tpo_kernels::group_targets``: the group op as a custom op with its autograd rule, and
:class:`GroupObjective`, the group stage (group op, reduction, KL term) shared by every loss.

Forward: the backend's group op (:func:`tpo_kernels.group_op.group_targets` or a fused kernel)
from flat token log-probs to ``(seq_logprobs, u, p, q, group_loss, coef)``. Backward: q is a
constant of the loss, so ``d group_loss[g] / d ell[i] = p[i] - q[i]`` (``coef``, formed by the
group op in float64 before rounding) for the members of g, and every token of completion i
receives ``d ell[i]`` (the token sums are linear). A tied on-policy group
has ``p == q`` bit for bit, so its tokens get exactly zero.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backends import backend_by_key
from ..group_op import GroupResult, group_sum, segment_sum
from ..layout import BatchLayout


@torch.library.custom_op("tpo_kernels::group_targets", mutates_args=())
def _group_targets(
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
    eta: float,
    anchor: bool,
    score_eps: float,
    backend: str,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    layout = BatchLayout.from_op_args(
        seq_start, seq_len, token_seq, seq_group, group_offsets, group_members, num_groups,
        max_seq_len, max_group_size, group_size, padded_len,
    )
    result = backend_by_key(backend).group_targets(
        token_logprobs, layout, scores, old_seq_logprobs=old_seq_logprobs, eta=eta, anchor=anchor,
        score_eps=score_eps,
    )
    coef = result.p - result.q if result.coef is None else result.coef
    return (result.seq_logprobs, result.u, result.p, result.q, result.group_loss, coef)


@_group_targets.register_fake
def _(token_logprobs, seq_start, seq_len, token_seq, seq_group, group_offsets, group_members,
      num_groups, max_seq_len, max_group_size, group_size, padded_len, scores, old_seq_logprobs,
      eta, anchor, score_eps, backend):
    n = seq_start.shape[0]
    per_seq = [token_logprobs.new_empty(n) for _ in range(4)]
    return (*per_seq, token_logprobs.new_empty(num_groups), token_logprobs.new_empty(n))


def _setup_context(ctx, inputs, output):
    token_seq, seq_group = inputs[3], inputs[4]
    coef = output[5]
    ctx.save_for_backward(coef, token_seq, seq_group)


def _backward(ctx, grad_seq_logprobs, grad_u, grad_p, grad_q, grad_group_loss, grad_coef):
    coef, token_seq, seq_group = ctx.saved_tensors
    grad_seq = coef * grad_group_loss[seq_group]  # coef = p - q
    if grad_seq_logprobs is not None:
        grad_seq = grad_seq + grad_seq_logprobs
    inside = token_seq >= 0
    grad_tokens = torch.where(inside, grad_seq[token_seq.clamp(min=0)], 0.0)
    return (grad_tokens,) + (None,) * 17


_group_targets.register_autograd(_backward, setup_context=_setup_context)


def group_targets(token_logprobs: Tensor, layout: BatchLayout, scores: Tensor, *,
                  old_seq_logprobs: Optional[Tensor], eta: float, anchor: bool, backend: str,
                  score_eps: float = 0.0) -> GroupResult:
    """The group op through the dispatcher: differentiable in ``token_logprobs`` (through
    ``seq_logprobs`` and ``group_loss``) and traceable by ``torch.compile``. ``score_eps``: the
    near-tie tolerance of :func:`tpo_kernels.group_op.standardize_dense`."""
    outputs = _group_targets(token_logprobs, *layout.op_args(), scores, old_seq_logprobs, eta, anchor, score_eps,
                             backend)
    return GroupResult(*outputs)


def reduce_groups(group_loss: Tensor, reduction: str) -> Tensor:
    """The loss from per-group losses: mean over groups (weight 1/G), sum, or none."""
    if reduction == "mean":
        return group_loss.mean()
    if reduction == "sum":
        return group_loss.sum()
    return group_loss


class GroupObjective:
    """The group stage every TPO loss runs on the output of its row op: the group op, the
    reduction over groups and, for sequence-level TPO, the optional k3 KL-to-reference term
    ``beta * mean_t(exp(r - lp) - (r - lp) - 1)`` over counted tokens (per group for
    ``reduction="none"``). Token-level TPO is the special case of one-token "completions" with
    the K candidates of a state as a group (:func:`tpo_kernels.layout.candidate_layout`).
    Everything is differentiable through autograd; :meth:`aux` gives detached results."""

    def __init__(self, layout: BatchLayout, scores: Tensor, *, old_seq_logprobs: Optional[Tensor], eta: float,
                 anchor: bool, reduction: str, backend: str, beta: float = 0.0,
                 ref_logprobs: Optional[Tensor] = None, valid: Optional[Tensor] = None) -> None:
        self.layout, self.scores, self.old_seq_logprobs = layout, scores, old_seq_logprobs
        self.eta, self.anchor, self.reduction, self.backend = eta, anchor, reduction, backend
        self.beta, self.ref_logprobs, self.valid = beta, ref_logprobs, valid
        self.token_logprobs: Optional[Tensor] = None
        self.result: Optional[GroupResult] = None

    def forward(self, token_logprobs: Tensor) -> Tensor:
        """The loss from flat ``[M]`` token log-probs (0 on rows that do not count)."""
        self.token_logprobs = token_logprobs
        self.result = group_targets(token_logprobs, self.layout, self.scores, old_seq_logprobs=self.old_seq_logprobs,
                                    eta=self.eta, anchor=self.anchor, backend=self.backend)
        loss = reduce_groups(self.result.group_loss, self.reduction)
        if self.beta > 0:
            loss = loss + self.beta * self._k3_term(token_logprobs)
        return loss

    def _k3_term(self, token_logprobs: Tensor) -> Tensor:
        diff = self.ref_logprobs - token_logprobs
        k3 = torch.where(self.valid, torch.exp(diff) - diff - 1.0, 0.0)
        counted = self.valid.to(k3.dtype)
        if self.reduction == "mean":
            return k3.sum() / counted.sum()
        if self.reduction == "sum":
            return k3.sum()
        per_group = group_sum(segment_sum(k3, self.layout), self.layout)
        return per_group / group_sum(segment_sum(counted, self.layout), self.layout)

    def loss_weight(self) -> float:
        return 1.0 / self.layout.num_groups if self.reduction == "mean" else 1.0

    def aux(self) -> dict:
        """Detached per-token, per-member and per-group results; ``coef`` is ``dLoss/d ell``
        of the group term, ``w * (p - q)`` with ``w = 1/G`` for the mean."""
        r = self.result
        p, q = r.p.detach(), r.q.detach()
        # Per-group metrics; 0 * log 0 = 0.
        log_p, log_q = torch.log(p), torch.log(q)
        q_log_q = torch.where(q > 0, q * log_q, 0.0)
        return {
            "token_logprobs": self.token_logprobs.detach(),
            "seq_logprobs": r.seq_logprobs.detach(),
            "p": p,
            "q": q,
            "u": r.u.detach(),
            "coef": r.coef.detach() * self.loss_weight(),
            "group_loss": r.group_loss.detach(),
            "kl_q_p": group_sum(q_log_q - torch.where(q > 0, q * log_p, 0.0), self.layout),
            "entropy_p": -group_sum(torch.where(p > 0, p * log_p, 0.0), self.layout),
            "entropy_q": -group_sum(q_log_q, self.layout),
            "zero_signal": group_sum((p != q).to(p.dtype), self.layout) == 0,
        }
