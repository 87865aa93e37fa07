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
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._dtypes import compute_dtype
from ..backends import backend_by_key


@torch.library.custom_op("tpo_kernels::logprobs", mutates_args=())
def _logprobs(logits: Tensor, labels: Tensor, inv_temperature: float, with_entropy: bool,
              inplace_backward: bool, backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    stats, logprob, entropy = backend_by_key(backend).row_forward(
        logits, labels, inv_temperature=inv_temperature, with_entropy=with_entropy
    )
    if entropy is None:
        entropy = logprob.new_empty(0)
    return logprob, entropy, stats


@_logprobs.register_fake
def _(logits, labels, inv_temperature, with_entropy, inplace_backward, backend):
    rows, acc = logits.shape[0], compute_dtype(logits.dtype)
    return (logits.new_empty(rows, dtype=acc), logits.new_empty(rows if with_entropy else 0, dtype=acc),
            logits.new_empty(2, rows, dtype=acc))


@torch.library.custom_op("tpo_kernels::logprobs_backward", mutates_args=())
def _logprobs_backward(logits: Tensor, labels: Tensor, stats: Tensor, logprobs: Tensor, grad_logprobs: Tensor,
                       grad_entropy: Optional[Tensor], entropy: Optional[Tensor],
                       inv_temperature: float, backend: str) -> Tensor:
    out = torch.empty_like(logits)
    backend_by_key(backend).row_backward(
        logits, labels, stats, logprobs, grad_logprobs, grad_entropy=grad_entropy, entropy=entropy,
        inv_temperature=inv_temperature, out=out,
    )
    return out


@_logprobs_backward.register_fake
def _(logits, labels, stats, logprobs, grad_logprobs, grad_entropy, entropy, inv_temperature, backend):
    return torch.empty_like(logits)


@torch.library.custom_op("tpo_kernels::logprobs_backward_", mutates_args=("logits",))
def _logprobs_backward_inplace(logits: Tensor, labels: Tensor, stats: Tensor, logprobs: Tensor,
                               grad_logprobs: Tensor, grad_entropy: Optional[Tensor], entropy: Optional[Tensor],
                               inv_temperature: float, backend: str) -> None:
    backend_by_key(backend).row_backward(
        logits, labels, stats, logprobs, grad_logprobs, grad_entropy=grad_entropy, entropy=entropy,
        inv_temperature=inv_temperature, out=logits,
    )


@_logprobs_backward_inplace.register_fake
def _(logits, labels, stats, logprobs, grad_logprobs, grad_entropy, entropy, inv_temperature, backend):
    return None


def _setup_context(ctx, inputs, output):
    logits, labels, inv_temperature, with_entropy, inplace_backward, backend = inputs
    logprobs, entropy, stats = output
    ctx.save_for_backward(logits, labels, stats, logprobs, entropy)
    ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
    ctx.inv_temperature, ctx.with_entropy = inv_temperature, with_entropy
    ctx.inplace_backward, ctx.backend = inplace_backward, backend


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
    args = (labels, stats, logprobs, grad_logprobs, grad_entropy, entropy, ctx.inv_temperature, ctx.backend)
    if ctx.inplace_backward:
        _logprobs_backward_inplace(logits, *args)
        return logits, None, None, None, None, None
    return _logprobs_backward(logits, *args), None, None, None, None, None


_logprobs.register_autograd(_backward, setup_context=_setup_context)


def token_logprobs(logits: Tensor, labels: Tensor, *, inv_temperature: float, with_entropy: bool,
                   inplace_backward: bool, backend: str) -> Tuple[Tensor, Optional[Tensor]]:
    """``(logprobs [M], entropy [M] | None)`` of ``[M, V]`` logits (unit column stride) for int64
    ``labels`` (negative: skipped), in the compute dtype; differentiable in ``logits``."""
    logprobs, entropy, _ = _logprobs(logits, labels, inv_temperature, with_entropy, inplace_backward, backend)
    return logprobs, (entropy if with_entropy else None)
