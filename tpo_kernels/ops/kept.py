"""Custom ops of sampling-mask replay: per-token log-probs over each token's kept set.

A sampler with top-k / top-p samples token ``y`` from the softmax renormalized over a kept set S;
replay trains on that distribution::

    lp = (z_y - m) / tau - log sum_{j in S} exp((z_j - m) / tau),     m = max_{j in S} z_j

and the entropy (on request) is that of the renormalized softmax. The backward is the row-op
backward on the gathered row, ``dz_j = (g (1[j = y] - p_j) - ge p_j (log p_j + H)) / tau`` on S and 0
elsewhere. Three ops compose it:

* ``tpo_kernels::kept_logits``: the raw logits of the kept pairs, gathered from ``[M, V]`` logits
  (backward: a scatter into a zeroed ``[M, V]`` gradient, the logits path's only vocabulary-sized
  work);
* ``tpo_kernels::linear_kept_logits``: the same from hidden states, ``h . W[id] + b[id]`` per pair,
  so that the fused head forms nothing of size ``[M, V]`` (P dot products forward, 2 P backward);
* ``tpo_kernels::ragged_logprobs``: the row ops over the ragged rows of the gathered logits,
  returning a :class:`RowSummary` (``has_label``: the label is in the set).

The logit transform applies to the gathered logits in plain autograd (``[P]`` values), and the
temperature inside the ragged op, after the max (tempering first would lose ~2e-3 at an offset of
3e4 in fp32).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..backends import backend_by_key
from ..backends.kept_sets import KeptSets
from ..backends.rows import FIELD_NAMES, OPTIONAL_FIELDS, RowRequest, RowSummary, compute_dtype, op_outputs
from ..group_math import pair_runs
from ._tags import host_sync_tags
from .vocab_shard import ShardSeam, shard_hidden, shard_ragged_summary


def _kept(tensors: List[Tensor], width: int) -> KeptSets:
    return KeptSets.from_op(tensors, width)


# ----------------------------------------------------------------------------- gather from logits


@torch.library.custom_op("tpo_kernels::kept_logits", mutates_args=())
def _kept_logits(logits: Tensor, kept: List[Tensor], width: int, backend: str) -> Tensor:
    return backend_by_key(backend).kept_gather(logits, _kept(kept, width))


@_kept_logits.register_fake
def _(logits, kept, width, backend):
    return logits.new_empty(kept[0].shape, dtype=compute_dtype(logits.dtype))


@torch.library.custom_op("tpo_kernels::kept_logits_backward", mutates_args=())
def _kept_logits_backward(grad: Tensor, kept: List[Tensor], width: int, shape: List[int], dtype: torch.dtype,
                          backend: str) -> Tensor:
    out = grad.new_empty(shape, dtype=dtype)
    backend_by_key(backend).kept_scatter(grad, _kept(kept, width), out=out)
    return out


@_kept_logits_backward.register_fake
def _(grad, kept, width, shape, dtype, backend):
    return grad.new_empty(shape, dtype=dtype)


def _setup_gather(ctx, inputs, output):
    logits, kept, width, backend = inputs
    ctx.save_for_backward(*kept)
    ctx.shape, ctx.dtype = list(logits.shape), logits.dtype  # the logits themselves are not kept
    ctx.width, ctx.backend = width, backend


def _backward_gather(ctx, grad):
    grad_logits = _kept_logits_backward(grad.contiguous(), list(ctx.saved_tensors), ctx.width, ctx.shape,
                                        ctx.dtype, ctx.backend)
    return grad_logits, [None] * len(ctx.saved_tensors), None, None


_kept_logits.register_autograd(_backward_gather, setup_context=_setup_gather)


# ----------------------------------------------------------------------------- dot products from hidden states


@torch.library.custom_op("tpo_kernels::linear_kept_logits", mutates_args=())
def _linear_kept_logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], kept: List[Tensor], width: int,
                        backend: str) -> Tensor:
    return backend_by_key(backend).kept_linear_forward(hidden, weight, _kept(kept, width), bias=bias)


@_linear_kept_logits.register_fake
def _(hidden, weight, bias, kept, width, backend):
    return hidden.new_empty(kept[0].shape, dtype=compute_dtype(hidden.dtype))


# pair_runs sizes its runs by unique_consecutive (a read-back) for dW / db: no CUDA-graph capture.
@torch.library.custom_op("tpo_kernels::linear_kept_logits_backward", mutates_args=(), **host_sync_tags())
def _linear_kept_logits_backward(grad: Tensor, hidden: Tensor, weight: Tensor, kept: List[Tensor], width: int,
                                 needs_hidden: bool, needs_weight: bool, needs_bias: bool,
                                 backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    sets = _kept(kept, width)
    runs = pair_runs(sets.ids) if needs_weight or needs_bias else None
    grads = backend_by_key(backend).kept_linear_backward(
        grad, hidden, weight, sets, runs=runs, with_hidden=needs_hidden, with_weight=needs_weight,
        with_bias=needs_bias,
    )
    return tuple(hidden.new_empty(0) if g is None else g for g in grads)


@_linear_kept_logits_backward.register_fake
def _(grad, hidden, weight, kept, width, needs_hidden, needs_weight, needs_bias, backend):
    return (torch.empty_like(hidden) if needs_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if needs_weight else hidden.new_empty(0),
            weight.new_empty(weight.shape[0]) if needs_bias else hidden.new_empty(0))


def _setup_dot(ctx, inputs, output):
    hidden, weight, bias, kept, width, backend = inputs
    ctx.save_for_backward(hidden, weight, *kept)
    ctx.has_bias, ctx.width, ctx.backend = bias is not None, width, backend


def _backward_dot(ctx, grad):
    hidden, weight, *kept = ctx.saved_tensors
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
    grads = _linear_kept_logits_backward(grad.contiguous(), hidden, weight, kept, ctx.width, *needs, ctx.backend)
    grads = [g if need else None for g, need in zip(grads, needs)]
    return (*grads, [None] * len(kept), None, None)


_linear_kept_logits.register_autograd(_backward_dot, setup_context=_setup_dot)


# ----------------------------------------------------------------------------- ragged row ops


@torch.library.custom_op("tpo_kernels::ragged_logprobs", mutates_args=())
def _ragged_logprobs(kept_logits: Tensor, kept: List[Tensor], width: int, inv_temperature: float,
                     with_entropy: bool, backend: str) -> op_outputs():
    summary = backend_by_key(backend).ragged_row_forward(kept_logits, _kept(kept, width),
                                                         inv_temperature=inv_temperature, with_entropy=with_entropy)
    return summary.to_op()


@_ragged_logprobs.register_fake
def _(kept_logits, kept, width, inv_temperature, with_entropy, backend):
    rows = kept[3].shape[0]
    present = [name for name in FIELD_NAMES if name not in OPTIONAL_FIELDS or (with_entropy and name == "entropy")]
    return tuple(kept_logits.new_empty(rows if name in present else 0,
                                       dtype=torch.bool if name == "has_label" else kept_logits.dtype)
                 for name in FIELD_NAMES)


@torch.library.custom_op("tpo_kernels::ragged_logprobs_backward", mutates_args=())
def _ragged_logprobs_backward(kept_logits: Tensor, kept: List[Tensor], width: int, summary: List[Tensor],
                              grad_logprob: Tensor, grad_entropy: Optional[Tensor], inv_temperature: float,
                              backend: str) -> Tensor:
    fields = ("entropy",) if grad_entropy is not None else ()
    out = torch.empty_like(kept_logits)
    backend_by_key(backend).ragged_row_backward(
        kept_logits, _kept(kept, width), RowSummary.from_op(summary, fields=fields), grad_logprob,
        grad_entropy=grad_entropy, inv_temperature=inv_temperature, out=out,
    )
    return out


@_ragged_logprobs_backward.register_fake
def _(kept_logits, kept, width, summary, grad_logprob, grad_entropy, inv_temperature, backend):
    return torch.empty_like(kept_logits)


def _setup_ragged(ctx, inputs, output):
    kept_logits, kept, width, inv_temperature, with_entropy, backend = inputs
    ctx.save_for_backward(kept_logits, *kept, *output)
    ctx.width, ctx.inv_temperature, ctx.with_entropy, ctx.backend = width, inv_temperature, with_entropy, backend


def _backward_ragged(ctx, *grads):
    kept_logits, *rest = ctx.saved_tensors
    kept, summary = rest[:4], rest[4:]
    by_name = dict(zip(FIELD_NAMES, grads))
    g = by_name["label_logprob"]
    g = torch.zeros_like(summary[0]) if g is None else g.contiguous()
    ge = by_name["entropy"] if ctx.with_entropy else None
    ge = None if ge is None else ge.contiguous()
    grad = _ragged_logprobs_backward(kept_logits, list(kept), ctx.width, list(summary), g, ge,
                                     ctx.inv_temperature, ctx.backend)
    return grad, [None] * len(kept), None, None, None, None


_ragged_logprobs.register_autograd(_backward_ragged, setup_context=_setup_ragged)


# ----------------------------------------------------------------------------- entry points


def _ragged_summary(raw: Tensor, kept: KeptSets, request: RowRequest, backend: str,
                    seam: Optional[ShardSeam]) -> RowSummary:
    inv_temperature, transform = request.transform()
    # A hole (negative id) gathers -inf; the cap would map it to -cap, a finite logit in the set.
    z = raw if transform is None else torch.where(kept.ids >= 0, transform.differentiable(raw), raw)
    with_entropy = request.wants("entropy")
    if seam is not None:  # this shard's part of each set, merged over the shards
        return shard_ragged_summary(z, kept, seam, inv_temperature=inv_temperature, with_entropy=with_entropy,
                                    backend=backend)
    tensors, width = kept.to_op()
    out = _ragged_logprobs(z, tensors, width, float(inv_temperature), with_entropy, backend)
    return RowSummary.from_op(out, fields=("entropy",) if with_entropy else ())


def kept_row_summary(logits: Tensor, kept: KeptSets, request: RowRequest, backend: str,
                     seam: Optional[ShardSeam] = None) -> RowSummary:
    """The :class:`RowSummary` of every row over its kept set, from ``[M, V]`` logits (or a
    ``[B, T, V]`` view), differentiable in ``logits``. ``backend``: a key of the registry. With a
    ``seam``, ``logits`` is this rank's ``[M, V_r]`` vocabulary shard and ``kept`` holds global ids
    (the same on every rank): the summary is over the whole sets (:mod:`.vocab_shard`; ``request``
    without a soft cap, as a shard's row ops take it)."""
    if seam is not None:
        kept = kept.shard(seam.start, seam.size)
    tensors, width = kept.to_op()
    return _ragged_summary(_kept_logits(logits, tensors, width, backend), kept, request, backend, seam)


def linear_kept_row_summary(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], kept: KeptSets,
                            request: RowRequest, backend: str, seam: Optional[ShardSeam] = None) -> RowSummary:
    """The same from ``hidden [M, H]`` and the head ``weight [V, H]`` (``bias [V]``), without forming
    ``[M, V]``; differentiable in hidden, weight and bias. With a ``seam``, ``weight`` / ``bias`` are
    this rank's shard (as in :func:`kept_row_summary`) and ``dH`` is summed over the shards."""
    if seam is not None:
        kept, hidden = kept.shard(seam.start, seam.size), shard_hidden(hidden, seam)
    tensors, width = kept.to_op()
    raw = _linear_kept_logits(hidden, weight, bias, tensors, width, backend)
    return _ragged_summary(raw, kept, request, backend, seam)


__all__ = ["kept_row_summary", "linear_kept_row_summary"]
