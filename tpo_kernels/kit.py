"""The integration kit: what a trainer adapter takes from the core, public and in one place.

A trainer integration (``tpo_kernels/integrations/``: TRL, verl) is an adapter from the trainer's
batch to the public losses. What every adapter needs beyond the losses is here, so that none
re-solves it or reaches into the package's internals (a test holds the integrations to this
module and the package's top-level names):

* :func:`standardize_scores`: the one score-standardization rule, the group stage's own
  (population std, overflow-safe at any score range; centered, undivided, when the std is at
  most ``score_eps``; 0 for a tie), for scores standardized before the loss (an advantage
  estimator, a per-reward normalization), with groups given by id in any row order;
* :class:`LossRows` and :func:`add_constant_members`: a loss call's completions, and the
  members of their groups that take part in each group's ``p`` and ``q`` without gradient
  (rows of another micro-step, a recorded mini-batch);
* :func:`gather_rows` (every rank's rows, :class:`RowGather`), :func:`sum_over_ranks` and
  :func:`token_mean` (a mean over every rank's counted tokens): the trainer's own collectives,
  through the counted ones of :mod:`tpo_kernels.distributed` (:func:`count_collectives` sees
  them), the only ones an integration issues;
* the argument checks of the losses' settings, for a trainer that takes them ahead of a call.

Example: a micro-step holds rows 0 and 1 of a group of three whose third row another micro-step
computed (its token log-probs detached); the loss is the whole group's, the gradient flows into
this micro-step's rows::

    import torch
    import tpo_kernels
    from tpo_kernels import kit

    logprobs = (-torch.rand(2, 4)).requires_grad_()
    own = kit.LossRows(logprobs=logprobs, scores=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([5, 5]))
    other = kit.LossRows(logprobs=-torch.rand(1, 4), scores=torch.tensor([2.0]), group_ids=torch.tensor([5]))
    rows = kit.add_constant_members(own, other)
    loss = tpo_kernels.tpo_loss_from_logprobs(**rows.loss_inputs(), eta=0.5)
    loss.backward()  # logprobs.grad: the whole group's gradient of rows 0 and 1
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from .checks.arguments import check_flag, check_positive, check_score_eps
from .distributed import count_collectives
from .distributed.rows import RowGather, gather_rows, sum_over_ranks, token_mean
from .group_math import standardize_dense


def standardize_scores(scores: Tensor, group_ids: Tensor, *, valid: Optional[Tensor] = None,
                       score_eps: float = 1e-6) -> Tensor:
    """``u`` (float64, ``[N]``): each score standardized within its group, as the losses do.

    Args:
        scores: ``[N]`` float scores (any finite range: 1e300 and float32's max are exact).
        group_ids: ``[N]`` integer group of each score, in any row order.
        valid: ``[N]`` bool, the scores that count (the others, which may be NaN, get ``u = 0``
            and stay out of their group's mean and std); None: all.
        score_eps: a group whose population std is at most this keeps its centered scores
            ``s - mean``, undivided (0: all but exact ties are divided by their std).

    A group whose counted scores tie exactly (``max == min``) gets ``u = 0``. Raises
    ``ValueError`` for a counted score that is not finite.
    """
    if not isinstance(scores, Tensor) or scores.dim() != 1 or not scores.is_floating_point():
        raise ValueError(f"scores must be a [N] float tensor, got {_described(scores)}")
    if not isinstance(group_ids, Tensor) or tuple(group_ids.shape) != tuple(scores.shape) \
            or group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be a [N] integer tensor like scores {tuple(scores.shape)}, got "
                         f"{_described(group_ids)}")
    if valid is not None and (not isinstance(valid, Tensor) or valid.dtype != torch.bool
                              or tuple(valid.shape) != tuple(scores.shape)):
        raise ValueError(f"valid must be None or a [N] bool tensor like scores {tuple(scores.shape)}, got "
                         f"{_described(valid)}")
    score_eps = check_score_eps(score_eps)
    values = scores.to(torch.float64)
    counted = torch.ones_like(values, dtype=torch.bool) if valid is None else valid.to(values.device)
    if bool((counted & ~torch.isfinite(values)).any()):
        raise ValueError("scores: a counted score is NaN or infinite; standardization needs finite scores")
    if values.numel() == 0:
        return values
    # The dense [G, K] layout of the group stage: one row per group, its members in row order.
    _, group_of, sizes = torch.unique(group_ids.to(values.device), return_inverse=True, return_counts=True)
    order = torch.argsort(group_of, stable=True)
    sorted_groups = group_of[order]
    starts = torch.cumsum(sizes, 0) - sizes
    slot = torch.arange(len(order), device=values.device) - starts[sorted_groups]
    dense = values.new_zeros(len(sizes), int(sizes.max()))
    members = torch.zeros(dense.shape, dtype=torch.bool, device=values.device)
    dense[sorted_groups, slot] = torch.where(counted, values, 0.0)[order]
    members[sorted_groups, slot] = counted[order]
    u = torch.empty_like(values)
    u[order] = standardize_dense(dense, members, score_eps)[sorted_groups, slot]
    return u


@dataclass(frozen=True)
class LossRows:
    """The completions of one loss call, as :func:`tpo_kernels.tpo_loss_from_logprobs` takes them
    (:meth:`loss_inputs`).

    ``logprobs``: token log-probs, ``[N, T]`` padded (with ``mask``) or ``[M]`` packed (with
    ``cu_seqlens``, ``[N + 1]``); ``scores``, ``group_ids``: ``[N]``; ``mask``: the counted tokens
    (None: all); ``old_logprobs``: per token (``logprobs``' shape) or per completion (``[N]``),
    or None; ``ref_logprobs``, ``token_entropy``: per token, or None (the entropy rides along for
    :func:`token_mean`; the loss does not read it); ``seq_log_weights``: ``[N]`` per-completion
    log-weights (``log w``; ``-inf`` leaves a completion out of its group), or None."""

    logprobs: Tensor
    scores: Tensor
    group_ids: Tensor
    mask: Optional[Tensor] = None
    cu_seqlens: Optional[Tensor] = None
    old_logprobs: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    token_entropy: Optional[Tensor] = None
    seq_log_weights: Optional[Tensor] = None

    @property
    def num_rows(self) -> int:
        return self.scores.shape[0]

    def loss_inputs(self) -> Dict[str, Any]:
        """The keywords of :func:`tpo_kernels.tpo_loss_from_logprobs` these rows fill."""
        return dict(logprobs=self.logprobs, scores=self.scores, group_ids=self.group_ids, mask=self.mask,
                    cu_seqlens=self.cu_seqlens, old_logprobs=self.old_logprobs, ref_logprobs=self.ref_logprobs,
                    seq_log_weights=self.seq_log_weights)


# Per-token fields (padded along the token dimension when widths differ); the rest are per completion.
_TOKEN_FIELDS = ("logprobs", "mask", "ref_logprobs", "token_entropy")


def add_constant_members(rows: LossRows, members: LossRows) -> LossRows:
    """``rows`` followed by ``members``: completions of ``rows``' groups that take part in each
    group's ``p`` and ``q`` (and its KL and entropy token means) but carry no gradient.

    Their values must be the ones the current parameters give (computed by a no-grad forward
    of the same step, or recorded): the loss of the joined rows is then the whole groups' loss
    and its gradient the whole groups' gradient with respect to ``rows``, so the calls that
    hold the other members add up to the unsplit step. ``members`` are detached and moved to
    each field's device and dtype in ``rows``; both must have the same layout (padded: widths
    may differ, padded with uncounted tokens; packed: ``cu_seqlens`` continue) and the same
    optional fields. ``group_ids`` are then required on both (a group is found by its id)."""
    if rows.group_ids is None or members.group_ids is None:
        raise ValueError("members: rows and members need group_ids (a member finds its group by its id)")
    if (rows.cu_seqlens is None) != (members.cu_seqlens is None):
        raise ValueError("members: rows and members must both be packed (cu_seqlens) or both padded")
    if rows.mask is None and rows.cu_seqlens is None and rows.logprobs.shape[1:] != members.logprobs.shape[1:]:
        raise ValueError("members: rows of different widths need a mask (the padding must not count)")
    joined = {}
    for field in dataclasses.fields(LossRows):
        mine, theirs = getattr(rows, field.name), getattr(members, field.name)
        if (mine is None) != (theirs is None):
            raise ValueError(f"members.{field.name}: given for {'rows' if theirs is None else 'members'} only; "
                             "rows and members must carry the same fields")
        if mine is None:
            joined[field.name] = None
            continue
        theirs = theirs.detach().to(device=mine.device, dtype=mine.dtype)
        if field.name == "cu_seqlens":
            joined[field.name] = torch.cat([mine, theirs[1:] - theirs[0] + mine[-1]])
            continue
        per_token = field.name in _TOKEN_FIELDS or (field.name == "old_logprobs" and mine.dim() == rows.logprobs.dim())
        if per_token and rows.cu_seqlens is None and mine.shape[1:] != theirs.shape[1:]:
            width = max(mine.shape[1], theirs.shape[1])
            mine, theirs = _widened(mine, width), _widened(theirs, width)
        joined[field.name] = torch.cat([mine, theirs])
    return LossRows(**joined)


def _widened(x: Tensor, width: int) -> Tensor:
    """``[N, T]`` -> ``[N, width]``, the new columns zero (False): uncounted padding."""
    if x.shape[1] == width:
        return x
    wide = x.new_zeros((x.shape[0], width))
    wide[:, : x.shape[1]] = x
    return wide


def _described(value) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


__all__ = ["LossRows", "RowGather", "add_constant_members", "check_flag", "check_positive",
           "check_score_eps", "count_collectives", "gather_rows", "standardize_scores", "sum_over_ranks",
           "token_mean"]
