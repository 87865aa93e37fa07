"""Triton kept-set ops (sampling-mask replay, and token-level TPO's candidates as kept sets of K
pairs per row): the gather and scatter of the logits path, the fused head's ragged dot products and
their gradients (without forming ``[M, V]`` or gathering ``[P, H]``), the ragged row ops.

With ``kept`` a CSR of (row, id) pairs (:class:`~tpo_kernels.backends.kept_sets.KeptSets`)::

    gather    z[p]  = logits[r, ids[p]]                     for the pairs p of row r
    scatter   out[r, :] = 0;  out[r, v] = sum of g[p] over the pairs p of row r with ids[p] == v
    forward   z[p]  = h[r] . W[ids[p]] + b[ids[p]]
    dH[r]     = sum over the pairs p of row r of g[p] W[ids[p]]
    dW, db    : per token, the sorted runs of :func:`tpo_kernels.group_math.pair_runs` (the
                candidate ops' segmented sums, :mod:`.candidate_weight_grad`, with each pair's
                row read from the record's ``rows``)

The scatter zero-fills ``out`` (one fill, any strides), then lane p of a row's program sums
``g[q]`` over the row's pairs q with ``ids[q] == ids[p]`` in ascending q (n * n work for a row of n
pairs, independent of V) and only the first lane holding an id stores it, cast to the output dtype
once: duplicates (candidates drawn with replacement) sum in ascending order, bit for bit like the
PyTorch default (on CPU the Triton interpreter's cast to bf16 / fp16 may round the last bit
differently), and no two lanes write one element.

One program per row on a 1-D grid walks its pairs ``offsets[r] .. offsets[r + 1]`` in blocks of
``BLOCK_K = 16`` (a set of 2048 ids is 128 trips), the hidden dimension in ``BLOCK_H`` columns. A
row's sums depend on its own pairs only: batch-invariant, no atomics. Ids: a negative id is a hole
(``-inf``, adds nothing to dH, never written); an id ``>= V`` gives NaN and is never dereferenced.
The ragged row ops (the row-op contract over row ``r = z[offsets[r]:offsets[r + 1]]``, label at
``label_slot[r]``) are one program per row too: a max pass and a sum pass over the row's pairs in
blocks of ``BLOCK_ROW`` lanes (each lane's partial sums in pair order, the lanes combined by
``tl.sum``'s fixed tree), the label's mass summed apart, ``1 - p`` of the label as
``-expm1(lp)`` in the backward.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..kept_sets import KeptSets
from ..rows import RowSummary, compute_dtype
from .candidate_weight_grad import num_warps, weight_grad
from .kernel_support import device_guard, expm1, log1p, use_libdevice

BLOCK_K = 16
BLOCK_ROW = 64


@triton.jit
def _kept_gather_kernel(logits_ptr, ids_ptr, offsets_ptr, out_ptr, row_stride, rows_per_batch, batch_stride, vocab,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + (row // rows_per_batch) * batch_stride + (row % rows_per_batch) * row_stride
    lanes = tl.arange(0, BLOCK)
    start = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    for block in range(start, end, BLOCK):
        p = block + lanes
        in_row = p < end
        ids = tl.load(ids_ptr + p, mask=in_row, other=-1)
        in_vocab = in_row & (ids >= 0) & (ids < vocab)
        z = tl.load(base + ids, mask=in_vocab, other=0.0).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + p, tl.where(ids < 0, float("-inf"), tl.where(in_vocab, z, float("nan"))), mask=in_row)


@triton.jit
def _kept_scatter_kernel(grad_ptr, ids_ptr, offsets_ptr, out_ptr, row_stride, col_stride, rows_per_batch,
                         batch_stride, vocab, BLOCK: tl.constexpr):
    # ``out`` is already zero (module docstring: n * n work per row, the first lane of an id stores).
    row = tl.program_id(0).to(tl.int64)
    base = out_ptr + (row // rows_per_batch) * batch_stride + (row % rows_per_batch) * row_stride
    lanes = tl.arange(0, BLOCK)
    start = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    for block in range(start, end, BLOCK):
        p = block + lanes
        ids = tl.load(ids_ptr + p, mask=p < end, other=-1)
        acc = tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty)
        first = (p < end) & (ids >= 0) & (ids < vocab)  # holes and ids outside [0, vocab): never written
        for q in range(start, end):
            same = ids == tl.load(ids_ptr + q)
            acc = tl.where(same, acc + tl.load(grad_ptr + q), acc)
            first = first & ~(same & (q < p))
        tl.store(base + ids * col_stride, acc.to(out_ptr.dtype.element_ty), mask=first)


@triton.jit
def pair_dots(h_row, weight_ptr, bias_ptr, out_ptr, ids, in_vocab, weight_row_stride, hidden_size,
              HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """``h_row . W[ids[k]] (+ b[ids[k]])`` for a block of ``BLOCK_K`` ids, in ``out_ptr``'s dtype,
    the hidden dimension in ``BLOCK_H`` columns; 0 where not ``in_vocab`` (never dereferenced)."""
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
def _kept_dot_kernel(hidden_ptr, weight_ptr, bias_ptr, ids_ptr, offsets_ptr, out_ptr, hidden_row_stride,
                     weight_row_stride, vocab, hidden_size, HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_K)
    h_row = hidden_ptr + row * hidden_row_stride
    start = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    for k_start in range(start, end, BLOCK_K):
        p = k_start + lanes
        in_k = p < end
        ids = tl.load(ids_ptr + p, mask=in_k, other=-1)
        in_vocab = in_k & (ids >= 0) & (ids < vocab)
        dot = pair_dots(h_row, weight_ptr, bias_ptr, out_ptr, ids, in_vocab, weight_row_stride, hidden_size,
                        HAS_BIAS, BLOCK_K, BLOCK_H)
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


@triton.jit
def _ragged_forward_kernel(z_ptr, offsets_ptr, slot_ptr, scale_ptr, row_max_ptr, log_sum_ptr, logprob_ptr, entropy_ptr,
                           WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr, ACCURATE_MATH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc_ty = row_max_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + row)
    if slot == -1:  # the row does not count: outputs 0, never read
        zero = tl.full([], 0.0, acc_ty)
        tl.store(row_max_ptr + row, zero)
        tl.store(log_sum_ptr + row, zero)
        tl.store(logprob_ptr + row, zero)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, zero)
    else:
        it = tl.load(scale_ptr)
        lanes = tl.arange(0, BLOCK)
        start = tl.load(offsets_ptr + row)
        end = tl.load(offsets_ptr + row + 1)
        lane_max = tl.full([BLOCK], float("-inf"), acc_ty)
        for block in range(start, end, BLOCK):
            p = block + lanes
            lane_max = tl.maximum(lane_max, tl.load(z_ptr + p, mask=p < end, other=float("-inf")))
        row_max = tl.max(lane_max, axis=0)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)
        lane_rest = tl.zeros([BLOCK], acc_ty)
        lane_t = tl.zeros([BLOCK], acc_ty)
        for block in range(start, end, BLOCK):
            p = block + lanes
            d = (tl.load(z_ptr + p, mask=p < end, other=float("-inf")) - shift) * it
            e = tl.exp(d)
            lane_rest += tl.where(p == slot, 0.0, e)  # the label's mass is added apart
            if WITH_ENTROPY:
                lane_t += tl.where(e == 0, 0.0, e * d)  # 0 log 0 = 0 at -inf (holes)
        rest = tl.sum(lane_rest, axis=0)
        has_label = slot >= 0
        d_y = (tl.load(z_ptr + tl.maximum(slot, 0), mask=has_label, other=0.0) - shift) * it
        e_y = tl.where(has_label, tl.exp(d_y), 0.0)
        total = rest + e_y
        log_sum = tl.log(total)
        confident = -log1p(rest / tl.where(e_y > 0, e_y, 1.0), ACCURATE_MATH)
        logprob = tl.where(rest < e_y, confident, d_y - log_sum)
        empty = row_max == float("-inf")
        tl.store(row_max_ptr + row, row_max)
        tl.store(log_sum_ptr + row, log_sum)
        tl.store(logprob_ptr + row, tl.where(has_label & ~empty, logprob, float("nan")))
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, tl.where(empty, float("nan"), log_sum - tl.sum(lane_t, axis=0) / total))


@triton.jit
def _ragged_backward_kernel(z_ptr, ids_ptr, offsets_ptr, slot_ptr, scale_ptr, row_max_ptr, log_sum_ptr, logprob_ptr,
                            entropy_ptr, g_ptr, ge_ptr, out_ptr, HAS_GE: tl.constexpr, BLOCK: tl.constexpr,
                            ACCURATE_MATH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    it = tl.load(scale_ptr)
    lanes = tl.arange(0, BLOCK)
    start = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    slot = tl.load(slot_ptr + row)
    g = tl.load(g_ptr + row)
    row_max = tl.load(row_max_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    lp = tl.load(logprob_ptr + row)
    label_term = -g * expm1(lp, ACCURATE_MATH)
    silent = (g == 0).to(tl.int32)  # 1: the row is written as zeros (int flags: scalar | vector bools)
    if HAS_GE:
        ge = tl.load(ge_ptr + row)
        ent = tl.where(ge != 0, tl.load(entropy_ptr + row), 0.0)
        label_term -= ge * tl.exp(lp) * (lp + ent)
        silent = silent * (ge == 0).to(tl.int32)
    silent = tl.maximum(silent, (slot == -1).to(tl.int32))
    for block in range(start, end, BLOCK):
        p = block + lanes
        in_row = p < end
        log_p = (tl.load(z_ptr + p, mask=in_row, other=float("-inf")) - row_max) * it - log_sum
        prob = tl.exp(log_p)
        dz = -g * prob
        if HAS_GE:
            dz -= ge * tl.where(prob == 0, 0.0, prob * (log_p + ent))
        dz = tl.where(p == slot, label_term, dz) * it
        hole = (tl.load(ids_ptr + p, mask=in_row, other=-1) < 0).to(tl.int32)
        tl.store(out_ptr + p, tl.where(silent + hole > 0, 0.0, dz), mask=in_row)


def _scale(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.full((1,), value, dtype=dtype, device=device)  # exact in float64; no host-to-device copy


def _batch_layout(t: Tensor) -> Tuple[int, int, int]:
    """``(row_stride, rows_per_batch, batch_stride)`` of ``[M, V]`` or a ``[B, T, V]`` view: row
    ``b T + t`` starts at ``b batch_stride + t row_stride``."""
    if t.dim() == 2:
        return t.stride(0), max(t.shape[0], 1), 0
    return t.stride(1), max(t.shape[1], 1), t.stride(0)


def kept_gather(logits: Tensor, kept: KeptSets) -> Tensor:
    """``[P]`` raw ``logits[row, id]`` in the compute dtype from ``[M, V]`` or a ``[B, T, V]`` view
    (read in place; hole: ``-inf``, id ``>= V``: NaN)."""
    out = torch.empty(kept.num_pairs, dtype=compute_dtype(logits.dtype), device=logits.device)
    if kept.num_rows == 0 or kept.num_pairs == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    with device_guard(logits):
        _kept_gather_kernel[(kept.num_rows,)](
            logits, kept.ids.contiguous(), kept.offsets.contiguous(), out, *_batch_layout(logits), logits.shape[-1],
            BLOCK=BLOCK_K, num_warps=1,
        )
    return out


def kept_scatter(grad: Tensor, kept: KeptSets, *, out: Tensor) -> None:
    """``out`` (``[M, V]`` or ``[B, T, V]``, any strides) becomes zero except ``out[row, id]``, the
    sum of that row's pairs in ascending order in ``grad``'s dtype, cast to ``out``'s once."""
    out.zero_()
    if kept.num_rows == 0 or kept.num_pairs == 0:
        return
    row_stride, rows_per_batch, batch_stride = _batch_layout(out)
    with device_guard(out):
        _kept_scatter_kernel[(kept.num_rows,)](
            grad.contiguous(), kept.ids.contiguous(), kept.offsets.contiguous(), out, row_stride, out.stride(-1),
            rows_per_batch, batch_stride, out.shape[-1], BLOCK=BLOCK_K, num_warps=1,
        )


def ragged_row_forward(kept_logits: Tensor, kept: KeptSets, *, inv_temperature: float,
                       with_entropy: bool) -> RowSummary:
    """The row-op contract over the ragged rows of ``kept_logits`` [P] (raw, compute dtype)."""
    z = kept_logits.contiguous()
    rows = kept.num_rows
    row_max, log_sum, logprob = (torch.empty(rows, dtype=z.dtype, device=z.device) for _ in range(3))
    entropy = torch.empty(rows, dtype=z.dtype, device=z.device) if with_entropy else None
    if rows:
        with device_guard(z):
            _ragged_forward_kernel[(rows,)](
                z, kept.offsets.contiguous(), kept.label_slot.contiguous(), _scale(inv_temperature, z.dtype, z.device),
                row_max, log_sum, logprob, entropy if with_entropy else row_max, WITH_ENTROPY=with_entropy,
                BLOCK=BLOCK_ROW, ACCURATE_MATH=use_libdevice(), num_warps=2,
            )
    return RowSummary(row_max=row_max, log_sum=log_sum, label_logprob=logprob, entropy=entropy,
                      has_label=kept.label_slot >= 0)


def ragged_row_backward(kept_logits: Tensor, kept: KeptSets, summary: RowSummary, grad_logprob: Tensor, *,
                        grad_entropy: Optional[Tensor] = None, inv_temperature: float, out: Tensor) -> None:
    """``out [P]``: the row-op backward over the ragged rows (0 on holes and rows that do not count)."""
    z = kept_logits.contiguous()
    rows = kept.num_rows
    if rows == 0 or z.numel() == 0:
        return
    target = out if out.is_contiguous() and out.dtype == z.dtype else torch.empty_like(z)
    acc = z.dtype

    def per_row(t: Tensor) -> Tensor:
        return t.to(acc).contiguous()

    has_ge = grad_entropy is not None
    with device_guard(z):
        _ragged_backward_kernel[(rows,)](
            z, kept.ids.contiguous(), kept.offsets.contiguous(), kept.label_slot.contiguous(),
            _scale(inv_temperature, acc, z.device), per_row(summary.row_max), per_row(summary.log_sum),
            per_row(summary.label_logprob), per_row(summary.entropy) if has_ge else z, per_row(grad_logprob),
            per_row(grad_entropy) if has_ge else z, target, HAS_GE=has_ge, BLOCK=BLOCK_ROW,
            ACCURATE_MATH=use_libdevice(), num_warps=2,
        )
    if target is not out:
        out.copy_(target)


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
                # 4 warps, not num_warps' 8 for the [16, 256] tile: its column sums spilled 8 bytes on
                # sm_80 in fp32 under Triton 3.6 (the GPU machine's) with 8.
                hidden_size, BLOCK_K=BLOCK_K, BLOCK_H=block_h, num_warps=min(4, num_warps(BLOCK_K * block_h)),
            )
        if with_weight or with_bias:
            weight_grad(grad, hidden, kept.ids.contiguous(), kept.rows.contiguous(), runs, dweight, dbias, vocab)
    return dhidden, dweight, dbias


__all__ = ["kept_gather", "kept_linear_backward", "kept_linear_forward", "kept_scatter", "ragged_row_backward",
           "ragged_row_forward"]
