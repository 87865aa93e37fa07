"""Triton candidate ops for token-level TPO: gather / scatter of K candidate logits per state, and
the same for the fused-linear path, where a candidate logit is a dot product ``h[r] . W[y]``.

Logits path (the candidate-op contract of :mod:`tpo_kernels.backends`)::

    forward   cand[r, k] = logits[r, y[r, k]] * inv_t                         (compute dtype)
    backward  out[r, :]  = 0;  out[r, y[r, k]] += grad[r, k] * inv_t  for k = 0, 1, ..., K-1

The backward accumulates each chunk of a row in registers: starting from 0 it adds, k by k in
ascending order, ``grad[r, k] * inv_t`` to the lane whose column is ``y[r, k]``, then stores the
chunk once (cast to the output dtype). Duplicated candidates therefore sum in ascending k order,
bit for bit like the PyTorch default (on CPU the Triton interpreter's cast to bf16/fp16 may round
the last bit differently), and no program reads what another wrote.

Fused-linear path (``h`` [R, H], ``W`` [V, H], optional bias ``b`` [V]; ``g`` is the gradient of
the loss w.r.t. the untempered candidate logit ``z[r, k] = h[r] . W[y[r, k]] + b[y[r, k]]``)::

    forward   cand[r, k] = (h[r] . W[y[r, k]] + b[y[r, k]]) * inv_t
    dH[r]     = sum_k g[r, k] * W[y[r, k]]
    dW[v]     = sum over pairs (r, k) with y[r, k] == v of g[r, k] * h[r]     (0 for other rows)
    db[v]     = sum over the same pairs of g[r, k]

dW and db are deterministic without atomics: the (r, k) pairs are stably sorted by token id, and
one program per (token, column block) sums its token's run of pairs sequentially in ascending
(r, k) order, in the compute dtype.

One program per state (or per token for dW) on a 1-D grid dimension; row offsets are int64.
Scale factors travel as 1-element tensors in the compute dtype, so fp64 runs keep inv_t exact.
Only long-standing ``tl`` APIs are used (Triton 3.x).
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..._dtypes import compute_dtype
from .. import triton_interpreter_enabled
from .row_kernels import device_guard


@triton.jit
def _candidate_gather_kernel(
    logits_ptr, candidates_ptr, scale_ptr, out_ptr, row_stride, num_cand, BLOCK_K: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr)
    lanes = tl.arange(0, BLOCK_K)
    for start in range(0, num_cand, BLOCK_K):
        k = start + lanes
        in_range = k < num_cand
        ids = tl.load(candidates_ptr + row * num_cand + k, mask=in_range, other=0)
        z = tl.load(logits_ptr + row * row_stride + ids, mask=in_range, other=0.0)
        tl.store(out_ptr + row * num_cand + k, z.to(out_ptr.dtype.element_ty) * scale, mask=in_range)


@triton.jit
def _candidate_scatter_kernel(
    grad_ptr, candidates_ptr, scale_ptr, out_ptr, out_row_stride, vocab, num_cand, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr)
    cols = tl.arange(0, BLOCK_V)
    out_row = out_ptr + row * out_row_stride
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        acc = tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty)
        for k in range(0, num_cand):  # ascending k: duplicates accumulate in a fixed order
            token = tl.load(candidates_ptr + row * num_cand + k)
            g = tl.load(grad_ptr + row * num_cand + k) * scale
            acc = tl.where(idx == token, acc + g, acc)
        tl.store(out_row + idx, acc.to(out_ptr.dtype.element_ty), mask=idx < vocab)


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
    num_cand,
    hidden_size,
    HAS_BIAS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    acc_ty = out_ptr.dtype.element_ty
    scale = tl.load(scale_ptr)
    lanes = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_H)
    h_row = hidden_ptr + row * hidden_row_stride
    for k_start in range(0, num_cand, BLOCK_K):
        k = k_start + lanes
        in_k = k < num_cand
        ids = tl.load(candidates_ptr + row * num_cand + k, mask=in_k, other=0)
        w_rows = weight_ptr + ids.to(tl.int64)[:, None] * weight_row_stride
        dot = tl.zeros([BLOCK_K], dtype=acc_ty)
        for h_start in range(0, hidden_size, BLOCK_H):
            c = h_start + cols
            in_h = c < hidden_size
            h = tl.load(h_row + c, mask=in_h, other=0.0).to(acc_ty)
            w = tl.load(w_rows + c[None, :], mask=in_k[:, None] & in_h[None, :], other=0.0).to(acc_ty)
            dot += tl.sum(w * h[None, :], axis=1)
        if HAS_BIAS:
            dot += tl.load(bias_ptr + ids, mask=in_k, other=0.0).to(acc_ty)
        tl.store(out_ptr + row * num_cand + k, dot * scale, mask=in_k)


@triton.jit
def _candidate_dot_hidden_grad_kernel(
    grad_ptr,
    weight_ptr,
    candidates_ptr,
    dhidden_ptr,
    weight_row_stride,
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
            g = tl.load(grad_ptr + row * num_cand + k, mask=in_k, other=0.0)
            w_rows = weight_ptr + ids.to(tl.int64)[:, None] * weight_row_stride
            w = tl.load(w_rows + c[None, :], mask=in_k[:, None] & in_h[None, :], other=0.0).to(acc_ty)
            dh += tl.sum(g[:, None] * w, axis=0)
        tl.store(dhidden_ptr + row * hidden_size + c, dh.to(dhidden_ptr.dtype.element_ty), mask=in_h)


@triton.jit
def _candidate_dot_weight_grad_kernel(
    grad_ptr,
    hidden_ptr,
    pair_order_ptr,
    run_offsets_ptr,
    run_tokens_ptr,
    dweight_ptr,
    dbias_ptr,
    hidden_row_stride,
    num_cand,
    hidden_size,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    run = tl.program_id(0)
    block = tl.program_id(1)
    acc_ty = grad_ptr.dtype.element_ty
    first = tl.load(run_offsets_ptr + run)
    end = tl.load(run_offsets_ptr + run + 1)
    token = tl.load(run_tokens_ptr + run)
    c = block * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = c < hidden_size
    dw = tl.zeros([BLOCK_H], dtype=acc_ty)
    db = tl.full([], 0.0, acc_ty)
    for j in range(first, end):  # this token's (r, k) pairs in ascending order
        pair = tl.load(pair_order_ptr + j)
        g = tl.load(grad_ptr + pair)
        if HAS_WEIGHT:
            state = pair // num_cand
            h = tl.load(hidden_ptr + state * hidden_row_stride + c, mask=in_h, other=0.0).to(acc_ty)
            dw += g * h
        db += g
    if HAS_WEIGHT:
        tl.store(dweight_ptr + token * hidden_size + c, dw.to(dweight_ptr.dtype.element_ty), mask=in_h)
    if HAS_BIAS:
        if block == 0:
            tl.store(dbias_ptr + token, db.to(dbias_ptr.dtype.element_ty))


def _scale(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.full((1,), value, dtype=dtype, device=device)  # a fill, no host-to-device copy


def _block_v(vocab: int) -> int:
    cap = 1024 if triton_interpreter_enabled() else 4096
    return min(triton.next_power_of_2(max(vocab, 1)), cap)


def _block_k(num_cand: int) -> int:
    return min(triton.next_power_of_2(max(num_cand, 1)), 64)


def _block_h(hidden_size: int, block_k: int) -> int:
    # Keep a [BLOCK_K, BLOCK_H] tile at about 4096 elements (fp32 registers on a GPU).
    return max(16, min(triton.next_power_of_2(max(hidden_size, 1)), 4096 // block_k))


def _num_warps(tile: int) -> int:
    return 8 if tile >= 4096 else 4 if tile >= 1024 else 2 if tile >= 256 else 1


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
            num_cand,
            BLOCK_K=block_k,
            num_warps=1,
        )
    return out


def candidate_backward(grad_cand: Tensor, candidates: Tensor, *, inv_temperature: float, out: Tensor) -> None:
    """``out`` (``[R, V]``) becomes zero except ``out[r, candidates[r, k]] += grad_cand[r, k] * inv_t``
    (ascending k), accumulated in ``grad_cand``'s dtype and cast to ``out``'s once per element."""
    rows, vocab = out.shape
    if rows == 0:
        return
    target = out if out.stride(1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
    candidates = candidates.contiguous()
    grad_cand = grad_cand.contiguous()
    block_v = _block_v(vocab)
    with device_guard(out):
        _candidate_scatter_kernel[(rows,)](
            grad_cand,
            candidates,
            _scale(inv_temperature, grad_cand.dtype, out.device),
            target,
            target.stride(0),
            vocab,
            candidates.shape[1],
            BLOCK_V=block_v,
            num_warps=_num_warps(block_v),
        )
    if target is not out:
        out.copy_(target)


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
            num_cand,
            hidden.shape[1],
            HAS_BIAS=bias is not None,
            BLOCK_K=block_k,
            BLOCK_H=block_h,
            num_warps=_num_warps(block_k * block_h),
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
                num_cand,
                hidden_size,
                BLOCK_K=block_k,
                BLOCK_H=block_h,
                num_warps=_num_warps(block_k * block_h),
            )
        if with_weight or with_bias:
            order, run_tokens, run_offsets = runs
            block = min(triton.next_power_of_2(max(hidden_size, 1)), 1024)
            col_blocks = triton.cdiv(hidden_size, block) if with_weight else 1  # db alone: one block
            _candidate_dot_weight_grad_kernel[(run_tokens.numel(), max(col_blocks, 1))](
                grad,
                hidden,
                order,
                run_offsets,
                run_tokens,
                dweight if with_weight else grad,  # placeholder pointers when not requested
                dbias if with_bias else grad,
                hidden.stride(0),
                num_cand,
                hidden_size,
                HAS_WEIGHT=with_weight,
                HAS_BIAS=with_bias,
                BLOCK_H=block,
                num_warps=_num_warps(block),
            )
    return dhidden, dweight, dbias
