"""Custom ops of token-level TPO: the tempered logits of K candidate tokens per state.

``tpo_kernels::candidate_logits`` gathers ``c[r, k] = z[r, y[r, k]] / tau`` from ``[R, V]``
logits; its backward scatters ``dc / tau`` back into a dense ``[R, V]`` gradient (the only
vocabulary-sized work). ``tpo_kernels::linear_candidate_logits`` computes the same from hidden
states as K dot products per state, ``(h[r] . W[y] + b[y]) / tau``, so that nothing of size
``[R, V]`` exists; its backward gives ``dH``, ``dW`` (rows of the candidate ids) and ``db``,
with weight rows summed in a fixed order (:func:`tpo_kernels.group_math.pair_runs`).

Both run on the backends' kept-set ops: ``[R, K]`` candidates are kept sets of K pairs per row
(:meth:`KeptSets.from_candidates`, uniform offsets, ids a view), so each operation has one kernel
per backend. Two things are the dense contract's own, applied here on ``[R, K]`` values: the
temperature (``c = raw * inv_t``; the backward scatters ``dc * inv_t``, each product rounded before
the ascending sum of duplicates), and a negative id, which has no hole meaning here: its logit is
NaN (the kept-set ops' ``-inf`` replaced), and it is not written and adds nothing to ``dH``, as a hole.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backends.rows import compute_dtype
from ..backends import backend_by_key
from ..backends.kept_sets import KeptSets
from ..group_math import pair_runs
from ._tags import host_sync_tags


def _tempered(raw: Tensor, candidates: Tensor, inv_temperature: float) -> Tensor:
    """``[R, K]`` candidate logits from the kept-set ops' raw ``[R K]`` values: ``raw * inv_t``,
    NaN for a negative id (a hole's ``-inf`` otherwise); ids ``>= V`` are NaN already."""
    cand = raw.view(candidates.shape)
    if inv_temperature != 1.0:
        cand = cand.mul_(inv_temperature)
    return cand.masked_fill_(candidates < 0, float("nan"))


@torch.library.custom_op("tpo_kernels::candidate_logits", mutates_args=())
def _candidate_logits(logits: Tensor, candidates: Tensor, inv_temperature: float, backend: str) -> Tensor:
    raw = backend_by_key(backend).kept_gather(logits, KeptSets.from_candidates(candidates))
    return _tempered(raw, candidates, inv_temperature)


@_candidate_logits.register_fake
def _(logits, candidates, inv_temperature, backend):
    return logits.new_empty(candidates.shape, dtype=compute_dtype(logits.dtype))


@torch.library.custom_op("tpo_kernels::candidate_logits_backward", mutates_args=())
def _candidate_logits_backward(grad: Tensor, candidates: Tensor, vocab_size: int, dtype: torch.dtype,
                               inv_temperature: float, backend: str) -> Tensor:
    out = grad.new_empty(candidates.shape[0], vocab_size, dtype=dtype)
    grad = grad.reshape(-1) if inv_temperature == 1.0 else grad.reshape(-1) * inv_temperature
    backend_by_key(backend).kept_scatter(grad, KeptSets.from_candidates(candidates), out=out)
    return out


@_candidate_logits_backward.register_fake
def _(grad, candidates, vocab_size, dtype, inv_temperature, backend):
    return grad.new_empty(candidates.shape[0], vocab_size, dtype=dtype)


def _setup_gather(ctx, inputs, output):
    logits, candidates, inv_temperature, backend = inputs
    ctx.save_for_backward(candidates)
    ctx.vocab_size, ctx.dtype = logits.shape[1], logits.dtype  # the logits themselves are not kept
    ctx.inv_temperature, ctx.backend = inv_temperature, backend


def _backward_gather(ctx, grad):
    (candidates,) = ctx.saved_tensors
    grad_logits = _candidate_logits_backward(grad.contiguous(), candidates, ctx.vocab_size, ctx.dtype,
                                             ctx.inv_temperature, ctx.backend)
    return (grad_logits,) + (None,) * (len(ctx.needs_input_grad) - 1)


_candidate_logits.register_autograd(_backward_gather, setup_context=_setup_gather)


@torch.library.custom_op("tpo_kernels::linear_candidate_logits", mutates_args=())
def _linear_candidate_logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], candidates: Tensor,
                             inv_temperature: float, backend: str) -> Tensor:
    raw = backend_by_key(backend).kept_linear_forward(hidden, weight, KeptSets.from_candidates(candidates), bias=bias)
    return _tempered(raw, candidates, inv_temperature)


@_linear_candidate_logits.register_fake
def _(hidden, weight, bias, candidates, inv_temperature, backend):
    return hidden.new_empty(candidates.shape, dtype=compute_dtype(hidden.dtype))


# pair_runs sizes its runs by unique_consecutive (a read-back) for dW / db: no CUDA-graph capture.
@torch.library.custom_op("tpo_kernels::linear_candidate_logits_backward", mutates_args=(), **host_sync_tags())
def _linear_candidate_logits_backward(grad: Tensor, hidden: Tensor, weight: Tensor, candidates: Tensor,
                                      needs_hidden: bool, needs_weight: bool, needs_bias: bool,
                                      backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    runs = pair_runs(candidates) if needs_weight or needs_bias else None  # pairs numbered r K + k: the flat ids'
    grads = backend_by_key(backend).kept_linear_backward(
        grad.reshape(-1), hidden, weight, KeptSets.from_candidates(candidates), runs=runs, with_hidden=needs_hidden,
        with_weight=needs_weight, with_bias=needs_bias,
    )
    return tuple(hidden.new_empty(0) if g is None else g for g in grads)


@_linear_candidate_logits_backward.register_fake
def _(grad, hidden, weight, candidates, needs_hidden, needs_weight, needs_bias, backend):
    return (torch.empty_like(hidden) if needs_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if needs_weight else hidden.new_empty(0),
            weight.new_empty(weight.shape[0]) if needs_bias else hidden.new_empty(0))


def _setup_dot(ctx, inputs, output):
    hidden, weight, bias, candidates, inv_temperature, backend = inputs
    ctx.save_for_backward(hidden, weight, candidates)
    ctx.has_bias, ctx.inv_temperature, ctx.backend = bias is not None, inv_temperature, backend


def _backward_dot(ctx, grad):
    hidden, weight, candidates = ctx.saved_tensors
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
    # c = z / tau, so dLoss/dz = dLoss/dc / tau.
    grads = _linear_candidate_logits_backward((grad * ctx.inv_temperature).contiguous(), hidden, weight,
                                              candidates, *needs, ctx.backend)
    grads = [g if need else None for g, need in zip(grads, needs)]
    return (*grads,) + (None,) * (len(ctx.needs_input_grad) - 3)


_linear_candidate_logits.register_autograd(_backward_dot, setup_context=_setup_dot)


def candidate_logits(logits: Tensor, candidates: Tensor, *, inv_temperature: float, backend: str) -> Tensor:
    """``[R, K]`` tempered candidate logits (compute dtype), differentiable in ``logits``."""
    return _candidate_logits(logits, candidates, inv_temperature, backend)


def linear_candidate_logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], candidates: Tensor, *,
                            inv_temperature: float, backend: str) -> Tensor:
    """``[R, K]`` tempered candidate logits of ``hidden @ weight.T (+ bias)``, differentiable in
    hidden, weight and bias."""
    return _linear_candidate_logits(hidden, weight, bias, candidates, inv_temperature, backend)
