"""How the Triton row kernels cut a row and are launched: the row's sections and chunk tiles
(device helpers), and the launch geometry (host helpers). See ``row_kernels`` for the math."""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import triton_interpreter_enabled
from ..rows import rows_in_place
from ..rows import compute_dtype


@triton.jit
def row_offset(row, rows_per_batch, batch_stride, row_stride):
    """Element offset of row ``row = b * T + t`` (int64) of a batched ``[B, T, V]`` view:
    ``b * batch_stride + t * row_stride``. A ``[M, V]`` matrix is the batch of one (``T = M``), so
    one launch covers ``logits[:, :-1]``, whose rows do not flatten into one row stride."""
    batch = row // rows_per_batch
    return batch * batch_stride + (row - batch * rows_per_batch) * row_stride


def batch_layout(t: Tensor) -> Tuple[int, int, int]:
    """``(rows_per_batch, batch_stride, row_stride)`` of a row-op input ``[M, V]`` or ``[B, T,
    V]`` (unit column stride): the arguments of :func:`row_offset`."""
    per_batch = t.shape[-2]
    step = t.stride(-2) if per_batch > 1 else t.shape[-1]
    if t.dim() == 2:
        return max(per_batch, 1), 0, step
    return max(per_batch, 1), (t.stride(0) if t.shape[0] > 1 else 0), step


def row_batch(t: Tensor) -> Tensor:
    """``t`` as the row kernels read it: a ``[M, V]`` matrix or a ``[B, T, V]`` view with unit
    column stride whose rows never overlap (read in place, one launch; ``rows_in_place``), else a
    copy."""
    if t.dim() not in (2, 3):
        raise ValueError(f"logits must be [rows, vocab] or [batch, rows, vocab], got shape {tuple(t.shape)}")
    return t if rows_in_place(t) else t.contiguous()


def aligned_base(t: Tensor, vec: int) -> Tuple[Tensor, int]:
    """``(base, offset)``: a tensor on ``t``'s storage whose first element is ``t``'s start rounded
    down to a 16-byte boundary (``vec`` elements), and ``t``'s start in elements from it, which the
    kernels add to every row offset. Passing the aligned base lets Triton specialize the pointer as
    16-byte aligned (vector loads and stores) for any view start, e.g. ``logits[:, 1:]`` with an odd
    V; ``t`` itself (offset 0) when its start is aligned or its storage's is not."""
    remainder = (t.data_ptr() // t.element_size()) % vec if t.data_ptr() % t.element_size() == 0 else 0
    if remainder == 0 or t.storage_offset() < remainder:
        return t, 0
    return t.as_strided((1,), (1,), t.storage_offset() - remainder), remainder


@triton.jit
def row_sections(row_start, vocab, VEC: tl.constexpr, BLOCK_V: tl.constexpr):
    """Split the row whose first element is element ``row_start`` of the tensor.

    ``VEC`` elements are 16 bytes. With the tensor's base 16-byte aligned, column ``head`` is the
    row's first 16-byte aligned column; from there a body of ``body_len`` columns (whole
    ``BLOCK_V`` chunks, read without a mask) and a tail up to ``vec_len`` (read with a mask that
    is constant over ``VEC`` columns, so loads stay 16 bytes wide). The head ``[0, head)`` and the
    last ``< VEC`` columns ``[head + vec_len, vocab)`` are the row's edges (``edge_tile``)."""
    head = ((VEC - row_start % VEC) % VEC).to(tl.int32)
    vec_len = tl.maximum(vocab - head, 0) // VEC * VEC
    body_len = vec_len // BLOCK_V * BLOCK_V
    return head, body_len, vec_len


@triton.jit
def thread_tile(BLOCK_V: tl.constexpr, VEC: tl.constexpr, THREADS: tl.constexpr):
    """A chunk of ``BLOCK_V`` columns as a ``[BLOCK_V // (THREADS * VEC), THREADS, VEC]`` tile of
    column offsets: dim 1 is the program's threads (``chunk_threads``), dim 2 a 16-byte vector, so
    each thread holds ``BLOCK_V // THREADS`` columns, consecutive threads read consecutive vectors
    (coalesced), and a reduction over dims 0 and 2 stays within each thread: no shuffle, no
    barrier."""
    rep = tl.arange(0, BLOCK_V // (THREADS * VEC))[:, None, None]
    thread = tl.arange(0, THREADS)[None, :, None]
    return (rep * THREADS + thread) * VEC + tl.arange(0, VEC)[None, None, :]


@triton.jit
def edge_tile(head, vec_end, vocab, VEC: tl.constexpr):
    """The edges as a ``[2, VEC]`` tile: row 0 the head columns ``[0, min(head, vocab))``, row 1
    the last columns ``[vec_end, vocab)``. Returns ``(columns, mask)``."""
    part = tl.arange(0, 2)[:, None]
    lane = tl.arange(0, VEC)[None, :]
    cols = tl.where(part == 0, lane, vec_end + lane)
    return cols, (cols < vocab) & ((part == 1) | (lane < head))


@triton.jit
def label_chunk(label_col, body_len, BLOCK_V: tl.constexpr):
    """The start of the body chunk holding column ``label_col`` (from the body's start), or
    ``body_len`` when the label is not in the body: the kernels read that chunk apart, so that no
    other chunk tests its columns against the label."""
    return tl.where((label_col >= 0) & (label_col < body_len), label_col // BLOCK_V * BLOCK_V, body_len)


@triton.jit
def load_chunk(chunk_ptr, cols, ACC: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr, THREADS: tl.constexpr):
    """The body chunk from ``chunk_ptr`` (16-byte aligned; ``cols`` its ``thread_tile``), unmasked,
    in ``ACC``. bf16 is read as 32-bit words and widened by hand: a bf16 is the high half of the
    fp32 of the same value, so (little-endian) the even column is ``word << 16`` and the odd one
    ``word & 0xffff0000``, one instruction each (the compiler's widening takes two for the odd
    column); the join puts them back in column order, within each thread."""
    if chunk_ptr.dtype.element_ty == tl.bfloat16:
        words = tl.load(chunk_ptr.to(tl.pointer_type(tl.uint32)) + thread_tile(BLOCK_V // 2, VEC // 2, THREADS))
        even = (words << 16).to(tl.float32, bitcast=True)
        odd = (words & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.reshape(tl.join(even, odd), cols.shape).to(ACC)
    else:
        return tl.load(chunk_ptr + cols).to(ACC)


@triton.jit
def thread_max(x):
    """``x`` (a ``thread_tile``'s shape) reduced over each thread's own columns: ``[1, THREADS,
    1]``, without shuffles or barriers."""
    return tl.max(tl.max(x, axis=2, keep_dims=True), axis=0, keep_dims=True)


@triton.jit
def thread_sum(x):
    """As :func:`thread_max`, the sum."""
    return tl.sum(tl.sum(x, axis=2, keep_dims=True), axis=0, keep_dims=True)


def chunk_geometry(logits: Tensor, block_v: Optional[int]) -> Tuple[int, int]:
    """``(BLOCK_V, VEC)``: the chunk width (``block_v`` or ``pick_block_v``'s, at least one
    vector) and the elements per 16-byte vector, to which each row's body is aligned."""
    vec = 16 // logits.element_size()
    block = int(block_v) if block_v else pick_block_v(logits.shape[-1], logits.element_size())
    return max(block, vec), vec


def pick_block_v(vocab: int, element_size: int) -> int:
    """Chunk width along V: big enough for wide vector loads and few loop trips, small enough that
    the fp32 (fp64) working set of a chunk stays in registers."""
    if triton_interpreter_enabled():
        cap = 1024  # the interpreter runs each program in numpy; moderate blocks are fastest
    else:
        # 4096 wide at 8 warps: 16 values per thread, no spills (forward 40-48 registers on sm_90,
        # 48-64 on sm_80; backward 32-40, 40-64), several programs resident per SM to keep loads
        # in flight.
        cap = 2048 if element_size >= 8 else 4096
    return min(triton.next_power_of_2(max(int(vocab), 1)), cap)


def acc_type(dtype: torch.dtype):
    """The ``ACC`` constexpr of the row kernels: their compute dtype (``compute_dtype``)."""
    return tl.float64 if compute_dtype(dtype) == torch.float64 else tl.float32


def chunk_threads(block_v: int, vec: int) -> int:
    """The threads of a ``thread_tile``: the program's (32 per warp), or fewer when a chunk has
    fewer 16-byte vectors than the program has threads (a small vocabulary)."""
    return min(32 * pick_num_warps(block_v), block_v // vec)


def pick_num_warps(block_v: int) -> int:
    if block_v >= 4096:
        return 8
    if block_v >= 1024:
        return 4
    return 2 if block_v >= 256 else 1

