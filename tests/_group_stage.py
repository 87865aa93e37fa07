"""The sequence-level group stage of one backend on a batch, composed the way the losses compose
it: token log-probs (``reference.token_logprobs``, plain autograd), the batch layout, the
length-normalizing weights when asked, ``tpo_kernels::group_targets`` and the mean over groups.
The tests of the group op's semantics (score_eps, length_normalize) compare it with
``reference.tpo_loss`` (``assert_matches_reference``)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from tpo_kernels import reference
from tpo_kernels.backends import backend_key, get_backend
from tpo_kernels.group_math import GroupResult, GroupRule, build_layout, length_weights, segment_sum
from tpo_kernels.ops.group import group_targets


def group_stage_loss(logits: Tensor, labels: Tensor, scores: Tensor, *, backend: str,
                     group_size: Optional[int] = None, group_ids: Optional[Tensor] = None,
                     cu_seqlens: Optional[Tensor] = None, old_logprobs: Optional[Tensor] = None,
                     eta: float = 1.0, anchor: bool = True, score_eps: float = 0.0,
                     length_normalize: bool = False) -> tuple[Tensor, GroupResult]:
    valid = (labels != -100).reshape(-1)
    token_lp = reference.token_logprobs(logits, labels).reshape(-1)
    padded_shape = tuple(labels.shape) if cu_seqlens is None else None
    layout = build_layout(token_lp.numel(), token_lp.device, padded_shape=padded_shape, cu_seqlens=cu_seqlens,
                          group_size=group_size, group_ids=group_ids)
    if length_normalize:
        token_lp = token_lp * length_weights(valid, layout, token_lp.dtype)
    old_seq = None
    if old_logprobs is not None and old_logprobs.shape == labels.shape:  # per token: summed / averaged
        old_tokens = torch.where(valid, old_logprobs.reshape(-1).to(torch.float64), 0.0)
        if length_normalize:
            old_tokens = old_tokens * length_weights(valid, layout, torch.float64)
        old_seq = segment_sum(old_tokens, layout)
    elif old_logprobs is not None:  # per completion: as given
        old_seq = old_logprobs.to(torch.float64)
    key = backend_key(get_backend(backend, token_lp.device))
    rule = GroupRule(eta=eta, anchor=anchor, score_eps=score_eps, length_normalize=length_normalize)
    result = group_targets(token_lp, layout, scores.to(torch.float64), old_seq_logprobs=old_seq, rule=rule, backend=key)
    return result.group_loss.mean(), result


def assert_matches_reference(logits: Tensor, labels: Tensor, scores: Tensor, *, backend: str, tol: float,
                             **settings) -> tuple[GroupResult, dict]:
    """``group_stage_loss`` on ``backend`` against ``reference.tpo_loss`` on the float64 logits with
    the same ``settings``: the loss and its gradient in the logits agree at ``rtol = atol = tol``.
    Returns the group op's result and the reference's aux, for the caller's per-completion checks."""
    logits = logits.detach().requires_grad_(True)
    loss, result = group_stage_loss(logits, labels, scores, backend=backend, **settings)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_logits = logits.detach().double().requires_grad_(True)
    ref_loss, aux = reference.tpo_loss(ref_logits, labels, scores, return_aux=True, **settings)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_logits)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol, atol=tol)
    return result, aux
