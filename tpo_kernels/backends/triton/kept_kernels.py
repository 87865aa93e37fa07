"""Triton kept-set ops of the fused head (sampling-mask replay): ragged dot products and their
gradients, without forming ``[M, V]`` or gathering ``[P, H]``.

With ``kept`` a CSR of (row, id) pairs (:class:`~tpo_kernels.backends.kept_sets.KeptSets`)::

    forward   z[p]  = h[r] . W[ids[p]] + b[ids[p]]          for the pairs p of row r
    dH[r]     = sum over the pairs p of row r of g[p] W[ids[p]]
    dW, db    : per token, the sorted runs of :func:`tpo_kernels.group_math.pair_runs` (the
                candidate ops' segmented sums, :mod:`.candidate_weight_grad`, with each pair's
                row read from the record's ``rows``)

One program per row on a 1-D grid walks its pairs ``offsets[r] .. offsets[r + 1]`` in blocks of
``BLOCK_K = 16`` (a set of 2048 ids is 128 trips), the hidden dimension in ``BLOCK_H`` columns. A
row's sums depend on its own pairs only: batch-invariant, no atomics. Ids: a negative id is a hole
(``-inf``, adds nothing to dH, never written); an id ``>= V`` gives NaN and is never dereferenced.
The ragged row ops themselves are the PyTorch defaults (``[P]``-sized work).
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..kept_sets import KeptSets
from ..row_summary import compute_dtype
from .candidate_weight_grad import num_warps, weight_grad
from .kernel_support import device_guard

BLOCK_K = 16


@triton.jit
def _kept_dot_kernel(hidden_ptr, weight_ptr, bias_ptr, ids_ptr, offsets_ptr, out_ptr, hidden_row_stride,
                     weight_row_stride, vocab, hidden_size, HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc_ty = out_ptr.dtype.element_ty
    lanes = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_H)
    h_row = hidden_ptr + row * hidden_row_stride
    start = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    for k_start in range(start, end, BLOCK_K):
        p = k_start + lanes
        in_k = p < end
        ids = tl.load(ids_ptr + p, mask=in_k, other=-1)
        in_vocab = in_k & (ids >= 0) & (ids < vocab)
        w_rows = weight_ptr + ids.to(tl.int64)[:, None] * weight_row_stride
        dot = tl.zeros([BLOCK_K], dtype=acc_ty)
        for h_start in range(0, hidden_size, BLOCK_H):
            c = h_start + cols
            in_h = c < hidden_size
            h = tl.load(h_row + c, mask=in_h, other=0.0).to(acc_ty)
            w = tl.load(w_rows + c[None, :], mask=in_vocab[:, None] & in_h[None, :], other=0.0).to(acc_ty)
            dot += tl.sum(w * h[None, :], axis=1)
        if HAS_BIAS:
            dot += tl.load(bias_ptr + ids, mask=in_vocab, other=0.0).to(acc_ty)
        dot = tl.where(ids < 0, float("-inf"), tl.where(in_vocab, dot, float("nan")))
        tl.store(out_ptr + p, dot, mask=in_k)


@triton.jit
def _kept_hidden_grad_kernel(grad_ptr, weight_ptr, ids_ptr, offsets_ptr, dhidden_ptr, weight_row_stride, vocab,
                             hidden_size, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc_ty = grad_ptr.dtype.element_ty
    lanes = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_H)
    start = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    for h_start in range(0, hidden_size, BLOCK_H):
        c = h_start + cols
        in_h = c < hidden_size
        dh = tl.zeros([BLOCK_H], dtype=acc_ty)
        for k_start in range(start, end, BLOCK_K):
            p = k_start + lanes
            in_k = p < end
            ids = tl.load(ids_ptr + p, mask=in_k, other=-1)
            # A hole or an id outside [0, vocab) adds exactly 0: its grad and its row read as 0.
            in_vocab = in_k & (ids >= 0) & (ids < vocab)
            g = tl.load(grad_ptr + p, mask=in_vocab, other=0.0)
            w_rows = weight_ptr + ids.to(tl.int64)[:, None] * weight_row_stride
            w = tl.load(w_rows + c[None, :], mask=in_vocab[:, None] & in_h[None, :], other=0.0).to(acc_ty)
            dh += tl.sum(g[:, None] * w, axis=0)
        tl.store(dhidden_ptr + row * hidden_size + c, dh.to(dhidden_ptr.dtype.element_ty), mask=in_h)


def _block_h(hidden_size: int) -> int:
    # A [BLOCK_K, BLOCK_H] tile of about 4096 elements (fp32 registers on a GPU).
    return max(16, min(triton.next_power_of_2(max(hidden_size, 1)), 4096 // BLOCK_K))


def kept_linear_forward(hidden: Tensor, weight: Tensor, kept: KeptSets, *, bias: Optional[Tensor] = None) -> Tensor:
    """``[P]`` raw ``hidden[row] . weight[id] + bias[id]`` in the compute dtype."""
    acc = compute_dtype(hidden.dtype)
    out = torch.empty(kept.num_pairs, dtype=acc, device=hidden.device)
    rows = kept.num_rows
    if rows == 0 or kept.num_pairs == 0:
        return out
    hidden, weight = hidden.reshape(-1, hidden.shape[-1]).contiguous(), weight.contiguous()
    block_h = _block_h(hidden.shape[1])
    with device_guard(hidden):
        _kept_dot_kernel[(rows,)](
            hidden, weight, bias.contiguous() if bias is not None else hidden, kept.ids.contiguous(),
            kept.offsets.contiguous(), out, hidden.stride(0), weight.stride(0), weight.shape[0], hidden.shape[1],
            HAS_BIAS=bias is not None, BLOCK_K=BLOCK_K, BLOCK_H=block_h, num_warps=num_warps(BLOCK_K * block_h),
        )
    return out


def kept_linear_backward(
    grad: Tensor,
    hidden: Tensor,
    weight: Tensor,
    kept: KeptSets,
    *,
    runs: Optional[Tuple[Tensor, Tensor, Tensor]],
    with_hidden: bool,
    with_weight: bool,
    with_bias: bool,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(dH, dW, db)`` for ``grad [P]`` = dLoss/d(raw kept logit), in the compute dtype, cast to
    the inputs' dtypes; ``runs = pair_runs(kept.ids)`` for dW / db."""
    vocab, hidden_size = weight.shape
    hidden, weight, grad = hidden.contiguous(), weight.contiguous(), grad.contiguous()
    dhidden = torch.zeros_like(hidden) if with_hidden else None
    dweight = torch.zeros_like(weight) if with_weight else None
    dbias = torch.zeros(vocab, dtype=weight.dtype, device=weight.device) if with_bias else None
    if kept.num_rows == 0 or kept.num_pairs == 0:
        return dhidden, dweight, dbias
    block_h = _block_h(hidden_size)
    with device_guard(hidden):
        if with_hidden:
            _kept_hidden_grad_kernel[(kept.num_rows,)](
                grad, weight, kept.ids.contiguous(), kept.offsets.contiguous(), dhidden, weight.stride(0), vocab,
                hidden_size, BLOCK_K=BLOCK_K, BLOCK_H=block_h, num_warps=num_warps(BLOCK_K * block_h),
            )
        if with_weight or with_bias:
            weight_grad(grad, hidden, kept.ids.reshape(-1, 1), runs, dweight, dbias, vocab,
                        pair_rows=kept.rows.contiguous())
    return dhidden, dweight, dbias


__all__ = ["kept_linear_backward", "kept_linear_forward"]
