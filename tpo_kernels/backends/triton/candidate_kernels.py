"""Triton candidate ops for token-level TPO: gather / scatter of K candidate logits per state, and
the same for the fused-linear path, where a candidate logit is a dot product ``h[r] . W[y]``.

Logits path (the candidate-op contract of :mod:`tpo_kernels.backends`)::

    forward   cand[r, k] = logits[r, y[r, k]] * inv_t                         (compute dtype)
    backward  out[r, :]  = 0;  out[r, y[r, k]] += grad[r, k] * inv_t  for k = 0, 1, ..., K-1

The backward zero-fills ``out`` (one fill, any strides) and then writes K values per row: lane k
of the row's program sums ``grad[r, j] * inv_t`` over every j with ``y[r, j] == y[r, k]``, j in
ascending order from 0 (K * K work per row, independent of V), and only the first lane holding an
id stores it (cast to the output dtype). Duplicated candidates therefore sum in ascending k order,
bit for bit like the PyTorch default (on CPU the Triton interpreter's cast to bf16/fp16 may round
the last bit differently), and no two lanes write one element. Bit for bit needs each product
``grad * inv_t`` rounded before it is added, so the scatter is compiled without floating-point
contraction (``enable_fp_fusion=False``: no FMA; K * K multiply-adds per row, never the bottleneck
next to the ``[R, V]`` zero fill).

Fused-linear path (``h`` [R, H], ``W`` [V, H], optional bias ``b`` [V]; ``g`` is the gradient of
the loss w.r.t. the untempered candidate logit ``z[r, k] = h[r] . W[y[r, k]] + b[y[r, k]]``)::

    forward   cand[r, k] = (h[r] . W[y[r, k]] + b[y[r, k]]) * inv_t
    dH[r]     = sum_k g[r, k] * W[y[r, k]]
    dW[v]     = sum over pairs (r, k) with y[r, k] == v of g[r, k] * h[r]     (0 for other rows)
    db[v]     = sum over the same pairs of g[r, k]

dW and db are deterministic without atomics: the (r, k) pairs are stably sorted by token id and
each token's run is cut into fixed segments summed in parallel, then combined in a fixed order
(:mod:`.candidate_weight_grad`), in the compute dtype.

Ids (the contract of DESIGN.md, "Ids outside the vocabulary"; ``V`` is the logits view's width,
or the weight's rows): every kernel masks each load and store at an id to ``0 <= id < V``. A
candidate outside it is never dereferenced: its candidate logit is NaN (gather, dot), it is not
written (scatter, dW, db) and it adds nothing (dH). ``validate=False`` reaches here unchecked.

One program per state on a 1-D grid; row offsets are int64.
Scale factors travel as 1-element tensors in the compute dtype, so fp64 runs keep inv_t exact.
Only long-standing ``tl`` APIs are used (Triton 3.x).
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..rows import compute_dtype
from .candidate_weight_grad import num_warps, weight_grad
from .kernel_support import device_guard


@triton.jit
def _candidate_gather_kernel(
    logits_ptr, candidates_ptr, scale_ptr, out_ptr, row_stride, vocab, num_cand, BLOCK_K: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr)
    lanes = tl.arange(0, BLOCK_K)
    for start in range(0, num_cand, BLOCK_K):
        k = start + lanes
        in_range = k < num_cand
        ids = tl.load(candidates_ptr + row * num_cand + k, mask=in_range, other=0)
        in_vocab = in_range & (ids >= 0) & (ids < vocab)
        z = tl.load(logits_ptr + row * row_stride + ids, mask=in_vocab, other=0.0)
        cand = tl.where(in_vocab, z.to(out_ptr.dtype.element_ty) * scale, float("nan"))
        tl.store(out_ptr + row * num_cand + k, cand, mask=in_range)


@triton.jit
def _candidate_scatter_kernel(
    grad_ptr, candidates_ptr, scale_ptr, out_ptr, out_row_stride, out_col_stride, vocab, num_cand,
    BLOCK_K: tl.constexpr
):
    # ``out`` is already zero. Lane k sums grad[r, j] * inv_t over every j with y[r, j] == y[r, k],
    # in ascending j (K * K work per row, not V * K); only the first lane holding an id stores it,
    # and only an id in [0, vocab): the others are never written.
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr)
    lanes = tl.arange(0, BLOCK_K)
    cand_row = candidates_ptr + row * num_cand
    grad_row = grad_ptr + row * num_cand
    for start in range(0, num_cand, BLOCK_K):
        k = start + lanes
        ids = tl.load(cand_row + k, mask=k < num_cand, other=-1)
        acc = tl.zeros([BLOCK_K], dtype=grad_ptr.dtype.element_ty)
        first = (k < num_cand) & (ids >= 0) & (ids < vocab)
        for j in range(0, num_cand):
            same = ids == tl.load(cand_row + j)
            acc = tl.where(same, acc + tl.load(grad_row + j) * scale, acc)
            first = first & ~(same & (j < k))
        tl.store(out_ptr + row * out_row_stride + ids * out_col_stride, acc.to(out_ptr.dtype.element_ty), mask=first)


@triton.jit
def pair_dots(h_row, weight_ptr, bias_ptr, out_ptr, ids, in_vocab, weight_row_stride, hidden_size,
              HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """``h_row . W[ids[k]] (+ b[ids[k]])`` for a block of ``BLOCK_K`` ids, in ``out_ptr``'s dtype,
    the hidden dimension in ``BLOCK_H`` columns; 0 where not ``in_vocab`` (never dereferenced).
    The one dot loop of the candidate and the kept-set kernels."""
    acc_ty = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
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
    return dot


@triton.jit
def _candidate_dot_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    candidates_ptr,
    scale_ptr,
    out_ptr,
    hidden_row_stride,
    weight_row_stride,
    vocab,
    num_cand,
    hidden_size,
    HAS_BIAS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr)
    lanes = tl.arange(0, BLOCK_K)
    h_row = hidden_ptr + row * hidden_row_stride
    for k_start in range(0, num_cand, BLOCK_K):
        k = k_start + lanes
        in_k = k < num_cand
        ids = tl.load(candidates_ptr + row * num_cand + k, mask=in_k, other=0)
        in_vocab = in_k & (ids >= 0) & (ids < vocab)
        dot = pair_dots(h_row, weight_ptr, bias_ptr, out_ptr, ids, in_vocab, weight_row_stride, hidden_size,
                        HAS_BIAS, BLOCK_K, BLOCK_H)
        tl.store(out_ptr + row * num_cand + k, tl.where(in_vocab, dot * scale, float("nan")), mask=in_k)


@triton.jit
def _candidate_dot_hidden_grad_kernel(
    grad_ptr,
    weight_ptr,
    candidates_ptr,
    dhidden_ptr,
    weight_row_stride,
    vocab,
    num_cand,
    hidden_size,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    acc_ty = grad_ptr.dtype.element_ty
    lanes = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_H)
    for h_start in range(0, hidden_size, BLOCK_H):
        c = h_start + cols
        in_h = c < hidden_size
        dh = tl.zeros([BLOCK_H], dtype=acc_ty)
        for k_start in range(0, num_cand, BLOCK_K):
            k = k_start + lanes
            in_k = k < num_cand
            ids = tl.load(candidates_ptr + row * num_cand + k, mask=in_k, other=0)
            # An id outside [0, vocab) adds exactly 0: its grad (NaN or not) and its row read as 0.
            in_vocab = in_k & (ids >= 0) & (ids < vocab)
            g = tl.load(grad_ptr + row * num_cand + k, mask=in_vocab, other=0.0)
            w_rows = weight_ptr + ids.to(tl.int64)[:, None] * weight_row_stride
            w = tl.load(w_rows + c[None, :], mask=in_vocab[:, None] & in_h[None, :], other=0.0).to(acc_ty)
            dh += tl.sum(g[:, None] * w, axis=0)
        tl.store(dhidden_ptr + row * hidden_size + c, dh.to(dhidden_ptr.dtype.element_ty), mask=in_h)


def _scale(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.full((1,), value, dtype=dtype, device=device)  # a fill, no host-to-device copy


def _block_k(num_cand: int) -> int:
    return min(triton.next_power_of_2(max(num_cand, 1)), 64)


def _block_h(hidden_size: int, block_k: int) -> int:
    # Keep a [BLOCK_K, BLOCK_H] tile at about 4096 elements (fp32 registers on a GPU).
    return max(16, min(triton.next_power_of_2(max(hidden_size, 1)), 4096 // block_k))


def candidate_forward(logits: Tensor, candidates: Tensor, *, inv_temperature: float) -> Tensor:
    """``cand[r, k] = logits[r, candidates[r, k]] * inv_t`` in the compute dtype, ``[R, K]``."""
    rows, num_cand = candidates.shape
    acc = compute_dtype(logits.dtype)
    out = torch.empty(rows, num_cand, dtype=acc, device=logits.device)
    if rows == 0 or num_cand == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    candidates = candidates.contiguous()
    block_k = _block_k(num_cand)
    with device_guard(logits):
        _candidate_gather_kernel[(rows,)](
            logits,
            candidates,
            _scale(inv_temperature, acc, logits.device),
            out,
            logits.stride(0),
            logits.shape[1],
            num_cand,
            BLOCK_K=block_k,
            num_warps=1,
        )
    return out


def candidate_backward(grad_cand: Tensor, candidates: Tensor, *, inv_temperature: float, out: Tensor) -> None:
    """``out`` (``[R, V]``, any strides) becomes zero except ``out[r, candidates[r, k]] +=
    grad_cand[r, k] * inv_t`` (ascending k), accumulated in ``grad_cand``'s dtype and cast to
    ``out``'s once per element: one fill, then K stores per row."""
    rows, num_cand = candidates.shape
    out.zero_()
    if rows == 0 or num_cand == 0:
        return
    candidates = candidates.contiguous()
    grad_cand = grad_cand.contiguous()
    with device_guard(out):
        _candidate_scatter_kernel[(rows,)](
            grad_cand,
            candidates,
            _scale(inv_temperature, grad_cand.dtype, out.device),
            out,
            out.stride(0),
            out.stride(1),
            out.shape[1],
            num_cand,
            BLOCK_K=_block_k(num_cand),
            num_warps=1,
            # acc + g * inv_t rounds the product first, as the PyTorch default's scatter_add of
            # g * inv_t does: a fused multiply-add would differ in the last bit (see the docstring).
            enable_fp_fusion=False,
        )


def candidate_linear_forward(
    hidden: Tensor, weight: Tensor, candidates: Tensor, *, bias: Optional[Tensor] = None, inv_temperature: float
) -> Tensor:
    """``cand[r, k] = (hidden[r] . weight[y] + bias[y]) * inv_t`` with ``y = candidates[r, k]``, in
    the compute dtype; never forms the ``[R, V]`` logits."""
    rows, num_cand = candidates.shape
    acc = compute_dtype(hidden.dtype)
    out = torch.empty(rows, num_cand, dtype=acc, device=hidden.device)
    if rows == 0 or num_cand == 0:
        return out
    hidden, weight, candidates = hidden.contiguous(), weight.contiguous(), candidates.contiguous()
    block_k = _block_k(num_cand)
    block_h = _block_h(hidden.shape[1], block_k)
    with device_guard(hidden):
        _candidate_dot_kernel[(rows,)](
            hidden,
            weight,
            bias.contiguous() if bias is not None else hidden,  # placeholder pointer without bias
            candidates,
            _scale(inv_temperature, acc, hidden.device),
            out,
            hidden.stride(0),
            weight.stride(0),
            weight.shape[0],
            num_cand,
            hidden.shape[1],
            HAS_BIAS=bias is not None,
            BLOCK_K=block_k,
            BLOCK_H=block_h,
            num_warps=num_warps(block_k * block_h),
        )
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
    """``(dH, dW, db)`` for ``grad[r, k]`` = dLoss/d(untempered candidate logit) in the compute
    dtype; each is ``None`` unless requested. ``runs = (order, tokens, offsets)``, needed for dW
    and db, lists the (r, k) pairs (numbered ``r * K + k``) stably sorted by token id: the pairs of
    ``tokens[i]`` are ``order[offsets[i]:offsets[i+1]]``. dW ``[V, H]`` and db ``[V]`` are zero
    except at the candidate rows; sums run in the compute dtype, then are cast to the weight's."""
    rows, num_cand = candidates.shape
    vocab, hidden_size = weight.shape
    hidden, weight, candidates = hidden.contiguous(), weight.contiguous(), candidates.contiguous()
    grad = grad.contiguous()
    dhidden = torch.empty_like(hidden) if with_hidden else None
    dweight = torch.zeros_like(weight) if with_weight else None
    dbias = torch.zeros(vocab, dtype=weight.dtype, device=weight.device) if with_bias else None
    if rows == 0 or num_cand == 0:
        if dhidden is not None:
            dhidden.zero_()
        return dhidden, dweight, dbias
    block_k = _block_k(num_cand)
    block_h = _block_h(hidden_size, block_k)
    with device_guard(hidden):
        if with_hidden:
            _candidate_dot_hidden_grad_kernel[(rows,)](
                grad,
                weight,
                candidates,
                dhidden,
                weight.stride(0),
                vocab,
                num_cand,
                hidden_size,
                BLOCK_K=block_k,
                BLOCK_H=block_h,
                num_warps=num_warps(block_k * block_h),
            )
        if with_weight or with_bias:
            weight_grad(grad, hidden, candidates, runs, dweight, dbias, vocab)
    return dhidden, dweight, dbias
