"""How the Triton row kernels cut a row and are launched: the row's sections and chunk tiles
(device helpers), and the launch geometry (host helpers). See ``row_kernels`` for the math."""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..row_summary import compute_dtype
from .. import triton_interpreter_enabled


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
    column stride whose rows never overlap (read in place, one launch); anything else copied."""
    if t.dim() not in (2, 3):
        raise ValueError(f"logits must be [rows, vocab] or [batch, rows, vocab], got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        return t.contiguous()
    if t.dim() == 3 and t.shape[0] > 1:
        per_batch, step, vocab = batch_layout(t)[0], batch_layout(t)[2], t.shape[-1]
        if step < vocab or t.stride(0) < (per_batch - 1) * step + vocab:
            return t.contiguous()
    return t


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
def chunk_tile(BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    """A chunk of ``BLOCK_V`` columns as a ``[BLOCK_V // VEC, VEC]`` tile of 16-byte vectors:
    ``(vector index [n, 1], lane [1, VEC])``. Testing a column as (vector, lane) compares the
    lane with a compile-time constant per register, so the column indices never occupy
    registers (a 1-D ``arange`` compare keeps one register per element live in the loop)."""
    return tl.arange(0, BLOCK_V // VEC)[:, None], tl.arange(0, VEC)[None, :]


@triton.jit
def edge_tile(head, vec_end, vocab, VEC: tl.constexpr):
    """The edges as a ``[2, VEC]`` tile: row 0 the head columns ``[0, min(head, vocab))``, row 1
    the last columns ``[vec_end, vocab)``. Returns ``(columns, mask)``."""
    part = tl.arange(0, 2)[:, None]
    lane = tl.arange(0, VEC)[None, :]
    cols = tl.where(part == 0, lane, vec_end + lane)
    return cols, (cols < vocab) & ((part == 1) | (lane < head))


@triton.jit
def is_label_in(vector, lane, label_vector, label_lane, chunk_start, VEC: tl.constexpr):
    """Where the label sits in the chunk of a ``chunk_tile`` starting ``chunk_start`` columns into
    the body (a multiple of ``VEC``), with ``label_vector, label_lane`` the label column relative to
    the body's start as ``(// VEC, % VEC)``; a negative column (the label in the head, or no
    label) matches nothing."""
    return (vector == label_vector - chunk_start // VEC) & (lane == label_lane)


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
        # 4096 wide at 8 warps: 16 values per thread, no spills (sm_90: forward 53-56 registers,
        # 80 with entropy; backward 29-40), several programs resident per SM to keep loads in flight.
        cap = 2048 if element_size >= 8 else 4096
    return min(triton.next_power_of_2(max(int(vocab), 1)), cap)


def pick_num_warps(block_v: int) -> int:
    if block_v >= 4096:
        return 8
    if block_v >= 1024:
        return 4
    return 2 if block_v >= 256 else 1


def forward_register_cap(dtype: torch.dtype, with_entropy: bool) -> Optional[int]:
    """ptxas's register limit for the fp32 forward: 64 per thread (80 with the entropy) leaves room
    for 4 (3) programs of 8 warps per SM, where ptxas alone takes up to 119 (sm_80, fp32,
    entropy); none spill (the kernel report checks). fp64 rows are left to ptxas."""
    if compute_dtype(dtype) == torch.float64:
        return None
    return 80 if with_entropy else 64
