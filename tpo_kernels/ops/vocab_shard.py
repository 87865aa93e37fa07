"""The row ops on one shard of the vocabulary (a vocabulary-parallel lm_head or logits).

Each rank runs the ordinary row op on its shard and gets a :class:`RowSummary` over its part of
the vocabulary; the ``seam`` (a :class:`ShardSeam`: :class:`tpo_kernels.distributed.VocabShard`,
or anything with its members) merges the ranks' summaries into the whole vocabulary's, the same
bits on every rank. The backward is local to the shard: the logits gradient, or ``dW`` / ``db``
of the shard, plus the seam's sum of ``dH`` over the ranks for the fused head. These are plain
autograd Functions: the seam's collectives run eagerly, never under ``torch.compile``.

A counted row whose label lies on another shard is read with label 0 standing in (its log-prob
unused) and gets no one-hot term in the backward.

Replay over kept sets (:func:`shard_ragged_summary`, reached from :mod:`.kept`): each rank runs the
ragged row op over its part of every set (:meth:`KeptSets.shard`: the ids on its range, shifted;
a row with none has ``row_max = -inf`` and adds nothing to the merge), the seam merges the ranks'
summaries into the whole sets', and the ragged backward runs on the rank's own ids with the merged
summary; the fused head's ``dH`` is summed over the ranks (:func:`shard_hidden`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Tuple

import torch
from torch import Tensor

from ..backends import backend_by_key
from ..backends.kept_sets import NOT_COUNTED, KeptSets
from ..backends.rows import RowRequest, RowSummary, row_gradients
from .linear_head import TiledLinearHead
from .tiles import HeadTiles


class ShardSeam(Protocol):
    """This rank's slice ``[start, start + size)`` of the vocabulary, and the collectives that
    join the slices."""

    start: int
    size: int

    def merge(self, summary: RowSummary, inv_temperature: float) -> RowSummary: ...

    def sum_hidden_grad(self, grad_hidden: Tensor) -> Tensor: ...


def _owned(labels: Tensor, seam: ShardSeam) -> Tuple[Tensor, Tensor]:
    """``(owned, local)``: whether this shard holds each label, and its id in the shard."""
    local = labels - seam.start
    return (labels >= 0) & (local >= 0) & (local < seam.size), local


def _whole(shard: RowSummary, owned: Tensor, counted: Tensor, seam: ShardSeam, inv_temperature: float) -> RowSummary:
    """The whole vocabulary's summary from this shard's (whose ``has_label`` becomes ``owned``:
    the shard read a stand-in label for the rows whose label another shard holds), 0 on
    uncounted rows."""
    merged = seam.merge(dataclasses.replace(shard, has_label=owned), inv_temperature)
    return merged.masked_fill(~counted, 0.0)  # has_label is False there already (not owned)


class _ShardLogprobs(torch.autograd.Function):
    """The :class:`RowSummary` (its ``to_op`` tensors) of this rank's ``[M, V_r]`` logits shard."""

    @staticmethod
    def forward(ctx, logits, labels, seam, request, inplace_backward, key):
        counted = labels >= 0
        owned, local = _owned(labels, seam)
        read_labels = torch.where(counted, torch.where(owned, local, 0), -1)  # every counted row is read
        shard = backend_by_key(key).row_forward(logits, read_labels, inv_temperature=request.inv_temperature,
                                                **request.row_flags())
        summary = _whole(shard, owned, counted, seam, request.inv_temperature)
        ctx.save_for_backward(logits, torch.where(owned, local, -1), counted, *summary.to_op())
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        ctx.request, ctx.inplace_backward, ctx.backend = request, inplace_backward, key
        return summary.to_op()

    @staticmethod
    def backward(ctx, *output_grads):
        logits, grad_labels, counted, *saved = ctx.saved_tensors
        fields = ctx.request.token_fields
        summary = RowSummary.from_op(saved, fields=fields)
        summary_grads = RowSummary.from_op(output_grads, fields=fields)  # None where none arrived
        grad_logprobs, grad_entropy = row_gradients(counted, summary, summary_grads.label_logprob,
                                                    summary_grads.entropy)
        args = (grad_labels, saved, grad_logprobs, grad_entropy, ctx.request.to_op(), ctx.backend)
        if ctx.inplace_backward:
            torch.ops.tpo_kernels.logprobs_backward_(logits, *args)
            grad = logits
        else:
            grad = torch.ops.tpo_kernels.logprobs_backward(logits, *args)
        return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


def shard_logprobs(logits: Tensor, labels: Tensor, seam: ShardSeam, *, request: RowRequest, inplace_backward: bool,
                   backend: str) -> RowSummary:
    """:func:`tpo_kernels.ops.token_logprobs` over the whole vocabulary from this rank's
    ``[M, V_r]`` logits shard (``request``: without a soft cap, its scale folded, see
    :meth:`RowRequest.folded`); the logits gradient is local to the shard."""
    outputs = _ShardLogprobs.apply(logits, labels, seam, request, inplace_backward, backend)
    return RowSummary.from_op(outputs, fields=request.token_fields)


class _ShardLinearLogprobs(torch.autograd.Function):
    """The :class:`RowSummary` (its ``to_op`` tensors) of ``hidden @ weight_shard.T (+ bias_shard)``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, seam, request, tiles, key):
        head = TiledLinearHead(hidden, weight, bias, labels, backend_by_key(key), request.inv_temperature,
                               tiles, vocab_offset=seam.start)
        owned, _ = _owned(labels, seam)
        summary = _whole(head.forward(request.token_fields), owned, labels >= 0, seam, request.inv_temperature)
        ctx.save_for_backward(hidden, weight, bias, labels, *summary.to_op())
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        ctx.seam, ctx.request, ctx.tiles, ctx.backend = seam, request, tiles, key
        return summary.to_op()

    @staticmethod
    def backward(ctx, *output_grads):
        hidden, weight, bias, labels, *saved = ctx.saved_tensors
        request, tiles, seam = ctx.request, ctx.tiles, ctx.seam
        summary = RowSummary.from_op(saved, fields=request.token_fields)
        summary_grads = RowSummary.from_op(output_grads, fields=request.token_fields)
        grad_logprobs, grad_entropy = row_gradients(labels >= 0, summary, summary_grads.label_logprob,
                                                    summary_grads.entropy)
        head = TiledLinearHead(hidden, weight, bias, labels, backend_by_key(ctx.backend), request.inv_temperature,
                               tiles, vocab_offset=seam.start)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        grad_hidden, grad_weight, grad_bias = head.backward(summary, grad_logprobs, grad_entropy, needs,
                                                            tiles.grad_accum_dtype)
        if grad_hidden is not None:  # every shard's contribution to dH
            grad_hidden = seam.sum_hidden_grad(grad_hidden)
        return (grad_hidden, grad_weight, grad_bias) + (None,) * (len(ctx.needs_input_grad) - 3)


def shard_linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, seam: ShardSeam, *,
                          request: RowRequest, tiles: HeadTiles, backend: str) -> RowSummary:
    """:func:`tpo_kernels.ops.linear_logprobs` over the whole vocabulary from this rank's shard
    of the head (weight ``[V_r, H]``, bias ``[V_r]``; ``request`` as in :func:`shard_logprobs`)."""
    outputs = _ShardLinearLogprobs.apply(hidden, weight, bias, labels, seam, request, tiles, backend)
    return RowSummary.from_op(outputs, fields=request.token_fields)


# ----------------------------------------------------------------------------- kept sets (replay)


class _ShardRagged(torch.autograd.Function):
    """The whole kept sets' :class:`RowSummary` (its ``to_op`` tensors) from this rank's part of
    them: ``kept_logits [P]`` gathered on this shard (holes off it), ``kept`` with local ids."""

    @staticmethod
    def forward(ctx, kept_logits, kept, seam, inv_temperature, with_entropy, key):
        tensors, width = kept.to_op()
        fields = ("entropy",) if with_entropy else ()
        local = torch.ops.tpo_kernels.ragged_logprobs(kept_logits, tensors, width, inv_temperature, with_entropy, key)
        counted = kept.label_slot != NOT_COUNTED  # the same rows on every shard (KeptSets.shard keeps them)
        # has_label: the label is in this shard's part (the merge takes the label from that rank).
        summary = seam.merge(RowSummary.from_op(local, fields=fields), inv_temperature).masked_fill(~counted, 0.0)
        # A counted label in no shard's part (outside its set; validate=False): NaN, as on one rank
        # (the merge would give the first shard's value, -inf where that shard holds none of the set).
        outside = counted & ~summary.has_label
        summary = dataclasses.replace(summary, label_logprob=summary.label_logprob.masked_fill(outside, float("nan")))
        ctx.save_for_backward(kept_logits, *tensors, counted, *summary.to_op())
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        ctx.width, ctx.fields, ctx.inv_temperature, ctx.backend = width, fields, inv_temperature, key
        return summary.to_op()

    @staticmethod
    def backward(ctx, *output_grads):
        kept_logits, *rest = ctx.saved_tensors
        tensors, counted, saved = rest[:4], rest[4], rest[5:]
        summary = RowSummary.from_op(saved, fields=ctx.fields)
        summary_grads = RowSummary.from_op(output_grads, fields=ctx.fields)
        grad_logprobs, grad_entropy = row_gradients(counted, summary, summary_grads.label_logprob,
                                                    summary_grads.entropy)
        # The row backward of this shard's ids with the merged statistics (p over the whole set).
        grad = torch.ops.tpo_kernels.ragged_logprobs_backward(kept_logits, list(tensors), ctx.width, list(saved),
                                                             grad_logprobs, grad_entropy, ctx.inv_temperature,
                                                             ctx.backend)
        return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


def shard_ragged_summary(kept_logits: Tensor, kept: KeptSets, seam: ShardSeam, *, inv_temperature: float,
                         with_entropy: bool, backend: str) -> RowSummary:
    """The ragged row op over the whole kept sets from this rank's part ``kept`` (local ids, see
    :meth:`KeptSets.shard`) and its raw ``kept_logits``, merged through the ``seam``;
    differentiable in ``kept_logits`` (the backward local to the shard)."""
    outputs = _ShardRagged.apply(kept_logits, kept, seam, float(inv_temperature), with_entropy, backend)
    return RowSummary.from_op(outputs, fields=("entropy",) if with_entropy else ())


class _SummedHiddenGrad(torch.autograd.Function):
    """The identity forward; the backward sums ``dH`` over the shards (a column-parallel input)."""

    @staticmethod
    def forward(ctx, hidden, seam):
        ctx.seam = seam
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad_hidden):
        return ctx.seam.sum_hidden_grad(grad_hidden.contiguous()), None


def shard_hidden(hidden: Tensor, seam: ShardSeam) -> Tensor:
    """``hidden`` as this rank's head shard reads it: its gradient, this shard's part of ``dH``,
    becomes the sum over every shard's."""
    return _SummedHiddenGrad.apply(hidden, seam)
