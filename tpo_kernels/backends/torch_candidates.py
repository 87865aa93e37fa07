"""PyTorch candidate ops for token-level TPO: the defaults of every backend (see the candidate-op
contract in :mod:`tpo_kernels.backends.interface`). Backends with their own kernels override them.

Nothing here forms an ``[R, V]`` tensor except the dense logits gradient the logits path must
return; every sum runs in a fixed order (no float atomics).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import compute_dtype

# Elements of one [states, K, H] temporary of the PyTorch fused-linear ops: 8 MiB of fp32, small
# enough to stay in cache and to be reused by the allocator from chunk to chunk.
_CHUNK_ELEMENTS = 1 << 21


def candidate_forward(logits: Tensor, candidates: Tensor, *, inv_temperature: float) -> Tensor:
    """``logits[r, candidates[r, k]] * inv_t`` in the compute dtype."""
    return logits.gather(1, candidates).to(compute_dtype(logits.dtype)) * inv_temperature


def candidate_backward(grad_cand: Tensor, candidates: Tensor, *, inv_temperature: float, out: Tensor) -> None:
    """``out`` = 0 except ``out[r, candidates[r, k]] += grad_cand[r, k] * inv_t``, summed in
    ``grad_cand``'s dtype and rounded to ``out``'s once. A lower-precision ``out`` gets its sums
    from a compute-dtype accumulator of one chunk of states at a time (8 MiB), never ``[R, V]``."""
    out.zero_()
    if out.dtype == grad_cand.dtype:
        _scatter_columns(out, candidates, grad_cand, inv_temperature)
        return
    for states in _state_chunks(candidates.shape[0], out.shape[1]):
        acc = out.new_zeros((states.stop - states.start, out.shape[1]), dtype=grad_cand.dtype)
        _scatter_columns(acc, candidates[states], grad_cand[states], inv_temperature)
        out[states] = acc


def _scatter_columns(acc: Tensor, candidates: Tensor, grad_cand: Tensor, inv_temperature: float) -> None:
    for k in range(candidates.shape[1]):  # one column at a time: no index collisions, ascending k
        acc.scatter_add_(1, candidates[:, k : k + 1], grad_cand[:, k : k + 1] * inv_temperature)


def _state_chunks(num_states: int, per_state: int):
    step = max(1, _CHUNK_ELEMENTS // max(per_state, 1))
    for start in range(0, num_states, step):
        yield slice(start, min(start + step, num_states))


def _gather_rows(weight: Tensor, ids: Tensor, acc: torch.dtype) -> Tensor:
    """``weight[ids]`` for ``ids`` [n, K] as an ``[n, K, H]`` tensor in ``acc``."""
    return weight.index_select(0, ids.reshape(-1)).view(*ids.shape, weight.shape[1]).to(acc)


def candidate_linear_forward(
    hidden: Tensor, weight: Tensor, candidates: Tensor, *, bias: Optional[Tensor] = None, inv_temperature: float
) -> Tensor:
    """``(h[r] . W[y[r, k]] + b[y[r, k]]) * inv_t`` in the compute dtype, chunked over states."""
    acc = compute_dtype(hidden.dtype)
    num_states, num_cand = candidates.shape
    out = torch.empty(num_states, num_cand, dtype=acc, device=hidden.device)
    for rows in _state_chunks(num_states, num_cand * hidden.shape[1]):
        ids = candidates[rows]
        dots = torch.bmm(_gather_rows(weight, ids, acc), hidden[rows].to(acc).unsqueeze(2)).squeeze(2)
        if bias is not None:
            dots = dots + bias[ids].to(acc)
        out[rows] = dots * inv_temperature
    return out


def candidate_linear_backward(
    grad: Tensor,
    hidden: Tensor,
    weight: Tensor,
    candidates: Tensor,
    *,
    runs: Optional[Tuple[Tensor, Tensor, Tensor]],
    with_hidden: bool,
    with_weight: bool,
    with_bias: bool,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(dH, dW, db)`` for ``grad[r, k]`` = dLoss/d(untempered candidate logit), as in
    the Triton kernels; ``runs`` is :func:`tpo_kernels.layout.pair_runs` (needed
    for dW / db). Sums run in the compute dtype ``grad.dtype``; results take the input dtypes.

    All three are weighted bag sums, so they use ``embedding_bag(mode="sum")``, whose forward sums
    each bag sequentially in index order on CPU and CUDA (deterministic, no atomics):
    dH bags the K candidate rows of W per state; dW bags, per distinct token, the rows of h of its
    (r, k) pairs in ascending order, weighted by grad; db bags the grads themselves.
    """
    acc = grad.dtype
    vocab, hidden_size = weight.shape
    dhidden = dweight = dbias = None
    if with_hidden:
        if weight.dtype == acc:
            dhidden = F.embedding_bag(candidates, weight, per_sample_weights=grad, mode="sum")
        else:  # low-precision weight: gather the candidate rows chunk by chunk and sum in acc
            dhidden = torch.empty(hidden.shape, dtype=acc, device=hidden.device)
            for rows in _state_chunks(candidates.shape[0], candidates.shape[1] * hidden_size):
                w = _gather_rows(weight, candidates[rows], acc)
                dhidden[rows] = torch.bmm(grad[rows].unsqueeze(1), w).squeeze(1)
        dhidden = dhidden.to(hidden.dtype)
    if with_weight or with_bias:
        order, tokens, offsets = runs
        pair_grad = grad.reshape(-1)[order]
        if with_weight:
            states = torch.div(order, candidates.shape[1], rounding_mode="floor")
            rows = F.embedding_bag(
                states, hidden.to(acc), offsets[:-1], mode="sum", per_sample_weights=pair_grad
            )
            dweight = torch.zeros_like(weight)
            dweight[tokens] = rows.to(weight.dtype)
        if with_bias:
            sums = F.embedding_bag(order, grad.reshape(-1, 1), offsets[:-1], mode="sum").squeeze(1)
            dbias = torch.zeros(vocab, dtype=weight.dtype, device=weight.device)
            dbias[tokens] = sums.to(weight.dtype)
    return dhidden, dweight, dbias
