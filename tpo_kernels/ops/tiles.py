"""How the fused-linear path cuts its work: tile budgets per device (:class:`TilePolicy`),
balanced token chunks, and matmul products accumulated into a wider dtype."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import List, Optional, Union

import torch
from torch import Tensor

ROW_ALIGN = 16  # tile rows (the default chunk_size and balanced chunks are multiples of this)
# Vocabulary blocks are multiples of 128 entries, so that a tile's rows (its matmul leading
# dimension) stay aligned for vector loads and tensor-core matmuls.
VOCAB_ALIGN = 128


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
    default) keeps none.
    """

    logits_bytes: int
    min_tile_tokens: int
    accum_bytes: int = 256 << 20
    matmul_out_dtype: Optional[bool] = None
    logits_cache_bytes: int = 0

    @staticmethod
    def for_device(device: torch.device) -> "TilePolicy":
        if torch.device(device).type == "cuda":
            return TilePolicy(logits_bytes=512 << 20, min_tile_tokens=4096)
        # A small budget on the CPU keeps the peak below that of chunked cross-entropy
        # implementations (the torch backend's row ops make a few fp32 temporaries of a tile).
        return TilePolicy(logits_bytes=6 << 20, min_tile_tokens=512)

    def chunk_size(self, num_rows: int, vocab_size: int) -> int:
        """The default ``chunk_size``: rows of V fitting ``logits_bytes`` in fp32, a multiple of
        16, at most ``num_rows``."""
        rows = self.logits_bytes // (4 * max(vocab_size, 1))
        if rows > ROW_ALIGN:
            rows -= rows % ROW_ALIGN
        return max(1, min(rows, num_rows))

    def logits_cache_rows(self, num_rows: int, vocab_size: int, dtype: torch.dtype) -> int:
        """Rows of ``vocab_size`` logits of ``dtype`` that fit ``logits_cache_bytes``, at most
        ``num_rows``: the size of the cache, known before any row is read (static under
        torch.compile)."""
        row_bytes = max(vocab_size, 1) * torch.empty(0, dtype=dtype).element_size()
        return min(num_rows, self.logits_cache_bytes // row_bytes)

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
