"""The weight and bias gradients of the Triton kept-set dot products (the fused head of replay and
of token-level TPO's candidates): for the (row, id) pairs p stably sorted by id
(:func:`tpo_kernels.group_math.pair_runs`; the pairs of token ``v`` form one run),

    dW[v] = sum over the run of v of grad[p] * h[rows[p]],    db[v] = sum over the run of grad[p]

without atomics and in a fixed order. Walking a run pair by pair in one program would make the
most frequent token (a Zipf-like head: "the", ",") the critical path, so the sorted pair list is
cut into segments of ``SEGMENT_PAIRS`` pairs and every piece of a run within a segment is summed
by its own program, in tiles of pairs reduced by a fixed tree:

1. one program per run sums the run's pairs up to the end of the segment it starts in; a run that
   ends there is written to dW / db, else this piece is partial row ``2 s + 1`` (s: the segment),
   and the run is noted as the one crossing the end of segment s;
2. one program per segment s >= 1 sums the pairs of the run that crosses the start of s, within s:
   partial row ``2 s`` (the run's pairs are a prefix of s, since the pairs are sorted);
3. one program per segment sums the partial rows of the run crossing its end, in segment order.

(1) and (2) are independent; each segment holds at most one piece of each kind, so the partials
take ``2 ceil(P / SEGMENT_PAIRS)`` rows of H in the compute dtype. Every sum runs in a fixed
order: results are bitwise reproducible.

Ids: the pairs are addressed by their position (always in range); a run's token id is used only
for the final stores into dW / db, which are masked to ``0 <= token < V`` (``V`` = the weight's
rows): the run of a token outside the vocabulary is summed and dropped, never written.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

SEGMENT_PAIRS = 64  # pairs per segment: the most any program of passes 1 and 2 sums


@triton.jit
def _pair_sum(grad_ptr, hidden_ptr, pair_order_ptr, pair_rows_ptr, start, stop, hidden_row_stride, cols, in_h,
              HAS_WEIGHT: tl.constexpr, PAIR_TILE: tl.constexpr, BLOCK_H: tl.constexpr):
    """``(sum g * h[row], sum g)`` over the sorted pairs ``start <= j < stop``, ``PAIR_TILE``
    pairs at a time (each tile reduced by a fixed tree, the tiles in ascending order); a pair's
    row is ``pair_rows[pair]``."""
    acc_ty = grad_ptr.dtype.element_ty
    lanes = tl.arange(0, PAIR_TILE)
    dw = tl.zeros([BLOCK_H], dtype=acc_ty)
    db = tl.full([], 0.0, acc_ty)
    for tile in range(start, stop, PAIR_TILE):
        j = tile + lanes
        in_j = j < stop
        pair = tl.load(pair_order_ptr + j, mask=in_j, other=0)
        g = tl.load(grad_ptr + pair, mask=in_j, other=0.0)
        if HAS_WEIGHT:
            state = tl.load(pair_rows_ptr + pair, mask=in_j, other=0)
            rows = hidden_ptr + state[:, None] * hidden_row_stride
            h = tl.load(rows + cols[None, :], mask=in_j[:, None] & in_h[None, :], other=0.0).to(acc_ty)
            dw += tl.sum(g[:, None] * h, axis=0)
        db += tl.sum(g, axis=0)
    return dw, db


@triton.jit
def _weight_grad_run_kernel(
    grad_ptr, hidden_ptr, pair_order_ptr, pair_rows_ptr, run_offsets_ptr, run_tokens_ptr, dweight_ptr, dbias_ptr,
    partial_w_ptr, partial_b_ptr, crossing_run_ptr, hidden_row_stride, vocab, hidden_size,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, SEGMENT: tl.constexpr, PAIR_TILE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One program per (run, column block): the run's pairs up to the end of its first segment.
    # A run ending there is final; otherwise this is partial row 2 * segment + 1.
    run = tl.program_id(0)
    block = tl.program_id(1)
    start = tl.load(run_offsets_ptr + run)
    end = tl.load(run_offsets_ptr + run + 1)
    segment = start // SEGMENT
    stop = tl.minimum(end, (segment + 1) * SEGMENT)
    cols = block * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = cols < hidden_size
    dw, db = _pair_sum(grad_ptr, hidden_ptr, pair_order_ptr, pair_rows_ptr, start, stop, hidden_row_stride, cols,
                       in_h, HAS_WEIGHT, PAIR_TILE, BLOCK_H)
    if stop == end:
        token = tl.load(run_tokens_ptr + run)
        if (token >= 0) & (token < vocab):  # a token outside [0, vocab) is never written
            if HAS_WEIGHT:
                tl.store(dweight_ptr + token * hidden_size + cols, dw.to(dweight_ptr.dtype.element_ty), mask=in_h)
            if HAS_BIAS:
                if block == 0:
                    tl.store(dbias_ptr + token, db.to(dbias_ptr.dtype.element_ty))
    else:
        row = 2 * segment + 1
        if HAS_WEIGHT:
            tl.store(partial_w_ptr + row * hidden_size + cols, dw, mask=in_h)
        if block == 0:
            if HAS_BIAS:
                tl.store(partial_b_ptr + row, db)
            tl.store(crossing_run_ptr + segment, run)


@triton.jit
def _weight_grad_segment_kernel(
    grad_ptr, hidden_ptr, ids_ptr, pair_order_ptr, pair_rows_ptr, partial_w_ptr, partial_b_ptr,
    hidden_row_stride, num_pairs, hidden_size, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    SEGMENT: tl.constexpr, PAIR_TILE: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # One program per (segment s >= 1, column block): when the run holding the segment's first
    # pair began in an earlier segment, its pairs in this segment become partial row 2 * s.
    segment = tl.program_id(0).to(tl.int64) + 1
    block = tl.program_id(1)
    start = segment * SEGMENT
    token = tl.load(ids_ptr + tl.load(pair_order_ptr + start))
    if tl.load(ids_ptr + tl.load(pair_order_ptr + start - 1)) == token:
        # Tokens are sorted: the run's pairs are a prefix of the segment.
        j = start + tl.arange(0, SEGMENT)
        in_j = j < num_pairs
        same = tl.load(ids_ptr + tl.load(pair_order_ptr + j, mask=in_j, other=0), mask=in_j, other=-1) == token
        stop = start + tl.sum(same.to(tl.int64), axis=0)
        cols = block * BLOCK_H + tl.arange(0, BLOCK_H)
        in_h = cols < hidden_size
        dw, db = _pair_sum(grad_ptr, hidden_ptr, pair_order_ptr, pair_rows_ptr, start, stop, hidden_row_stride,
                           cols, in_h, HAS_WEIGHT, PAIR_TILE, BLOCK_H)
        if HAS_WEIGHT:
            tl.store(partial_w_ptr + 2 * segment * hidden_size + cols, dw, mask=in_h)
        if HAS_BIAS:
            if block == 0:
                tl.store(partial_b_ptr + 2 * segment, db)


@triton.jit
def _weight_grad_combine_kernel(
    run_offsets_ptr, run_tokens_ptr, crossing_run_ptr, partial_w_ptr, partial_b_ptr, dweight_ptr, dbias_ptr,
    vocab, hidden_size, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, SEGMENT: tl.constexpr,
    ROW_TILE: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # One program per (segment, column block): the run that starts in this segment and crosses
    # its end (if any) sums its partial rows 2 * first + 1, 2 * (first + 1), ..., 2 * last.
    first = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    run = tl.load(crossing_run_ptr + first)
    if run >= 0:
        token = tl.load(run_tokens_ptr + run)
        if (token >= 0) & (token < vocab):  # a token outside [0, vocab) is never written
            last = (tl.load(run_offsets_ptr + run + 1) - 1) // SEGMENT
            cols = block * BLOCK_H + tl.arange(0, BLOCK_H)
            in_h = cols < hidden_size
            lanes = tl.arange(0, ROW_TILE)
            if HAS_WEIGHT:
                dw = tl.load(partial_w_ptr + (2 * first + 1) * hidden_size + cols, mask=in_h, other=0.0)
                for tile in range(first + 1, last + 1, ROW_TILE):
                    s = tile + lanes
                    rows = partial_w_ptr + (2 * s)[:, None] * hidden_size + cols[None, :]
                    dw += tl.sum(tl.load(rows, mask=(s <= last)[:, None] & in_h[None, :], other=0.0), axis=0)
                tl.store(dweight_ptr + token * hidden_size + cols, dw.to(dweight_ptr.dtype.element_ty), mask=in_h)
            if HAS_BIAS:
                if block == 0:
                    db = tl.load(partial_b_ptr + 2 * first + 1)
                    for tile in range(first + 1, last + 1, ROW_TILE):
                        s = tile + lanes
                        db += tl.sum(tl.load(partial_b_ptr + 2 * s, mask=s <= last, other=0.0), axis=0)
                    tl.store(dbias_ptr + token, db.to(dbias_ptr.dtype.element_ty))


def num_warps(tile: int) -> int:
    """Warps for a program working on a register tile of ``tile`` elements."""
    return 8 if tile >= 4096 else 4 if tile >= 1024 else 2 if tile >= 256 else 1


def weight_grad(
    grad: Tensor,
    hidden: Tensor,
    ids: Tensor,
    pair_rows: Tensor,
    runs: Tuple[Tensor, Tensor, Tensor],
    dweight: Optional[Tensor],
    dbias: Optional[Tensor],
    vocab: int,
) -> None:
    """Write the rows of ``dweight`` [V, H] and ``dbias`` [V] that the pairs' ids name (each None
    when not wanted; the other rows are left as they are) for ``grad`` [P] (compute dtype),
    contiguous ``hidden``, ``ids`` [P] and each pair's row ``pair_rows`` [P], ``runs =
    pair_runs(ids)`` and ``vocab`` = the weight's rows (tokens outside ``[0, vocab)`` are not
    written); see the module docstring."""
    order, run_tokens, run_offsets = runs
    num_pairs, num_runs = order.numel(), run_tokens.numel()
    hidden_size = hidden.shape[1]
    with_weight, with_bias = dweight is not None, dbias is not None
    block_h = min(triton.next_power_of_2(max(hidden_size, 1)), 1024)
    col_blocks = triton.cdiv(hidden_size, block_h) if with_weight else 1  # db alone: one block
    tile = min(max(4096 // block_h, 1), SEGMENT_PAIRS) if with_weight else SEGMENT_PAIRS
    num_segments = triton.cdiv(num_pairs, SEGMENT_PAIRS)
    partial_w = grad.new_empty(2 * num_segments, hidden_size) if with_weight and num_segments > 1 else grad
    partial_b = grad.new_empty(2 * num_segments) if with_bias and num_segments > 1 else grad
    crossing_run = torch.full((num_segments,), -1, dtype=torch.int32, device=grad.device)
    dweight = dweight if with_weight else grad  # placeholder pointers when not requested
    dbias = dbias if with_bias else grad
    flags = dict(HAS_WEIGHT=with_weight, SEGMENT=SEGMENT_PAIRS, BLOCK_H=block_h, num_warps=num_warps(tile * block_h))
    _weight_grad_run_kernel[(num_runs, col_blocks)](
        grad, hidden, order, pair_rows, run_offsets, run_tokens, dweight, dbias, partial_w, partial_b, crossing_run,
        hidden.stride(0), vocab, hidden_size, HAS_BIAS=with_bias, PAIR_TILE=tile, **flags,
    )
    if num_segments == 1:
        return  # no run crosses a segment boundary: no partials
    _weight_grad_segment_kernel[(num_segments - 1, col_blocks)](
        grad, hidden, ids, order, pair_rows, partial_w, partial_b, hidden.stride(0), num_pairs, hidden_size,
        HAS_BIAS=with_bias, PAIR_TILE=tile, **flags,
    )
    # The last segment's end is the end of the pairs: no run crosses it.
    _weight_grad_combine_kernel[(num_segments - 1, col_blocks)](
        run_offsets, run_tokens, crossing_run, partial_w, partial_b, dweight, dbias, vocab, hidden_size,
        HAS_BIAS=with_bias, ROW_TILE=tile, **flags,
    )
