"""``tpo_kernels::logprobs``: per-token log-probs (and entropies) of a ``[M, V]`` logits matrix,
as a custom op whose backward is the backend's fused row backward.

Forward (row op of the backend): ``lp[r] = log softmax(z[r] / tau)[y_r]`` and, on request, the
entropy ``H[r]`` of ``softmax(z[r] / tau)``; 0 on rows whose label is negative (those rows are
never read). The row statistics (max and log-sum, see the row-op contract in
:mod:`tpo_kernels.backends.interface`) and ``lp`` itself are kept for the backward. Backward,
with ``p = softmax(z / tau)``::

    dz[r, v] = (g[r] * (onehot(y_r)[v] - p[v]) - ge[r] * p[v] * (log p[v] + H[r])) / tau

for the incoming gradients ``g`` (of lp) and ``ge`` (of H). With ``inplace_backward`` the
gradient is written over the logits buffer, which saves a ``[M, V]`` tensor; the op marks the
buffer as modified, so a second consumer of the same logits fails loudly.

``logit_scale`` and ``logit_softcap`` transform the logits first (:mod:`tpo_kernels.ops.transform`):
a scale alone folds into ``inv_temperature``; a soft cap runs the row ops on capped row chunks.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._dtypes import compute_dtype
from ..backends import backend_by_key
from .transform import LogitTransform, folded_inv_temperature, row_chunk


@torch.library.custom_op("tpo_kernels::logprobs", mutates_args=())
def _logprobs(logits: Tensor, labels: Tensor, inv_temperature: float, with_entropy: bool,
              inplace_backward: bool, backend: str, logit_scale: float = 1.0,
              logit_softcap: Optional[float] = None) -> Tuple[Tensor, Tensor, Tensor]:
    row_op = backend_by_key(backend).row_forward
    inv_t = folded_inv_temperature(inv_temperature, logit_scale, logit_softcap)
    transform = LogitTransform.of(logit_scale, logit_softcap)
    if transform is None:
        stats, logprob, entropy = row_op(logits, labels, inv_temperature=inv_t, with_entropy=with_entropy)
    else:
        stats, logprob, entropy = _capped_forward(row_op, transform, logits, labels, inv_t, with_entropy)
    if entropy is None:
        entropy = logprob.new_empty(0)
    return logprob, entropy, stats


def _capped_forward(row_op, transform: LogitTransform, logits: Tensor, labels: Tensor, inv_t: float,
                    with_entropy: bool):
    """The row op on soft-capped row chunks, each capped into one chunk-sized compute-dtype buffer."""
    num_rows, vocab = logits.shape
    acc = compute_dtype(logits.dtype)
    stats = logits.new_zeros(2, num_rows, dtype=acc)
    logprob = logits.new_zeros(num_rows, dtype=acc)
    entropy = logits.new_zeros(num_rows, dtype=acc) if with_entropy else None
    step = row_chunk(num_rows, vocab, logits.device)
    buffer = logits.new_empty(min(step, num_rows) * vocab, dtype=acc)
    for start in range(0, num_rows, step):
        rows = slice(start, min(start + step, num_rows))
        z = logits[rows]
        capped = transform.cap(z, buffer[: z.numel()].view(z.shape))
        stats[:, rows], logprob[rows], chunk_entropy = row_op(capped, labels[rows], inv_temperature=inv_t,
                                                              with_entropy=with_entropy)
        if with_entropy:
            entropy[rows] = chunk_entropy
    return stats, logprob, entropy


@_logprobs.register_fake
def _(logits, labels, inv_temperature, with_entropy, inplace_backward, backend, logit_scale=1.0, logit_softcap=None):
    rows, acc = logits.shape[0], compute_dtype(logits.dtype)
    return (logits.new_empty(rows, dtype=acc), logits.new_empty(rows if with_entropy else 0, dtype=acc),
            logits.new_empty(2, rows, dtype=acc))


def _row_backward(logits: Tensor, labels: Tensor, stats: Tensor, logprobs: Tensor, grad_logprobs: Tensor,
                  grad_entropy: Optional[Tensor], entropy: Optional[Tensor], inv_temperature: float, backend: str,
                  logit_scale: float, logit_softcap: Optional[float], out: Tensor) -> None:
    """The backend's row backward into ``out`` (may be ``logits``), through the logit transform.

    With a soft cap, row chunks: recompute the capped chunk, run the row backward on it in
    place, multiply by the cap's derivative and write the result into ``out``'s rows (the chunk
    of ``logits`` is read before its rows of ``out`` are written)."""
    row_op = backend_by_key(backend).row_backward
    inv_t = folded_inv_temperature(inv_temperature, logit_scale, logit_softcap)
    transform = LogitTransform.of(logit_scale, logit_softcap)
    if transform is None:
        row_op(logits, labels, stats, logprobs, grad_logprobs, grad_entropy=grad_entropy, entropy=entropy,
               inv_temperature=inv_t, out=out)
        return
    num_rows, vocab = logits.shape
    step = row_chunk(num_rows, vocab, logits.device)
    capped_buffer, derivative_buffer = (logits.new_empty(min(step, num_rows) * vocab, dtype=compute_dtype(logits.dtype))
                                        for _ in range(2))
    for start in range(0, num_rows, step):
        rows = slice(start, min(start + step, num_rows))
        z = logits[rows]
        capped = transform.cap(z, capped_buffer[: z.numel()].view(z.shape))
        derivative = transform.derivative(z, derivative_buffer[: z.numel()].view(z.shape))
        row_op(capped, labels[rows], stats[:, rows], logprobs[rows], grad_logprobs[rows],
               grad_entropy=None if grad_entropy is None else grad_entropy[rows],
               entropy=None if entropy is None else entropy[rows], inv_temperature=inv_t, out=capped)
        out[rows] = capped.mul_(derivative)


@torch.library.custom_op("tpo_kernels::logprobs_backward", mutates_args=())
def _logprobs_backward(logits: Tensor, labels: Tensor, stats: Tensor, logprobs: Tensor, grad_logprobs: Tensor,
                       grad_entropy: Optional[Tensor], entropy: Optional[Tensor], inv_temperature: float,
                       backend: str, logit_scale: float = 1.0, logit_softcap: Optional[float] = None) -> Tensor:
    out = torch.empty_like(logits)
    _row_backward(logits, labels, stats, logprobs, grad_logprobs, grad_entropy, entropy, inv_temperature, backend,
                  logit_scale, logit_softcap, out)
    return out


@_logprobs_backward.register_fake
def _(logits, *args):
    return torch.empty_like(logits)


@torch.library.custom_op("tpo_kernels::logprobs_backward_", mutates_args=("logits",))
def _logprobs_backward_inplace(logits: Tensor, labels: Tensor, stats: Tensor, logprobs: Tensor,
                               grad_logprobs: Tensor, grad_entropy: Optional[Tensor], entropy: Optional[Tensor],
                               inv_temperature: float, backend: str, logit_scale: float = 1.0,
                               logit_softcap: Optional[float] = None) -> None:
    _row_backward(logits, labels, stats, logprobs, grad_logprobs, grad_entropy, entropy, inv_temperature, backend,
                  logit_scale, logit_softcap, logits)


@_logprobs_backward_inplace.register_fake
def _(logits, *args):
    return None


def _setup_context(ctx, inputs, output):
    logits, labels, inv_temperature, with_entropy, inplace_backward, backend, logit_scale, logit_softcap = inputs
    logprobs, entropy, stats = output
    ctx.save_for_backward(logits, labels, stats, logprobs, entropy)
    ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
    ctx.inv_temperature, ctx.with_entropy = inv_temperature, with_entropy
    ctx.inplace_backward, ctx.backend = inplace_backward, backend
    ctx.transform = (logit_scale, logit_softcap)


def row_gradients(counted: Tensor, logprobs: Tensor, entropy: Optional[Tensor], grad_logprobs: Optional[Tensor],
                  grad_entropy: Optional[Tensor], with_entropy: bool):
    """The incoming per-row gradients as a row backward takes them: zero on rows that do not
    count (they were never read), in the compute dtype; ``(grad_logprobs, grad_entropy, entropy)``
    with the last two None when no entropy gradient arrives."""
    if grad_logprobs is None:
        grad_logprobs = torch.zeros_like(logprobs)
    grad_logprobs = torch.where(counted, grad_logprobs.to(logprobs.dtype), 0.0)
    if not with_entropy or grad_entropy is None:
        return grad_logprobs, None, None
    return grad_logprobs, torch.where(counted, grad_entropy.to(logprobs.dtype), 0.0), entropy


def _backward(ctx, grad_logprobs, grad_entropy, grad_stats):
    logits, labels, stats, logprobs, entropy = ctx.saved_tensors
    grad_logprobs, grad_entropy, entropy = row_gradients(labels >= 0, logprobs, entropy, grad_logprobs, grad_entropy,
                                                         ctx.with_entropy)
    args = (labels, stats, logprobs, grad_logprobs, grad_entropy, entropy, ctx.inv_temperature, ctx.backend,
            *ctx.transform)
    if ctx.inplace_backward:
        _logprobs_backward_inplace(logits, *args)
        return logits, None, None, None, None, None, None, None
    return _logprobs_backward(logits, *args), None, None, None, None, None, None, None


_logprobs.register_autograd(_backward, setup_context=_setup_context)


def token_logprobs(logits: Tensor, labels: Tensor, *, inv_temperature: float, with_entropy: bool,
                   inplace_backward: bool, backend: str, logit_scale: float = 1.0,
                   logit_softcap: Optional[float] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """``(logprobs [M], entropy [M] | None)`` of ``[M, V]`` logits (unit column stride, any row
    stride >= V) through the logit transform (:mod:`tpo_kernels.ops.transform`) for int64
    ``labels`` (negative: skipped), in the compute dtype; differentiable in ``logits``."""
    logprobs, entropy, _ = _logprobs(logits, labels, inv_temperature, with_entropy, inplace_backward, backend,
                                     logit_scale, logit_softcap)
    return logprobs, (entropy if with_entropy else None)
