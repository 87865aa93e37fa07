"""Triton row ops (layer 1): per-row logsumexp / target logit / entropy, and the row backward.

One program per row of the ``[M, V]`` logits on a 1-D grid (grid dim 0 takes up to 2**31 - 1
programs). Row offsets are int64 because ``row * stride`` can exceed 2**31. Each program walks
the vocabulary in ``BLOCK_V`` chunks; the math runs in fp32 registers (fp64 for fp64 logits).

Forward, per row with tempered logits ``z = x * inv_t`` (online, one read of the row)::

    m   running max;   s = sum_v exp(z_v - m);   w = sum_v exp(z_v - m) * z_v
    when a chunk raises the max to m', both sums are rescaled by exp(m - m')
    (s and w are kept per lane and reduced once at the end)
    lse = m + log(s);  entropy = lse - w / s   (= -sum p log p, since log p = z - lse)

Backward, per row with ``p = exp(z - lse)``::

    out_v = inv_t * (g * (onehot_v - p_v) - ge * p_v * (log p_v + entropy))

Rows with ``g == 0`` and ``ge == 0`` are zero-filled without reading the logits. Every chunk is
loaded before it is stored by the same program, so ``out`` may alias ``logits``.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..._dtypes import compute_dtype
from .. import triton_interpreter_enabled


def split_scalar(value: float) -> Tuple[float, float, float]:
    """Split a Python float into three fp32-exact parts whose sum is ``value`` to ~72 bits.

    Triton types a float kernel argument as fp32 (and the interpreter rounds Python floats to
    fp32), so an fp64 kernel would otherwise see a temperature or eta rounded to 24 bits.
    ``scalar_from_parts`` rebuilds the value in the compute dtype.
    """
    value = float(value)
    hi = float(torch.tensor(value, dtype=torch.float32))
    mid = float(torch.tensor(value - hi, dtype=torch.float32))
    lo = float(torch.tensor(value - hi - mid, dtype=torch.float32))
    return hi, mid, lo


@triton.jit
def scalar_from_parts(hi, mid, lo, ACC: tl.constexpr):
    return tl.cast(hi, ACC) + (tl.cast(mid, ACC) + tl.cast(lo, ACC))


@triton.jit
def _row_forward_kernel(
    logits_ptr,
    labels_ptr,
    lse_ptr,
    target_ptr,
    entropy_ptr,
    row_stride,
    vocab,
    inv_t_hi,
    inv_t_mid,
    inv_t_lo,
    WITH_ENTROPY: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    if label >= 0:
        row_ptr = logits_ptr + row * row_stride
        scale = scalar_from_parts(inv_t_hi, inv_t_mid, inv_t_lo, ACC)
        cols = tl.arange(0, BLOCK_V)
        run_max = tl.full([], float("-inf"), ACC)
        # Per-lane partial sums, reduced once after the loop: the only cross-warp reduction
        # per chunk is the max. lane_sum = exp(z - run_max); lane_wsum = exp(z - run_max) * z.
        lane_sum = tl.zeros([BLOCK_V], dtype=ACC)
        lane_wsum = tl.zeros([BLOCK_V], dtype=ACC)
        for start in range(0, vocab, BLOCK_V):
            idx = start + cols
            z = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf")).to(ACC) * scale
            new_max = tl.maximum(run_max, tl.max(z, axis=0))
            # Shift by 0 while every logit seen is -inf, so exp() never sees (-inf) - (-inf).
            shift = tl.where(new_max == float("-inf"), 0.0, new_max).to(ACC)
            rescale = tl.exp(run_max - shift)  # one scalar exp per chunk
            e = tl.exp(z - shift)
            lane_sum = lane_sum * rescale + e
            if WITH_ENTROPY:
                # e == 0 covers masked lanes and -inf logits; zero their z so e * z is not NaN.
                lane_wsum = lane_wsum * rescale + e * tl.where(e > 0, z, 0.0)
            run_max = new_max
        total = tl.sum(lane_sum, axis=0)
        lse = run_max + tl.log(total)
        target = tl.load(row_ptr + label).to(ACC) * scale
        tl.store(lse_ptr + row, lse)
        tl.store(target_ptr + row, target)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, lse - tl.sum(lane_wsum, axis=0) / total)
    else:
        # Skipped row (ignored label): outputs are 0 and the row is never read.
        tl.store(lse_ptr + row, tl.full([], 0.0, ACC))
        tl.store(target_ptr + row, tl.full([], 0.0, ACC))
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, tl.full([], 0.0, ACC))


@triton.jit
def _row_backward_kernel(
    logits_ptr,
    out_ptr,
    labels_ptr,
    lse_ptr,
    grad_ptr,
    grad_entropy_ptr,
    entropy_ptr,
    logits_row_stride,
    out_row_stride,
    vocab,
    inv_t_hi,
    inv_t_mid,
    inv_t_lo,
    HAS_ENTROPY_GRAD: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.load(grad_ptr + row).to(ACC)
    if HAS_ENTROPY_GRAD:
        ge = tl.load(grad_entropy_ptr + row).to(ACC)
        active = (g != 0) | (ge != 0)
    else:
        active = g != 0
    out_row = out_ptr + row * out_row_stride
    cols = tl.arange(0, BLOCK_V)
    if active:
        in_row = logits_ptr + row * logits_row_stride
        scale = scalar_from_parts(inv_t_hi, inv_t_mid, inv_t_lo, ACC)
        lse = tl.load(lse_ptr + row).to(ACC)
        label = tl.load(labels_ptr + row)  # < 0: no one-hot term (never equals a column)
        if HAS_ENTROPY_GRAD:
            entropy = tl.load(entropy_ptr + row).to(ACC)
        for start in range(0, vocab, BLOCK_V):
            idx = start + cols
            in_vocab = idx < vocab
            x = tl.load(in_row + idx, mask=in_vocab, other=0.0).to(ACC)
            log_p = x * scale - lse
            p = tl.exp(log_p)
            grad = -g * p
            grad = tl.where(idx == label, grad + g, grad)  # g * (onehot - p)
            if HAS_ENTROPY_GRAD:
                # d(-sum p log p)/dz_v = -p_v (log p_v + H)
                grad = grad - ge * p * (log_p + entropy)
            tl.store(out_row + idx, (grad * scale).to(out_ptr.dtype.element_ty), mask=in_vocab)
    else:
        # Zero-signal row: write zeros, never touch the logits.
        zeros = tl.zeros([BLOCK_V], dtype=out_ptr.dtype.element_ty)
        for start in range(0, vocab, BLOCK_V):
            idx = start + cols
            tl.store(out_row + idx, zeros, mask=idx < vocab)


def _acc_type(dtype: torch.dtype):
    return tl.float64 if compute_dtype(dtype) == torch.float64 else tl.float32


def pick_block_v(vocab: int, element_size: int) -> int:
    """Chunk width along V: big enough for wide vector loads and few loop trips, small enough that
    the fp32 (fp64) working set of a chunk stays in registers."""
    if triton_interpreter_enabled():
        cap = 1024  # the interpreter runs each program in numpy; moderate blocks are fastest
    else:
        # 4096 wide at 8 warps: 16 values per thread, no spills (fwd ~40-60, bwd ~64 registers
        # on sm_90), several programs resident per SM to keep loads in flight.
        cap = 2048 if element_size >= 8 else 4096
    return min(triton.next_power_of_2(max(int(vocab), 1)), cap)


def _num_warps(block_v: int) -> int:
    if block_v >= 4096:
        return 8
    if block_v >= 1024:
        return 4
    return 2 if block_v >= 256 else 1


def device_guard(tensor: Tensor):
    # Triton launches on the current CUDA device; make it the tensor's.
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    import contextlib

    return contextlib.nullcontext()


def row_forward(
    logits: Tensor,
    labels: Tensor,
    *,
    inv_temperature: float,
    with_entropy: bool,
    block_v: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(lse, target, entropy | None)`` per row, in the compute dtype (see backends contract)."""
    rows, vocab = logits.shape
    acc = compute_dtype(logits.dtype)
    lse = torch.empty(rows, dtype=acc, device=logits.device)
    target = torch.empty(rows, dtype=acc, device=logits.device)
    entropy = torch.empty(rows, dtype=acc, device=logits.device) if with_entropy else None
    if rows == 0:
        return lse, target, entropy
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    labels = labels.contiguous()
    block = int(block_v) if block_v else pick_block_v(vocab, logits.element_size())
    with device_guard(logits):
        _row_forward_kernel[(rows,)](
            logits,
            labels,
            lse,
            target,
            entropy if with_entropy else lse,  # placeholder pointer, unused without entropy
            logits.stride(0),
            vocab,
            *split_scalar(inv_temperature),
            WITH_ENTROPY=bool(with_entropy),
            ACC=_acc_type(logits.dtype),
            BLOCK_V=block,
            num_warps=_num_warps(block),
        )
    return lse, target, entropy


def row_backward(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    grad_logprob: Tensor,
    *,
    grad_entropy: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None,
    inv_temperature: float,
    out: Tensor,
    block_v: Optional[int] = None,
) -> None:
    """Write the row gradient into ``out`` (may be ``logits`` itself; see backends contract)."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    if grad_entropy is not None and entropy is None:
        raise ValueError("row_backward: grad_entropy needs the forward entropy")
    # The kernel writes rows with unit column stride; anything else goes through a copy.
    target = out
    if out.stride(1) != 1:
        target = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    labels = labels.contiguous()
    lse = lse.contiguous()
    grad_logprob = grad_logprob.contiguous()
    has_ge = grad_entropy is not None
    if has_ge:
        grad_entropy = grad_entropy.contiguous()
        entropy = entropy.contiguous()
    block = int(block_v) if block_v else pick_block_v(vocab, logits.element_size())
    with device_guard(logits):
        _row_backward_kernel[(rows,)](
            logits,
            target,
            labels,
            lse,
            grad_logprob,
            grad_entropy if has_ge else grad_logprob,  # placeholders, unused without ge
            entropy if has_ge else lse,
            logits.stride(0),
            target.stride(0),
            vocab,
            *split_scalar(inv_temperature),
            HAS_ENTROPY_GRAD=has_ge,
            ACC=_acc_type(logits.dtype),
            BLOCK_V=block,
            num_warps=_num_warps(block),
        )
    if target is not out:
        out.copy_(target)
