"""``tpo_kernels::logprobs``: per-token log-probs (and entropies) of a ``[M, V]`` logits matrix
(unit column stride, any row stride >= V) or of ``[B, T, V]`` logits whose rows do not flatten into
one row stride (the ``logits[:, :-1]`` slice: the row ops take it as it is, with a batch stride,
so it is one launch forward and one backward, no copy), as a custom op whose backward is the
backend's fused row backward.

Forward (row op of the backend): ``lp[r] = log softmax(z[r] / tau)[y_r]`` and, on request, the
entropy ``H[r]`` of ``softmax(z[r] / tau)``; 0 on rows whose label is negative (those rows are
never read). The op returns the row op's whole :class:`~tpo_kernels.backends.row_summary.RowSummary`
(flattened by its ``to_op``; see the row-op contract in :mod:`tpo_kernels.backends`), and the
autograd rule keeps it for the backward. Backward,
with ``p = softmax(z / tau)``::

    dz[r, v] = (g[r] * (onehot(y_r)[v] - p[v]) - ge[r] * p[v] * (log p[v] + H[r])) / tau

for the incoming gradients ``g`` (of lp) and ``ge`` (of H). With ``inplace_backward`` the
gradient is written over the logits buffer, which saves a ``[M, V]`` tensor; the op marks the
buffer as modified, so a second consumer of the same logits fails loudly.

``logit_scale`` and ``logit_softcap`` transform the logits first (:class:`LogitTransform`, below):
a scale alone folds into ``inv_temperature``; a soft cap runs the row ops on capped row chunks.
The fused head (:mod:`tpo_kernels.ops.linear`) takes the same transform from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..backends.row_summary import OPTIONAL_FIELDS, RowSummary, compute_dtype, op_outputs, row_flags
from ..backends import backend_by_key
from .tiles import TilePolicy


# ----------------------------------------------------------------------------- logit transform

# Logit scaling and soft-capping, applied by the orchestration layer around unchanged row ops.
#
# Models transform their lm_head output before the softmax: Cohere multiplies it by
# ``logit_scale``, Granite divides it by ``logits_scaling`` (``logit_scale = 1 / logits_scaling``),
# Gemma 2/3 soft-cap it, ``c * tanh(z / c)`` (``final_logit_softcapping``). The log-probs are those of
#
#     z' = softcap(scale * z) / temperature,        softcap(x) = c * tanh(x / c)
#
# Without a cap the scale folds exactly into the row ops' ``inv_temperature`` (no extra pass). With
# one, each chunk (logits path) or tile (fused-linear path) of raw logits is capped into a buffer in
# the compute dtype, the row op runs on it, and the backward recomputes the chunk, runs the row
# backward on it and applies the chain rule ``dz = dz' * scale * sech^2(scale * z / c)``. sech^2 is
# ``4 t / (1 + t)^2`` with ``t = exp(-2 |x|)`` in (0, 1]: a few ulp where ``1 - tanh^2`` would
# cancel, never overflowing, and 0 at +-inf logits.
#
# Chunk boundaries move with the logits' layout (a strided ``[B, T, V]`` view is walked one leading
# index at a time, its contiguous copy in chunks of the flat ``[M, V]`` rows), so the transform uses
# only ops whose every element gets the same bits wherever it sits in a chunk: IEEE arithmetic and
# the functions PyTorch's CPU kernels evaluate with one vector routine up to the last element
# (``tanh``, ``exp``). ``cosh`` is not one of them: its CPU kernel computes a chunk's tail with the
# scalar libm ``cosh``, one ulp off the vector one, which made the capped gradient of a view differ
# from its copy's.


@dataclass(frozen=True)
class LogitTransform:
    """``z -> softcap * tanh(scale * z / softcap)``, on chunks of raw logits."""

    scale: float
    softcap: float

    def cap(self, z: Tensor, buffer: Tensor) -> Tensor:
        """``softcap(scale * z)`` in a view of the flat ``buffer`` (its dtype: the compute dtype)."""
        out = _view_like(buffer, z).copy_(z)
        return out.mul_(self.scale / self.softcap).tanh_().mul_(self.softcap)

    def derivative(self, z: Tensor, buffer: Tensor, scratch: Tensor) -> Tensor:
        """``d softcap(scale * z) / dz = scale * sech^2(x)``, ``x = scale * z / softcap``, in a view of
        ``buffer`` (``scratch``: a buffer of the same size, overwritten). ``sech^2(x) = 4 t / (1 + t)^2``
        with ``t = exp(-2 |x|)``."""
        t = _view_like(buffer, z).copy_(z).mul_(self.scale / self.softcap).abs_().mul_(-2.0).exp_()
        denominator = _view_like(scratch, z).copy_(t).add_(1.0).square_()
        return t.mul_(4.0).div_(denominator).mul_(self.scale)

    def differentiable(self, z: Tensor) -> Tensor:
        """The transform in plain autograd, for the few gathered logits of token-level TPO."""
        return torch.tanh(z * (self.scale / self.softcap)) * self.softcap


def _view_like(buffer: Tensor, like: Tensor) -> Tensor:
    return buffer[: like.numel()].view(like.shape)


def row_transform(inv_temperature: float, logit_scale: float,
                  logit_softcap: Optional[float]) -> Tuple[float, Optional[LogitTransform]]:
    """``(factor, transform)``: the factor the row ops multiply the (capped) logits by, and the
    transform they cannot fold into it. Without a cap the scale folds in: ``(scale / temperature,
    None)``; with one the cap applies the scale: ``(1 / temperature, the transform)``."""
    if logit_softcap is None:
        return inv_temperature * logit_scale, None
    return inv_temperature, LogitTransform(logit_scale, logit_softcap)


@dataclass(frozen=True)
class RowRequest:
    """What a row op computes: the logit transform and temperature, and the optional per-token
    fields of its :class:`RowSummary` asked for (``token_fields``, a sorted tuple of names from
    :data:`OPTIONAL_FIELDS`, e.g. ``("entropy",)``). Built once by the plan and carried whole to
    the ``torch.library`` boundary, where :meth:`to_op` flattens it into the ops' ``float[]``
    argument; a new field travels without another edit on the way."""

    inv_temperature: float = 1.0
    logit_scale: float = 1.0
    logit_softcap: Optional[float] = None  # None: no cap
    token_fields: Tuple[str, ...] = ()

    def wants(self, name: str) -> bool:
        return name in self.token_fields

    def row_flags(self) -> dict:
        """The keywords of a backend's ``row_forward`` asking for the requested fields."""
        return row_flags(self.token_fields)

    def transform(self) -> Tuple[float, Optional["LogitTransform"]]:
        """:func:`row_transform` of this request."""
        return row_transform(self.inv_temperature, self.logit_scale, self.logit_softcap)

    def folded(self) -> "RowRequest":
        """The same request with the scale folded into ``inv_temperature`` (no cap): what a
        vocabulary shard's row ops take."""
        factor, _ = row_transform(self.inv_temperature, self.logit_scale, None)
        return RowRequest(inv_temperature=factor, token_fields=self.token_fields)

    def to_op(self) -> List[float]:
        """``[inv_temperature, logit_scale, logit_softcap (0: none), one 0/1 per optional field]``."""
        flags = [float(name in self.token_fields) for name in OPTIONAL_FIELDS]
        return [float(self.inv_temperature), float(self.logit_scale), float(self.logit_softcap or 0.0), *flags]

    @staticmethod
    def from_op(values: List[float]) -> "RowRequest":
        inv_temperature, scale, softcap, *flags = values
        return RowRequest(inv_temperature=inv_temperature, logit_scale=scale, logit_softcap=softcap or None,
                          token_fields=tuple(name for name, flag in zip(OPTIONAL_FIELDS, flags) if flag))


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


def row_gradients(counted: Tensor, summary: RowSummary, grad_logprobs: Optional[Tensor],
                  grad_entropy: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """The incoming gradients of a summary's log-probs and entropies (None where none arrived)
    as a row backward takes them: zero on rows that do not count (they were never read), in the
    compute dtype; ``(grad_logprobs, grad_entropy)``, the second None when the summary has no
    entropy or no entropy gradient arrives."""
    logprobs = summary.label_logprob
    grad_logprobs = torch.zeros_like(logprobs) if grad_logprobs is None else grad_logprobs
    grad_logprobs = torch.where(counted, grad_logprobs.to(logprobs.dtype), 0.0)
    if summary.entropy is None or grad_entropy is None:
        return grad_logprobs, None
    return grad_logprobs, torch.where(counted, grad_entropy.to(logprobs.dtype), 0.0)


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
