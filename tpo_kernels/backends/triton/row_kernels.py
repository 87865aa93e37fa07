"""Triton row ops (layer 1): per-row statistics, label log-prob and entropy, and the row backward.

One program per row of the ``[M, V]`` logits on a 1-D grid (grid dim 0 takes up to 2**31 - 1
programs), or of a ``[B, T, V]`` view whose rows do not flatten into one row stride (``logits[:,
:-1]``): program ``r = b * T + t`` reads the row at ``b * batch_stride + t * row_stride``
(``row_offset``), so the batch is one launch each way, read (and written) in place. Row offsets
are int64 because ``row * stride`` can exceed 2**31; columns are int32. Each program walks the
vocabulary in ``BLOCK_V`` chunks; the math runs in fp32 registers (fp64 for fp64 logits).

Memory access. A row starts 16-byte aligned only when ``stride * element size`` is a multiple of
16 (not for V = 50257 or 32001), and a view's first element only when its start is (not for
``logits[:, :-1]``'s entries or ``logits[:, 1:]`` with such a V). The kernels receive an aligned
base, the view's start rounded down to 16 bytes, and add the remainder to every row offset
(``aligned_base``), so that Triton knows the base is aligned whatever the view's start; a
program reads its row in sections (``row_sections``): the columns before the first aligned one
and the last ``< VEC`` columns as one small masked tile, then whole chunks from the aligned
column with no mask, then one chunk whose mask is constant over ``VEC`` columns. With
``tl.multiple_of`` on the aligned offset every chunk is read (and the backward written) with
16-byte vector accesses whatever V is. A chunk is a ``thread_tile`` (each thread its own
vectors): the forward keeps a running max and sums per thread, reduced within the thread (no
shuffle, no barrier per chunk) and merged once per row. The body chunk holding the label is read
apart (``label_chunk``): no other chunk tests its columns against the label.

Forward, per row with raw logits ``z``, label ``y`` and ``d = (z - m) * inv_t`` relative to a
running raw max ``m`` (online, one read of the row; each thread over its columns, then merged)::

    s = sum_{v != y} exp(d_v);   t = sum_{v != y} exp(d_v) * d_v
    when a chunk raises the max, both are rescaled: with delta = (m - m') * inv_t,
    s <- exp(delta) s,  t <- exp(delta) (t + delta s)     (also how the threads merge)
    then the label: e_y = exp(d_y), log_sum = log(s + e_y),
    log p_y = -log1p(s / e_y) if s < e_y else d_y - log_sum,
    entropy = log_sum - (t + e_y d_y) / (s + e_y)

Summing the label apart keeps ``1 - p_y`` accurate for confident tokens; ``z - m`` before the
scale and ``(m, log_sum)`` kept apart keep log-probs accurate for logits with a large common
offset; ``t`` relative to the max keeps the entropy free of cancellation (see csrc/row_math.h,
the same math). The per-element terms use base 2 (``d * log2(e)`` from one pre-multiplied scale,
``exp2``; on the GPU ``exp`` is ``exp2`` after a multiply, so this saves one multiply per element);
the scalars of each row are in natural units. Compiled, fp32 ``exp2`` is ``ex2.approx.ftz``:
terms and probabilities below 2**-126 become 0 (an absolute error under 1.2e-38 times the
row's gradient scale; such terms are below the fp32 rounding of the sums). A NaN or +inf logit
reaches the sums as NaN (no per-element flags), so the row's log_sum, log-prob and entropy are
NaN.

Ids (the contract of DESIGN.md, "Ids outside the vocabulary"): ``V`` is the view's width, not its
row stride. The forward reads a row only for a label in ``[0, V)``; a negative label gives 0 (an
ignored row), a label ``>= V`` gives NaN for all of the row's outputs. The backward never
dereferences a label: one outside ``[0, V)`` adds no one-hot term.

Backward, per row with ``log p = (z - m) * inv_t - log_sum``::

    out_v = inv_t * (g * (onehot_v - p_v) - ge * p_v * (log p_v + entropy))
          = p_v * (coef + coef_log * log2 p_v)          (v != y, two per-row constants)

where the label's entry takes ``log p_y`` from the forward and ``1 - p_y = -expm1(log p_y)``.
Rows with ``g == 0`` and ``ge == 0`` are zero-filled without reading the logits. Every chunk is
loaded before it is stored by the same program, so ``out`` may alias ``logits``.

``log1p`` / ``expm1``, the fp32 parts of a float argument (``split_scalar``) and the device guard
are shared with the other kernels (:mod:`.kernel_support`).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..rows import gradient_buffer
from ..rows import RowSummary, compute_dtype
from .kernel_support import device_guard, expm1, log1p, scalar_from_parts, split_scalar, use_libdevice
from .row_layout import (acc_type, aligned_base, batch_layout, chunk_geometry, chunk_threads, edge_tile, label_chunk,
                         load_chunk, pick_num_warps, row_batch, row_offset, row_sections, thread_max, thread_sum,
                         thread_tile)


# Base-2 units: the kernels scale by inv_t * log2(e) once and call exp2, which saves the multiply
# by log2(e) that exp adds per element; sums and logs return to natural units once per row.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# p * max(log p, -BIG) is 0 where p == 0 (log p = -inf): one max instead of a compare and select.
BIG = tl.constexpr(3.0e38)


@triton.jit
def _absorb_chunk(z, is_label, run_max, run_sum, run_t, scale2, WITH_ENTROPY: tl.constexpr):
    """One online step of every thread over its columns of a chunk ``z`` (-inf in masked lanes):
    the thread's running max and its sums of ``e = 2^d`` and ``e d``, ``d = (z - max) * scale2``,
    leaving out the label where ``is_label`` (None: the chunk has no label; the max includes it)."""
    new_max = tl.maximum(run_max, thread_max(z))
    # Shift by 0 while every logit seen is -inf, so nothing computes (-inf) - (-inf).
    shift = tl.where(new_max == float("-inf"), 0.0, new_max).to(z.dtype)
    delta = (run_max - shift) * scale2  # <= 0; -inf while nothing was seen
    rescale = tl.exp2(delta)  # one exp per thread and chunk
    d = (z - shift) * scale2
    e = tl.exp2(d)
    if is_label is not None:
        e = tl.where(is_label, 0.0, e)  # the label's mass is added apart
    if WITH_ENTROPY:
        # t relative to the new max: 2^delta (t + delta s). A lane with e == 0 (masked, -inf
        # logit, the label) adds 0, never 0 * -inf; a NaN logit makes e, so s and t, NaN.
        run_t = rescale * (run_t + tl.where(rescale > 0, delta, 0.0) * run_sum)
        run_t += thread_sum(e * tl.maximum(d, -BIG))
    run_sum = run_sum * rescale + thread_sum(e)
    return new_max, run_sum, run_t


# rows_per_batch only divides the row index (row_offset) and the base offsets (aligned_base) only shift it: no
# specialization on their values, so any T and any start compile once (they say nothing about alignment).
@triton.jit(do_not_specialize=["base_offset", "rows_per_batch"])
def _row_forward_kernel(
    logits_ptr,
    labels_ptr,
    row_max_ptr,
    log_sum_ptr,
    logprob_ptr,
    entropy_ptr,
    base_offset,
    rows_per_batch,
    batch_stride,
    row_stride,
    vocab,
    inv_t_hi,
    inv_t_mid,
    inv_t_lo,
    WITH_ENTROPY: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
    VEC: tl.constexpr,
    THREADS: tl.constexpr,
    ACCURATE_MATH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label_id = tl.load(labels_ptr + row)
    # Ids are checked here, where memory is touched (validate=False passes them unchecked): only
    # a label in [0, vocab) reads the row; see the else branch for the others.
    if (label_id >= 0) & (label_id < vocab):
        label = label_id.to(tl.int32)  # in [0, vocab), vocab < 2**31: int32 column compares
        row_start = base_offset + row_offset(row, rows_per_batch, batch_stride, row_stride)
        row_ptr = logits_ptr + row_start
        # The label's logit first: its load overlaps the row's stream (not a dependent load at the end).
        z_label = tl.load(row_ptr + label).to(ACC)
        head, body_len, vec_len = row_sections(row_start, vocab, VEC, BLOCK_V)
        scale = scalar_from_parts(inv_t_hi, inv_t_mid, inv_t_lo, ACC)
        scale2 = scale * tl.full([], LOG2E, ACC)
        # The edges seed thread 0's state ([1, THREADS, 1]: one max and two sums per thread).
        edge_cols, edge_mask = edge_tile(head, head + vec_len, vocab, VEC)
        edge_z = tl.load(row_ptr + edge_cols, mask=edge_mask, other=float("-inf")).to(ACC)
        nothing = tl.full([1, 1, 1], float("-inf"), ACC)
        edge_max, edge_sum, edge_t = _absorb_chunk(edge_z[:, None, :], (edge_cols == label)[:, None, :], nothing,
                                                   tl.zeros_like(nothing), tl.zeros_like(nothing), scale2,
                                                   WITH_ENTROPY)
        first = tl.arange(0, THREADS)[None, :, None] == 0
        run_max = tl.where(first, edge_max, float("-inf"))
        run_sum = tl.where(first, edge_sum, 0.0)
        run_t = tl.where(first, edge_t, 0.0)
        # The body, the label's chunk (if any) apart (label_chunk).
        cols = thread_tile(BLOCK_V, VEC, THREADS)
        label_col = label - head  # from the body's start; negative in the head
        label_off = label_chunk(label_col, body_len, BLOCK_V)
        body_ptr = logits_ptr + tl.multiple_of(row_start + head, VEC)
        for off in range(0, label_off, BLOCK_V):
            z = load_chunk(body_ptr + off, cols, ACC, BLOCK_V, VEC, THREADS)
            run_max, run_sum, run_t = _absorb_chunk(z, None, run_max, run_sum, run_t, scale2, WITH_ENTROPY)
        if label_off < body_len:
            z = load_chunk(body_ptr + label_off, cols, ACC, BLOCK_V, VEC, THREADS)
            run_max, run_sum, run_t = _absorb_chunk(z, cols == label_col - label_off, run_max, run_sum, run_t,
                                                    scale2, WITH_ENTROPY)
        for off in range(label_off + BLOCK_V, body_len, BLOCK_V):
            z = load_chunk(body_ptr + off, cols, ACC, BLOCK_V, VEC, THREADS)
            run_max, run_sum, run_t = _absorb_chunk(z, None, run_max, run_sum, run_t, scale2, WITH_ENTROPY)
        tail = body_len + cols
        z = tl.load(body_ptr + tail, mask=tail < vec_len, other=float("-inf")).to(ACC)
        run_max, run_sum, run_t = _absorb_chunk(z, tail == label_col, run_max, run_sum, run_t, scale2, WITH_ENTROPY)
        # The threads' states merged once: each sum rescaled from its thread's max to the row's.
        row_max = tl.max(run_max, axis=None)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max).to(ACC)
        delta = (run_max - shift) * scale2
        rescale = tl.exp2(delta)
        rest = tl.sum(run_sum * rescale, axis=None)
        d_y = (z_label - shift) * scale  # natural units from here on
        e_y = tl.exp(d_y)
        total = rest + e_y
        log_sum = tl.log(total)
        # log(e_y / (e_y + rest)): -log1p(rest / e_y) keeps 1 - p_y accurate when the label dominates.
        confident = -log1p(rest / tl.where(e_y > 0, e_y, 1.0), ACCURATE_MATH)
        tl.store(row_max_ptr + row, row_max)
        tl.store(log_sum_ptr + row, log_sum)
        tl.store(logprob_ptr + row, tl.where(rest < e_y, confident, d_y - log_sum))
        if WITH_ENTROPY:
            t2 = tl.sum(rescale * (run_t + tl.where(rescale > 0, delta, 0.0) * run_sum), axis=None)
            t = t2 * tl.full([], LN2, ACC) + tl.where(e_y > 0, e_y * d_y, 0.0)
            tl.store(entropy_ptr + row, log_sum - t / total)
    else:
        # The row is never read. A negative label (ignored row) gives 0; a label >= vocab (out of
        # the vocabulary, e.g. a padding id equal to V) gives NaN, as the CUDA kernel does.
        value = tl.where(label_id < 0, 0.0, float("nan")).to(ACC)
        tl.store(row_max_ptr + row, value)
        tl.store(log_sum_ptr + row, value)
        tl.store(logprob_ptr + row, value)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, value)


@triton.jit
def _chunk_grad(in_ptr, out_ptr, cols, mask, is_label, row_max, log_sum2, scale2, coef, coef_log, label_grad,
                ACTIVE: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, ACC: tl.constexpr, BLOCK_V: tl.constexpr,
                VEC: tl.constexpr, THREADS: tl.constexpr):
    """Store the row gradient at columns ``cols`` from ``out_ptr`` (a ``thread_tile`` when ``mask``
    is None: a body chunk); the label's entry where ``is_label`` (None: not in these columns);
    zeros when not ACTIVE, without reading the logits."""
    if ACTIVE:
        if mask is None:
            x = load_chunk(in_ptr, cols, ACC, BLOCK_V, VEC, THREADS)
        else:  # masked lanes read as the max: finite p, no overflow in lanes never stored
            x = tl.load(in_ptr + cols, mask=mask, other=row_max).to(ACC)
        log_p2 = (x - row_max) * scale2 - log_sum2  # log2 p
        p = tl.exp2(log_p2)
        if HAS_ENTROPY_GRAD:
            grad = p * (coef + coef_log * tl.maximum(log_p2, -BIG))
        else:
            grad = p * coef
        if is_label is not None:
            grad = tl.where(is_label, label_grad, grad)
    else:
        grad = tl.zeros(cols.shape, dtype=ACC)
    tl.store(out_ptr + cols, grad.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_row_grad(in_row, out_row, in_body, out_body, head, body_len, vec_len, vocab, label, row_max, log_sum2,
                    scale2, coef, coef_log, label_grad, ACTIVE: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
                    ACC: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr, THREADS: tl.constexpr):
    """Walk one row's sections (``row_sections``): edges, the unmasked body (the label's chunk
    apart, as in the forward), the masked tail."""
    edge_cols, edge_mask = edge_tile(head, head + vec_len, vocab, VEC)
    _chunk_grad(in_row, out_row, edge_cols, edge_mask, edge_cols == label, row_max, log_sum2, scale2, coef, coef_log,
                label_grad, ACTIVE, HAS_ENTROPY_GRAD, ACC, BLOCK_V, VEC, THREADS)
    cols = thread_tile(BLOCK_V, VEC, THREADS)
    label_col = label - head
    label_off = label_chunk(label_col, body_len, BLOCK_V)
    for off in range(0, label_off, BLOCK_V):
        _chunk_grad(in_body + off, out_body + off, cols, None, None, row_max, log_sum2, scale2, coef, coef_log,
                    label_grad, ACTIVE, HAS_ENTROPY_GRAD, ACC, BLOCK_V, VEC, THREADS)
    if label_off < body_len:
        _chunk_grad(in_body + label_off, out_body + label_off, cols, None, cols == label_col - label_off, row_max,
                    log_sum2, scale2, coef, coef_log, label_grad, ACTIVE, HAS_ENTROPY_GRAD, ACC, BLOCK_V, VEC, THREADS)
    for off in range(label_off + BLOCK_V, body_len, BLOCK_V):
        _chunk_grad(in_body + off, out_body + off, cols, None, None, row_max, log_sum2, scale2, coef, coef_log,
                    label_grad, ACTIVE, HAS_ENTROPY_GRAD, ACC, BLOCK_V, VEC, THREADS)
    in_tail, tail_label = cols < vec_len - body_len, cols == label_col - body_len
    _chunk_grad(in_body + body_len, out_body + body_len, cols, in_tail, tail_label, row_max, log_sum2, scale2, coef,
                coef_log, label_grad, ACTIVE, HAS_ENTROPY_GRAD, ACC, BLOCK_V, VEC, THREADS)


# rows_per_batch only divides the row index (row_offset) and the base offsets (aligned_base) only shift it: no
# specialization on their values, so any T and any start compile once (they say nothing about alignment).
@triton.jit(do_not_specialize=["logits_base_offset", "out_base_offset", "rows_per_batch"])
def _row_backward_kernel(
    logits_ptr,
    out_ptr,
    labels_ptr,
    row_max_ptr,
    log_sum_ptr,
    logprob_ptr,
    grad_ptr,
    grad_entropy_ptr,
    entropy_ptr,
    logits_base_offset,
    out_base_offset,
    rows_per_batch,
    logits_batch_stride,
    logits_row_stride,
    out_batch_stride,
    out_row_stride,
    vocab,
    inv_t_hi,
    inv_t_mid,
    inv_t_lo,
    HAS_ENTROPY_GRAD: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
    VEC: tl.constexpr,
    THREADS: tl.constexpr,
    OUT_ALIGNED: tl.constexpr,
    ACCURATE_MATH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.load(grad_ptr + row).to(ACC)
    if HAS_ENTROPY_GRAD:
        ge = tl.load(grad_entropy_ptr + row).to(ACC)
        active = (g != 0) | (ge != 0)
    else:
        active = g != 0
    in_start = logits_base_offset + row_offset(row, rows_per_batch, logits_batch_stride, logits_row_stride)
    out_start = out_base_offset + row_offset(row, rows_per_batch, out_batch_stride, out_row_stride)
    head, body_len, vec_len = row_sections(in_start, vocab, VEC, BLOCK_V)
    in_body = logits_ptr + tl.multiple_of(in_start + head, VEC)
    if OUT_ALIGNED:  # out's rows start at the logits' rows' offset modulo VEC
        out_body = out_ptr + tl.multiple_of(out_start + head, VEC)
    else:
        out_body = out_ptr + (out_start + head)
    if active:
        scale = scalar_from_parts(inv_t_hi, inv_t_mid, inv_t_lo, ACC)
        row_max = tl.load(row_max_ptr + row).to(ACC)
        log_sum = tl.load(log_sum_ptr + row).to(ACC)
        # -1: no one-hot term, for a negative label and for one outside [0, vocab) (a label >= vocab
        # is never dereferenced; the int64 test comes before the int32 cast, which would wrap).
        label_id = tl.load(labels_ptr + row)
        label = tl.where((label_id >= 0) & (label_id < vocab), label_id, -1).to(tl.int32)
        lp = tl.load(logprob_ptr + row).to(ACC)
        # The label's entry: g (1 - p_y) = -g expm1(log p_y), accurate for confident tokens.
        label_grad = -g * expm1(lp, ACCURATE_MATH)
        # The others: inv_t (-g p - ge p (log p + H)) = p (coef + coef_log log2 p).
        coef = -g * scale
        coef_log = coef  # unused without an entropy gradient
        if HAS_ENTROPY_GRAD:
            entropy = tl.load(entropy_ptr + row).to(ACC)
            p_y = tl.exp(lp)
            label_grad = label_grad - ge * p_y * (tl.where(p_y > 0, lp, -entropy) + entropy)
            coef = -(g + ge * entropy) * scale
            coef_log = -ge * scale * tl.full([], LN2, ACC)
        log2e = tl.full([], LOG2E, ACC)
        _store_row_grad(logits_ptr + in_start, out_ptr + out_start, in_body, out_body, head, body_len, vec_len,
                        vocab, label, row_max, log_sum * log2e, scale * log2e, coef, coef_log, label_grad * scale,
                        True, HAS_ENTROPY_GRAD, ACC, BLOCK_V, VEC, THREADS)
    else:
        # Zero-signal row: write zeros, never touch the logits.
        zero = tl.full([], 0.0, ACC)
        _store_row_grad(logits_ptr + in_start, out_ptr + out_start, in_body, out_body, head, body_len, vec_len, vocab,
                        -1, zero, zero, zero, zero, zero, zero, False, HAS_ENTROPY_GRAD, ACC, BLOCK_V, VEC, THREADS)


def row_forward(
    logits: Tensor,
    labels: Tensor,
    *,
    inv_temperature: float,
    with_entropy: bool,
    block_v: Optional[int] = None,
) -> RowSummary:
    """The :class:`RowSummary` of every row (see the backends contract) of ``[M, V]`` logits or
    of a ``[B, T, V]`` view (``M = B T``, one launch)."""
    rows, vocab = logits.shape[:-1].numel(), logits.shape[-1]
    acc = compute_dtype(logits.dtype)
    # Separate tensors, not views of one: a custom op's outputs may not alias each other.
    row_max, log_sum = (torch.empty(rows, dtype=acc, device=logits.device) for _ in range(2))
    logprob = torch.empty(rows, dtype=acc, device=logits.device)
    entropy = torch.empty(rows, dtype=acc, device=logits.device) if with_entropy else None
    labels = labels.reshape(-1).contiguous()
    summary = RowSummary(row_max=row_max, log_sum=log_sum, label_logprob=logprob, entropy=entropy,
                         has_label=(labels >= 0) & (labels < vocab))
    if rows == 0:
        return summary
    logits = row_batch(logits)
    block, vec = chunk_geometry(logits, block_v)
    base, base_offset = aligned_base(logits, vec)
    with device_guard(logits):
        _row_forward_kernel[(rows,)](
            base,
            labels,
            summary.row_max,
            summary.log_sum,
            summary.label_logprob,
            entropy if with_entropy else logprob,  # placeholder pointer, unused without entropy
            base_offset,
            *batch_layout(logits),
            vocab,
            *split_scalar(inv_temperature),
            WITH_ENTROPY=bool(with_entropy),
            ACC=acc_type(logits.dtype),
            BLOCK_V=block,
            VEC=vec,
            THREADS=chunk_threads(block, vec),
            ACCURATE_MATH=use_libdevice(),
            num_warps=pick_num_warps(block),
        )
    return summary


def row_backward(
    logits: Tensor,
    labels: Tensor,
    summary: RowSummary,
    grad_logprob: Tensor,
    *,
    grad_entropy: Optional[Tensor] = None,
    inv_temperature: float,
    out: Tensor,
    block_v: Optional[int] = None,
) -> None:
    """Write the row gradient into ``out`` (may be ``logits`` itself; see backends contract) for
    ``[M, V]`` logits or a ``[B, T, V]`` view (one launch; ``out`` has the logits' shape)."""
    rows, vocab = logits.shape[:-1].numel(), logits.shape[-1]
    if rows == 0:
        return
    if grad_entropy is not None and summary.entropy is None:
        raise ValueError("row_backward: grad_entropy needs the forward's entropy (summary.entropy is None)")
    if out.shape != logits.shape:
        raise ValueError(f"out must have the logits' shape {tuple(logits.shape)}, got {tuple(out.shape)}")
    logits = row_batch(logits)
    target = gradient_buffer(logits, out)  # out itself, or a buffer copied into it (rows that overlap)
    labels = labels.reshape(-1).contiguous()
    row_max, log_sum = summary.row_max.contiguous(), summary.log_sum.contiguous()
    logprob = summary.label_logprob.contiguous()
    grad_logprob = grad_logprob.contiguous()
    has_ge = grad_entropy is not None
    entropy = None
    if has_ge:
        grad_entropy = grad_entropy.contiguous()
        entropy = summary.entropy.contiguous()
    block, vec = chunk_geometry(logits, block_v)
    in_per_batch, in_batch_stride, in_row_stride = batch_layout(logits)
    _, out_batch_stride, out_row_stride = batch_layout(target)
    in_base, in_base_offset = aligned_base(logits, vec)
    out_base, out_base_offset = aligned_base(target, vec)
    with device_guard(logits):
        _row_backward_kernel[(rows,)](
            in_base,
            out_base,
            labels,
            row_max,
            log_sum,
            logprob,
            grad_logprob,
            grad_entropy if has_ge else grad_logprob,  # placeholders, unused without ge
            entropy if has_ge else logprob,
            in_base_offset,
            out_base_offset,
            in_per_batch,
            in_batch_stride,
            in_row_stride,
            out_batch_stride,
            out_row_stride,
            vocab,
            *split_scalar(inv_temperature),
            HAS_ENTROPY_GRAD=has_ge,
            ACC=acc_type(logits.dtype),
            BLOCK_V=block,
            VEC=vec,
            THREADS=chunk_threads(block, vec),
            # out's rows start at the logits' rows' offsets modulo VEC
            OUT_ALIGNED=((out_base_offset - in_base_offset) % vec == 0 and (out_row_stride - in_row_stride) % vec == 0
                         and (out_batch_stride - in_batch_stride) % vec == 0),
            ACCURATE_MATH=use_libdevice(),
            num_warps=pick_num_warps(block),
        )
    if target is not out:
        out.copy_(target)
