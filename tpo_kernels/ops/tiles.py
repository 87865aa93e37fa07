"""How the fused-linear path cuts its work: tile budgets per device (:class:`TilePolicy`),
balanced token chunks, the backward's tile plan (:func:`backward_plan`), matmul products
accumulated into a wider dtype (and half-precision ones summed in fp32,
:func:`full_precision_reduction`), and the bytes each pass moves beyond its matmuls
(:func:`traffic_account`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import torch
from torch import Tensor

from ..backends.rows import compute_dtype

ROW_ALIGN = 16  # tile rows (the default chunk_size and balanced chunks are multiples of this)
# Vocabulary blocks are multiples of 128 entries, so that a tile's rows (its matmul leading
# dimension) stay aligned for vector loads and tensor-core matmuls.
VOCAB_ALIGN = 128
# A logits cache budget that holds every row of any batch (an int64, as the ops take it).
EVERY_ROW = 1 << 62


@dataclass(frozen=True)
class TilePolicy:
    """How the fused-linear path sizes its tiles of logits.

    ``logits_bytes``: the memory of one tile in fp32 when no ``chunk_size`` is given (the row
    ops compute in fp32 whatever the input dtype). ``min_tile_tokens``: rows a tile should span,
    cutting the vocabulary into blocks if needed: matmuls of few rows run far below the
    machine's peak, and each backward tile's ``dW[block] += dz.T @ h`` reads and writes the
    ``[block, H]`` accumulator (8 bytes per entry against ``2 * tokens`` flops).
    ``accum_bytes``: the largest ``dW`` accumulator kept in a dtype wider than the weight's.
    ``matmul_out_dtype``: how a product is added into a wider accumulator (``dW`` in fp32 for a
    bf16 head, ``dH`` over vocabulary blocks): True, by one matmul that writes the wide dtype
    (``torch.addmm(..., out_dtype=)``, no product tensor, no conversion pass); False, product in
    the input dtype, converted, then added; None, the first where the installed torch offers it
    for the device and dtypes, else the second.
    ``logits_cache_bytes``: memory the forward may keep for the backward as whole rows of logits
    (in the logits' dtype, :meth:`logits_cache_rows`), so that the backward reads those tokens'
    logits instead of recomputing them: three matmuls per cached token instead of four. 0 (the
    default): the head decides from its vocabulary size (``small_vocab``).
    ``small_vocab``: with no ``logits_cache_bytes``, a head of at most this many vocabulary entries
    keeps the logits of every counted token (:meth:`logits_cache_budget`): ``M * V`` logits in
    their dtype, less than an eager step keeps (the logits and their fp32 log-softmax), for three
    matmuls a token instead of four. A larger vocabulary keeps none (the minimal-memory path). The
    choice depends on V alone, never on the batch. 0: never.
    ``batch_invariant``: a token's results (log-prob, entropy, its row of ``dH``) are the same
    bits whatever else is in the batch (its size, order, padding): every tile has the same shape
    (:func:`invariant_tile_shape`: ``min_tile_tokens`` rows, the last token chunk zero-padded, a
    vocabulary block that does not depend on the row count), the backward cuts the same blocks,
    the default ``chunk_size`` is not clipped to the batch, and a logits cache holds every counted
    row (the ``small_vocab`` default) or none (a byte budget would cache rows by their place in the
    batch). ``dW`` and ``db`` (sums over the batch) are out of its scope.
    """

    logits_bytes: int
    min_tile_tokens: int
    accum_bytes: int = 256 << 20
    matmul_out_dtype: Optional[bool] = None
    logits_cache_bytes: int = 0
    small_vocab: int = 16384
    batch_invariant: bool = False

    @staticmethod
    def for_device(device: torch.device) -> "TilePolicy":
        if torch.device(device).type == "cuda":
            return TilePolicy(logits_bytes=512 << 20, min_tile_tokens=4096)
        # A small budget on the CPU keeps the peak below that of chunked cross-entropy
        # implementations (the torch backend's row ops make a few fp32 temporaries of a tile).
        return TilePolicy(logits_bytes=6 << 20, min_tile_tokens=512)

    def chunk_size(self, num_rows: int, vocab_size: int) -> int:
        """The default ``chunk_size``: rows of V fitting ``logits_bytes`` in fp32, a multiple of
        16, at most ``num_rows`` (not clipped under ``batch_invariant``: the tiles would then
        depend on the batch)."""
        rows = self.logits_bytes // (4 * max(vocab_size, 1))
        if rows > ROW_ALIGN:
            rows -= rows % ROW_ALIGN
        return max(1, rows if self.batch_invariant else min(rows, num_rows))

    def logits_cache_rows(self, num_rows: int, vocab_size: int, dtype: torch.dtype) -> int:
        """Rows of ``vocab_size`` logits of ``dtype`` that fit ``logits_cache_bytes``, at most
        ``num_rows``: the size of the cache, known before any row is read (static under
        torch.compile)."""
        row_bytes = max(vocab_size, 1) * torch.empty(0, dtype=dtype).element_size()
        return min(num_rows, self.logits_cache_bytes // row_bytes)

    def logits_cache_budget(self, vocab_size: int) -> int:
        """The cache budget a head of ``vocab_size`` entries runs with: ``logits_cache_bytes`` when
        set, else every row (:data:`EVERY_ROW`) for a small vocabulary (``small_vocab``), else 0;
        under ``batch_invariant`` every row or 0."""
        budget = self.logits_cache_bytes or (EVERY_ROW if 0 < vocab_size <= self.small_vocab else 0)
        return 0 if self.batch_invariant and budget < EVERY_ROW else budget

    def with_logits_cache(self, logits_cache_bytes: int) -> "TilePolicy":
        """This policy with the ``logits_cache_bytes`` keyword of the public functions applied
        (0: the policy's own field stands); checked by the caller."""
        return dataclasses.replace(self, logits_cache_bytes=logits_cache_bytes) if logits_cache_bytes else self

    def fused_accumulate(self, device: torch.device, dtype: torch.dtype, accum_dtype: torch.dtype) -> bool:
        """Whether products of ``dtype`` operands go into ``accum_dtype`` by one out_dtype matmul."""
        if dtype == accum_dtype or self.matmul_out_dtype is False:
            return False
        return True if self.matmul_out_dtype else _out_dtype_matmul_available(torch.device(device).type, dtype,
                                                                               accum_dtype)


@dataclass(frozen=True)
class HeadTiles:
    """How one fused-head call cuts its work: rows of V per tile, the policy, the dtype dW / db
    accumulate in."""

    chunk_size: int
    policy: TilePolicy
    grad_accum_dtype: torch.dtype
    # The dtype the logits are formed in, at least the inputs' (None: theirs). float32 for bf16 /
    # fp16 hidden states and weight: each tile's operands are cast (or multiplied into fp32 by an
    # out_dtype matmul), never the whole weight, and the gradients come back in the inputs' dtypes.
    head_dtype: Optional[torch.dtype] = None


@functools.lru_cache(maxsize=None)
def _out_dtype_matmul_available(device_type: str, dtype: torch.dtype, accum_dtype: torch.dtype) -> bool:
    """``torch.addmm(..., out_dtype=accum_dtype)`` runs for ``dtype`` operands on this kind of
    device (CUDA bf16/fp16 -> fp32 in recent torch; not on the CPU): tried once on a tiny case."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        out = torch.zeros(2, 2, dtype=accum_dtype, device=device_type)
        torch.addmm(out, a, a, out_dtype=accum_dtype, out=out)
        return bool((out == 2).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


# cuBLAS's reduced-precision flags are process-wide: each toggle is made under this lock.
_REDUCTION_FLAGS = threading.RLock()


@contextlib.contextmanager
def full_precision_reduction(device: torch.device, dtype: torch.dtype):
    """A matmul of ``dtype`` operands run inside sums its split-K partials in fp32. cuBLAS may sum
    them in half precision (``allow_bf16/fp16_reduced_precision_reduction``, on by default), which a
    ``dW`` block summed over every active row cannot afford. The flag is process-wide, so it is
    saved, cleared and restored under a process lock held for the matmul's launch only (threads
    running backwards at once take turns; the caller's setting is always restored). Meanwhile
    another thread's half-precision matmul also sums in fp32: more exact, never less. No effect
    on the CPU or for other dtypes."""
    name = {torch.bfloat16: "allow_bf16_reduced_precision_reduction",
            torch.float16: "allow_fp16_reduced_precision_reduction"}.get(dtype)
    if name is None or torch.device(device).type != "cuda":
        yield
        return
    flags = torch.backends.cuda.matmul
    with _REDUCTION_FLAGS:
        saved = getattr(flags, name)
        setattr(flags, name, False)
        try:
            yield
        finally:
            setattr(flags, name, saved)


def add_product(out: Tensor, rows: Union[slice, Tensor], a: Tensor, b: Tensor, fused: bool) -> None:
    """``out[rows] += a @ b``. Same dtypes, or ``fused`` (an out_dtype matmul into the wider
    ``out``) with a slice: in place, no temporary. Otherwise the product is formed (by an out_dtype
    matmul when ``fused``, else in the inputs' dtype and converted) and summed in ``out``'s dtype."""
    if isinstance(rows, slice) and out.dtype == a.dtype:
        out[rows].addmm_(a, b)
        return
    if isinstance(rows, slice) and fused:
        target = out[rows]
        torch.addmm(target, a, b, out_dtype=out.dtype, out=target)
        return
    product = torch.mm(a, b, out_dtype=out.dtype) if fused else (a @ b).to(out.dtype)
    if isinstance(rows, slice):
        out[rows] += product
    else:  # distinct rows: every entry gets exactly one addition, so the result is deterministic
        out.index_add_(0, rows, product)


def add_chunk_product(out: Tensor, a: Tensor, b: Tensor, fused: bool, first: bool) -> None:
    """``out += a @ b`` over a chunk of rows (:func:`add_product`); ``out = a @ b`` for the first
    chunk (a write, so ``out`` needs no zero fill before)."""
    if not first:
        add_product(out, slice(None), a, b, fused)
    elif out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a, b, out_dtype=out.dtype) if fused else a @ b)


def balanced_chunks(num_rows: int, max_rows: int) -> List[int]:
    """Sizes of the fewest chunks of at most ``max_rows`` rows covering ``num_rows``, equal up to
    the alignment: multiples of 16 rows (when ``max_rows`` is one) but the last, the smaller ones
    first. 16384 rows at most 8160 at a time are 5456 + 5456 + 5472, not 8160 + 8160 + 64 (a thin
    tail re-reads every weight block for a matmul of few rows)."""
    if num_rows <= 0:
        return []
    align = ROW_ALIGN if max_rows % ROW_ALIGN == 0 else 1
    count = -(-num_rows // max_rows)
    units = -(-num_rows // align)
    small, larger = divmod(units, count)
    sizes = [small * align] * (count - larger) + [(small + 1) * align] * larger
    sizes[-1] -= units * align - num_rows  # the last chunk ends at num_rows
    return sizes


# ----------------------------------------------------------------------------- row selections
# Rows of a batch are selected as a slice when consecutive (views, no gather), else as ascending
# indices.


def selection_size(rows: Union[slice, Tensor]) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


def mask_indices(mask: Tensor, count: int) -> Tensor:
    """The ascending indices of the ``count`` True entries of ``mask``, without a read-back."""
    return torch.nonzero_static(mask, size=count).squeeze(1)


def row_chunks(rows: Union[slice, Tensor], chunk_size: int) -> List[Union[slice, Tensor]]:
    """Selected rows in balanced chunks of at most ``chunk_size`` (:func:`balanced_chunks`):
    slices of a slice, index tensors of indices. Two selections of one size split alike."""
    sizes = balanced_chunks(selection_size(rows), chunk_size)
    if isinstance(rows, Tensor):
        return list(rows.split(sizes)) if sizes else []
    bounds = list(itertools.accumulate(sizes, initial=rows.start))
    return [slice(start, stop) for start, stop in zip(bounds, bounds[1:])]


def selected_rows(matrix: Tensor, selections: List[Union[slice, Tensor]]) -> Tensor:
    """The rows of ``matrix`` the selections pick, in order: a view when they are consecutive
    slices, else one gather."""
    if all(isinstance(rows, slice) for rows in selections) and all(
            a.stop == b.start for a, b in zip(selections, selections[1:])):
        return matrix[selections[0].start:selections[-1].stop]
    return matrix[torch.cat([torch.arange(rows.start, rows.stop, device=matrix.device) if isinstance(rows, slice)
                             else rows for rows in selections])]


def flat_tile(buffer: Tensor, rows: int, vocab: int) -> Tensor:
    """A contiguous ``[rows, vocab]`` tile at the start of a flat buffer."""
    return buffer[: rows * vocab].view(rows, vocab)


# ----------------------------------------------------------------------------- the backward's plan


@dataclass(frozen=True)
class BackwardPlan:
    """How the backward tiles ``num_rows`` active rows: token chunks of at most ``token_block`` rows
    (:attr:`token_chunks`, the same for every vocabulary block) times vocabulary blocks of ``vocab_block`` entries (the last one
    shorter). ``one_gemm``: each ``dW`` block is one matmul over every active row, written straight
    into ``dW`` in the weight's dtype (the matmul sums over the rows in its own fp32 accumulator);
    else ``dW`` is summed over the token chunks in ``grad_accum_dtype``, through a per-block
    accumulator when that is wider than the weight's dtype (``block_accumulator``).
    ``zero_filled``: ``dW`` is zero-filled before the blocks are added into it (the earlier plan,
    :func:`backward_plan` with ``one_gemm=False``, kept to measure against; the backward now
    writes every block)."""

    num_rows: int
    vocab_size: int
    vocab_block: int
    token_block: int
    one_gemm: bool
    block_accumulator: bool
    zero_filled: bool = False

    @property
    def token_chunks(self) -> List[int]:
        """The row counts of the token chunks (:func:`balanced_chunks`)."""
        return balanced_chunks(self.num_rows, self.token_block)

    @property
    def vocab_blocks(self) -> List[int]:
        """The widths of the vocabulary blocks, in order."""
        return [min(self.vocab_block, self.vocab_size - start) for start in range(0, self.vocab_size, self.vocab_block)]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _vocab_block_limit(vocab_size: int, hidden_size: int, chunk_size: int, policy: TilePolicy,
                       weight_dtype: torch.dtype, accum_dtype: torch.dtype,
                       logits_dtype: Optional[torch.dtype]) -> int:
    """The widest vocabulary block the budgets allow, whatever the rows: a ``dW`` accumulator
    wider than the weight dtype (``accum_dtype``) within ``accum_bytes``, and a weight block cast
    to a wider ``logits_dtype`` no larger than a tile of logits (never a cast copy of the whole
    weight)."""
    vocab_block = vocab_size
    if accum_dtype != weight_dtype:
        vocab_block = policy.accum_bytes // (_itemsize(accum_dtype) * max(hidden_size, 1))
    if logits_dtype is not None and logits_dtype != weight_dtype:
        vocab_block = min(vocab_block, max(VOCAB_ALIGN, chunk_size * vocab_size // max(hidden_size, 1)))
    return vocab_block


def _align_vocab_block(vocab_block: int, vocab_size: int) -> int:
    vocab_block = max(1, min(vocab_block, vocab_size))
    if VOCAB_ALIGN < vocab_block < vocab_size:
        vocab_block -= vocab_block % VOCAB_ALIGN
    return vocab_block


def invariant_tile_shape(vocab_size: int, hidden_size: int, chunk_size: int, policy: TilePolicy,
                         weight_dtype: torch.dtype, accum_dtype: torch.dtype,
                         logits_dtype: Optional[torch.dtype] = None) -> "tuple[int, int]":
    """(tokens, vocabulary entries) of every tile under ``batch_invariant``, independent of the
    row count: ``min_tile_tokens`` rows (a chunk of fewer rows is zero-padded to it) times the
    widest block of at most ``chunk_size * V`` logits, at least ``min(V, 128)`` wide (fewer rows
    then), within the limits of :func:`_vocab_block_limit`, a multiple of 128 below V."""
    logits_budget = chunk_size * vocab_size
    tokens = max(1, policy.min_tile_tokens)
    vocab_block = min(_vocab_block_limit(vocab_size, hidden_size, chunk_size, policy, weight_dtype, accum_dtype,
                                         logits_dtype), max(logits_budget // tokens, min(vocab_size, VOCAB_ALIGN)))
    vocab_block = _align_vocab_block(vocab_block, vocab_size)
    return max(1, min(tokens, logits_budget // vocab_block)), vocab_block


def tile_shape(num_rows: int, vocab_size: int, hidden_size: int, chunk_size: int, policy: TilePolicy,
               weight_dtype: torch.dtype, accum_dtype: torch.dtype,
               logits_dtype: Optional[torch.dtype] = None) -> "tuple[int, int]":
    """(tokens, vocabulary entries) of a token-chunked tile over ``num_rows`` rows: at most
    ``chunk_size * V`` logits, cut along the vocabulary so that a tile spans at least the
    policy's ``min_tile_tokens`` rows, within the limits of :func:`_vocab_block_limit`.
    Under ``batch_invariant``: :func:`invariant_tile_shape`, whatever ``num_rows``."""
    if policy.batch_invariant:
        return invariant_tile_shape(vocab_size, hidden_size, chunk_size, policy, weight_dtype, accum_dtype,
                                    logits_dtype)
    logits_budget = chunk_size * vocab_size
    vocab_block = _vocab_block_limit(vocab_size, hidden_size, chunk_size, policy, weight_dtype, accum_dtype,
                                     logits_dtype)
    tokens = max(chunk_size, min(policy.min_tile_tokens, num_rows))
    vocab_block = _align_vocab_block(min(vocab_block, logits_budget // tokens), vocab_size)
    return max(1, logits_budget // vocab_block), vocab_block


def backward_plan(num_rows: int, vocab_size: int, hidden_size: int, chunk_size: int, policy: TilePolicy,
                  weight_dtype: torch.dtype, logits_dtype: torch.dtype, grad_accum_dtype: torch.dtype,
                  one_gemm: bool = True) -> BackwardPlan:
    """The backward's tiles over ``num_rows`` active rows (a pure function of the shapes, dtypes
    and policy).

    One ``dW`` matmul per vocabulary block (``one_gemm``) when a tile of every active row and at
    least ``min(V, VOCAB_ALIGN)`` vocabulary entries fits the ``chunk_size * V`` logits budget,
    the matmul can write the weight's dtype (logits in the weight's dtype), and the sum over rows
    that ``grad_accum_dtype`` asks for is no wider than the matmul's own accumulator (fp32; fp64
    for fp64 logits). The blocks are then as wide as the budget allows (a multiple of 128 below
    V), and, when ``grad_accum_dtype`` is wider than the weight's, hold at most the policy's
    ``accum_bytes`` of ``dW`` in that dtype (the documented bound of ``grad_accum_dtype``: ``dW``
    is summed one such vocabulary block at a time). Otherwise (or with ``one_gemm=False``: the
    earlier plan, kept to measure against) tokens are chunked as :func:`tile_shape` says and ``dW``
    is summed over the chunks in ``grad_accum_dtype``. Under ``batch_invariant`` the forward's
    tiles (:func:`invariant_tile_shape`), token chunks padded to them, ``dW`` summed over the
    chunks: a row's ``dH`` is then summed over the same vocabulary blocks in any batch."""
    if policy.batch_invariant or logits_dtype != weight_dtype:
        tokens, vocab_block = tile_shape(num_rows, vocab_size, hidden_size, chunk_size, policy, weight_dtype,
                                         grad_accum_dtype, logits_dtype)
        return BackwardPlan(num_rows=num_rows, vocab_size=vocab_size, vocab_block=vocab_block, token_block=tokens,
                            one_gemm=False, block_accumulator=grad_accum_dtype != weight_dtype,
                            zero_filled=not one_gemm)
    logits_budget = chunk_size * vocab_size
    fits = num_rows > 0 and logits_budget // num_rows >= min(vocab_size, VOCAB_ALIGN)
    sums_in_gemm = _itemsize(grad_accum_dtype) <= _itemsize(compute_dtype(logits_dtype))
    if one_gemm and fits and sums_in_gemm:
        vocab_block = min(vocab_size, logits_budget // num_rows)
        if grad_accum_dtype != weight_dtype:  # summed wider than W: at most accum_bytes of dW a block, as documented
            vocab_block = max(1, min(vocab_block, policy.accum_bytes // (_itemsize(grad_accum_dtype) * max(hidden_size, 1))))
        if VOCAB_ALIGN < vocab_block < vocab_size:
            vocab_block -= vocab_block % VOCAB_ALIGN
        return BackwardPlan(num_rows=num_rows, vocab_size=vocab_size, vocab_block=vocab_block, token_block=num_rows,
                            one_gemm=True, block_accumulator=False)
    tokens, vocab_block = tile_shape(num_rows, vocab_size, hidden_size, chunk_size, policy, weight_dtype,
                                     grad_accum_dtype)
    return BackwardPlan(num_rows=num_rows, vocab_size=vocab_size, vocab_block=vocab_block, token_block=tokens,
                        one_gemm=False, block_accumulator=grad_accum_dtype != weight_dtype, zero_filled=not one_gemm)


def traffic_account(plan: BackwardPlan, hidden_size: int, dtype: torch.dtype, grad_accum_dtype: torch.dtype,
                    out_dtype_matmul: bool, cached: bool, forward_blocks: int,
                    with_entropy: bool = False) -> Dict[str, Dict[str, int]]:
    """Bytes each pass reads and writes beyond its matmuls, from the tile plan: ``{"forward":
    {item: bytes}, "backward": {item: bytes}}``, each with a ``"total"``.

    For a dense batch of one ``dtype`` (hidden, weight and logits): every row counts and has a
    gradient, cached rows are consecutive (no gather), no bias, no soft cap; gradients of hidden
    and weight. A matmul's operand reads and one write of its result are the floor (the
    ``matmul4``/``matmul3`` providers do the same); counted are the row ops' passes over the
    logits, fills, dtype conversions, and a matmul's reads and writes of an output it adds into
    (``C`` of ``C += A @ B``) or writes in a wider dtype, less one write of ``dH`` and of ``dW`` in
    their own dtype (the floor's). ``out_dtype_matmul``: products go into a wider accumulator by an
    out_dtype matmul (:meth:`TilePolicy.fused_accumulate`), else product -> convert -> add.
    ``forward_blocks``: the forward's vocabulary blocks per token chunk (its per-row summaries are
    written once per block: 4 fields, 5 with the entropy; counted are the fp32 row max, log-sum and
    label log-prob (and entropy), not the 1-byte ``has_label``). ``cached`` changes no count
    (the row backward reads the cache instead of the recomputed tile, and the floor it is held
    against drops the recompute too); it is kept so that a caller's account says what it covers.
    """
    del cached  # documented above: the same bytes either way
    rows, vocab, size = plan.num_rows, plan.vocab_size, _itemsize(dtype)
    hidden_elems, weight_elems = rows * hidden_size, vocab * hidden_size
    row_results = (4 if with_entropy else 3) * 4
    forward = {"row forward: read the logits": rows * vocab * size,
               "row forward: per-row summaries": forward_blocks * rows * row_results}

    def accumulate(elems: int, accum_size: int) -> int:
        """``out += a @ b`` over ``elems`` outputs of ``accum_size`` bytes, products of ``size``."""
        if accum_size == size or out_dtype_matmul:
            return 2 * elems * accum_size  # C read and written by the matmul
        return elems * size + (elems * size + elems * accum_size) + 3 * elems * accum_size  # product, convert, add

    blocks, chunks = plan.vocab_blocks, plan.token_chunks
    hidden_accum = size if len(blocks) == 1 else max(size, _itemsize(grad_accum_dtype))
    backward = {"row backward: read the logits, write dz": 2 * rows * vocab * size,
                "dH: zero fill": hidden_elems * hidden_accum,
                "dH: accumulate over blocks": len(blocks) * sum(accumulate(r * hidden_size, hidden_accum) for r in chunks),
                "dH: convert": hidden_elems * (hidden_accum + size) if hidden_accum != size else 0}
    if plan.one_gemm:
        backward.update({"dW: zero fill": 0, "dW: write": weight_elems * size})
    else:
        accum = _itemsize(grad_accum_dtype) if plan.block_accumulator else size
        backward["dW: zero fill"] = weight_elems * size if plan.zero_filled else 0  # zeros_like(weight)
        if plan.block_accumulator:
            backward["dW: block accumulator fill"] = weight_elems * accum
        if plan.block_accumulator or plan.zero_filled:
            backward["dW: accumulate over chunks"] = len(chunks) * accumulate(weight_elems, accum)
        else:  # the first chunk writes dW, the others add into it
            backward["dW: accumulate over chunks"] = weight_elems * size + (len(chunks) - 1) * accumulate(weight_elems, accum)
        if plan.block_accumulator:
            backward["dW: convert"] = weight_elems * (accum + size)
    backward["floor: one write of dH and dW"] = -(hidden_elems + weight_elems) * size
    for items in (forward, backward):
        items["total"] = sum(items.values())
    return {"forward": forward, "backward": backward}
