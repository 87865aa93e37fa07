"""``tpo_kernels::logprobs``: per-token log-probs (and entropies) of a ``[M, V]`` logits matrix
(unit column stride, any row stride >= V) or of ``[B, T, V]`` logits whose rows do not flatten into
one row stride (the ``logits[:, :-1]`` slice: the row ops take it as it is, with a batch stride,
so it is one launch forward and one backward, no copy), as a custom op whose backward is the
backend's fused row backward.

Forward (row op of the backend): ``lp[r] = log softmax(z[r] / tau)[y_r]`` and, on request, the
entropy ``H[r]`` of ``softmax(z[r] / tau)``; 0 on rows whose label is negative (those rows are
never read). The op returns the row op's whole :class:`~tpo_kernels.backends.rows.RowSummary`
(flattened by its ``to_op``; see the row-op contract in :mod:`tpo_kernels.backends`), and the
autograd rule keeps it for the backward. Backward,
with ``p = softmax(z / tau)``::

    dz[r, v] = (g[r] * (onehot(y_r)[v] - p[v]) - ge[r] * p[v] * (log p[v] + H[r])) / tau

for the incoming gradients ``g`` (of lp) and ``ge`` (of H). With ``inplace_backward`` the
gradient is written over the logits buffer, which saves a ``[M, V]`` tensor; the op marks the
buffer as modified, so a second consumer of the same logits fails loudly.

``logit_scale`` and ``logit_softcap`` transform the logits first (:class:`~tpo_kernels.backends.rows.LogitTransform`):
a scale alone folds into ``inv_temperature``; a soft cap runs the row ops on capped row chunks.
The fused head (:mod:`tpo_kernels.ops.linear`) takes the same transform from here.
"""

from __future__ import annotations

import math
from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..backends.rows import LogitTransform, RowRequest, RowSummary, compute_dtype, op_outputs, row_flags, row_gradients
from ..backends import backend_by_key
from .tiles import TilePolicy


def row_chunk(num_rows: int, vocab_size: int, device: torch.device) -> int:
    """Rows per chunk of the capped logits path: the device's fused-linear tile budget."""
    return TilePolicy.for_device(device).chunk_size(num_rows, vocab_size)


@torch.library.custom_op("tpo_kernels::logprobs", mutates_args=())
def _logprobs(logits: Tensor, labels: Tensor, request: List[float], inplace_backward: bool,
              backend: str) -> op_outputs():
    row_op, row = backend_by_key(backend).row_forward, RowRequest.from_op(request)
    inv_t, transform = row.transform()
    if transform is None:  # one launch over the whole matrix or batch
        return row_op(logits, labels, inv_temperature=inv_t, **row.row_flags()).to_op()
    return _forward_pieces(row_op, transform, logits, labels, inv_t, row.token_fields).to_op()


def _pieces(logits: Tensor) -> Iterator[Tuple[Tensor, slice]]:
    """``(2-D view, its rows in the flat [M] order)`` pairs covering ``[M, V]`` logits, or ``[B, T, V]``
    logits whose rows do not flatten into one row stride (``logits[:, :-1]``): one view per leading
    index, read with its row stride instead of copied, in views of at most one row chunk
    (:func:`row_chunk`), the size of the soft cap's buffer. Only the soft-capped path walks pieces
    (without a cap the row ops take the whole batch in one launch)."""
    vocab = logits.shape[-1]
    blocks = [logits] if logits.dim() == 2 else list(logits.unbind(0))
    step = row_chunk(logits.shape[:-1].numel(), vocab, logits.device)
    offset = 0
    for block in blocks:
        rows = block.shape[0]
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            yield block[start:stop], slice(offset + start, offset + stop)
        offset += rows


def _capped_buffer(logits: Tensor) -> Tensor:
    """A flat compute-dtype buffer for one row chunk of capped logits."""
    rows, vocab = logits.shape[:-1].numel(), logits.shape[-1]
    piece_rows = min(row_chunk(rows, vocab, logits.device), logits.shape[-2])
    return logits.new_empty(max(piece_rows, 1) * vocab, dtype=compute_dtype(logits.dtype))


def _forward_pieces(row_op, transform: LogitTransform, logits: Tensor, labels: Tensor, inv_t: float,
                    fields: Tuple[str, ...]) -> RowSummary:
    """The row op piece by piece (:func:`_pieces`), each soft-capped into one chunk-sized buffer
    first."""
    summary = RowSummary.zeros(logits.shape[:-1].numel(), dtype=compute_dtype(logits.dtype), device=logits.device,
                               fields=fields)
    buffer = _capped_buffer(logits)
    for z, rows in _pieces(logits):
        capped = transform.cap(z, buffer)
        summary.assign(rows, row_op(capped, labels[rows], inv_temperature=inv_t, **row_flags(fields)))
    return summary


@_logprobs.register_fake
def _(logits, labels, request, inplace_backward, backend):
    # math.prod, not Size.numel(): numel() of symbolic sizes pins them under dynamic shapes.
    return RowSummary.zeros(math.prod(logits.shape[:-1]), dtype=compute_dtype(logits.dtype), device=logits.device,
                            fields=RowRequest.from_op(request).token_fields).to_op()


def _row_backward(logits: Tensor, labels: Tensor, summary: List[Tensor], grad_logprobs: Tensor,
                  grad_entropy: Optional[Tensor], request: List[float], backend: str, out: Tensor) -> None:
    """The backend's row backward into ``out`` (``logits``' shape; may be ``logits``): one launch
    over the matrix or batch, or piece by piece (:func:`_pieces`) with a soft cap.

    With a soft cap, per row chunk: recompute the capped chunk, run the row backward on it in
    place, multiply by the cap's derivative and write the result into ``out``'s rows (the chunk
    of ``logits`` is read before its rows of ``out`` are written). ``summary``: the forward's
    :class:`RowSummary` as its ``to_op`` tensors (the entropy is read only with ``grad_entropy``)."""
    summary = RowSummary.from_op(summary, fields=() if grad_entropy is None else ("entropy",))
    row_op = backend_by_key(backend).row_backward
    inv_t, transform = RowRequest.from_op(request).transform()
    if transform is None:
        row_op(logits, labels, summary, grad_logprobs, grad_entropy=grad_entropy, inv_temperature=inv_t, out=out)
        return
    capped_buffer, derivative_buffer = _capped_buffer(logits), _capped_buffer(logits)
    for (z, rows), (out_piece, _) in zip(_pieces(logits), _pieces(out)):
        derivative = transform.derivative(z, derivative_buffer, scratch=capped_buffer)
        capped = transform.cap(z, capped_buffer)  # the row backward runs in place on the capped chunk
        row_op(capped, labels[rows], summary.select(rows), grad_logprobs[rows],
               grad_entropy=None if grad_entropy is None else grad_entropy[rows], inv_temperature=inv_t, out=capped)
        out_piece.copy_(capped.mul_(derivative))


@torch.library.custom_op("tpo_kernels::logprobs_backward", mutates_args=())
def _logprobs_backward(logits: Tensor, labels: Tensor, summary: List[Tensor], grad_logprobs: Tensor,
                       grad_entropy: Optional[Tensor], request: List[float], backend: str) -> Tensor:
    out = torch.empty_like(logits)
    _row_backward(logits, labels, summary, grad_logprobs, grad_entropy, request, backend, out)
    return out


@_logprobs_backward.register_fake
def _(logits, *args):
    return torch.empty_like(logits)


@torch.library.custom_op("tpo_kernels::logprobs_backward_", mutates_args=("logits",))
def _logprobs_backward_inplace(logits: Tensor, labels: Tensor, summary: List[Tensor], grad_logprobs: Tensor,
                               grad_entropy: Optional[Tensor], request: List[float], backend: str) -> None:
    _row_backward(logits, labels, summary, grad_logprobs, grad_entropy, request, backend, logits)


@_logprobs_backward_inplace.register_fake
def _(logits, *args):
    return None


def _setup_context(ctx, inputs, output):
    logits, labels, request, inplace_backward, backend = inputs
    ctx.save_for_backward(logits, labels, *output)  # the RowSummary's to_op tensors
    ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
    ctx.request, ctx.fields = request, RowRequest.from_op(request).token_fields
    ctx.inplace_backward, ctx.backend = inplace_backward, backend


def _backward(ctx, *output_grads):
    logits, labels, *saved = ctx.saved_tensors  # saved: the summary's to_op tensors, as the backward op takes them
    summary = RowSummary.from_op(saved, fields=ctx.fields)
    summary_grads = RowSummary.from_op(output_grads, fields=ctx.fields)  # None where none arrived
    grad_logprobs, grad_entropy = row_gradients(labels >= 0, summary, summary_grads.label_logprob,
                                                summary_grads.entropy)
    args = (labels, saved, grad_logprobs, grad_entropy, ctx.request, ctx.backend)
    settings = (None,) * (len(ctx.needs_input_grad) - 1)  # labels and the settings: no gradient
    if ctx.inplace_backward:
        _logprobs_backward_inplace(logits, *args)
        return (logits, *settings)
    return (_logprobs_backward(logits, *args), *settings)


_logprobs.register_autograd(_backward, setup_context=_setup_context)


def token_logprobs(logits: Tensor, labels: Tensor, *, request: RowRequest, inplace_backward: bool,
                   backend: str) -> RowSummary:
    """The :class:`RowSummary` of ``[M, V]`` or ``[B, T, V]`` logits (module docstring) through the
    request's logit transform (:class:`LogitTransform`) for int64 ``labels`` (negative: skipped),
    in the compute dtype, with the per-token fields the request asks for; differentiable in
    ``logits`` through its log-probs and entropies."""
    return RowSummary.from_op(_logprobs(logits, labels, request.to_op(), inplace_backward, backend),
                              fields=request.token_fields)
