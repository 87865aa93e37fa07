"""Rows of a batch gathered into a zero-padded block whose size depends on nothing but their count
rounded up to a tile: what the fused head's batch-invariant mode (``TilePolicy.batch_invariant``)
runs its tiles over.

Why padding: a row's results must be the same bits whatever else is in its batch. A matmul's
result for a row depends, on the CPU (MKL) and with split-K on GPUs, on the shape of the call,
not only on the row; a matmul of a fixed shape was found bitwise row-invariant (rows at other
positions, permuted, at 1 and 2 threads). So every tile has ``tile_rows`` rows: the selected rows
first, in order, then rows of zeros whose labels (-1) do not count and whose gradients are 0.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ..backends.rows import RowSummary
from .tiles import selection_size

__all__ = ["padded_backward", "padded_count", "padded_forward", "padded_rows", "padded_summary"]


def padded_count(num_rows: int, tile_rows: int) -> int:
    """``num_rows`` rounded up to a multiple of ``tile_rows``."""
    return -(-num_rows // tile_rows) * tile_rows


def padded_rows(values: Tensor, rows: Union[slice, Tensor], count: int, fill: float = 0,
                dtype: torch.dtype = None) -> Tensor:
    """``values[rows]`` (in ``dtype``) followed by ``fill`` up to ``count`` rows."""
    num = selection_size(rows)
    out = values.new_empty((count, *values.shape[1:]), dtype=dtype or values.dtype)
    out[:num] = values[rows]
    out[num:] = fill
    return out


def padded_summary(summary: RowSummary, rows: Union[slice, Tensor], count: int) -> RowSummary:
    """The ``rows`` of ``summary`` followed by rows that do not count (0, no label) up to
    ``count``."""
    return summary.map(lambda field: padded_rows(field, rows, count))


def _padded_head(head, rows: Union[slice, Tensor], tile_rows: int):
    """A :class:`~tpo_kernels.ops.linear_head.TiledLinearHead` over ``rows`` of ``head``,
    zero-padded to a multiple of ``tile_rows`` (labels -1 there), in the logits' dtype; it takes
    every one of its rows (``padded``), in chunks of exactly ``tile_rows``."""
    count = padded_count(selection_size(rows), tile_rows)
    padded = type(head)(padded_rows(head.hidden, rows, count, dtype=head.dtype), head.weight, head.bias,
                        padded_rows(head.labels, rows, count, fill=-1), head.backend, head.inv_temperature,
                        dataclasses.replace(head.tiles, head_dtype=head.dtype), head.vocab_offset, head.transform)
    padded.padded, padded.tile_rows = True, tile_rows
    # The outer head's logits cache (every counted row, padded), or none.
    padded.logits_cache = head.logits_cache[:count] if getattr(head, "logits_cache", None) is not None and \
        head.logits_cache.shape[0] else head.hidden.new_empty(0, head.weight.shape[0], dtype=head.dtype)
    return padded


def padded_forward(head, rows: Union[slice, Tensor], tile_rows: int, fields: Tuple[str, ...]) -> RowSummary:
    """The summary of ``head``'s ``rows`` (the counted ones), every tile ``[tile_rows, V_b]``."""
    summary = _padded_head(head, rows, tile_rows).forward(fields)
    return summary.select(slice(0, selection_size(rows)))


def padded_backward(head, rows: Union[slice, Tensor], tile_rows: int, summary: RowSummary, grad_logprob: Tensor,
                    grad_entropy: Optional[Tensor], needs_grad: Tuple[bool, bool, bool],
                    grad_accum_dtype: torch.dtype, logits_cache: Optional[Tensor] = None,
                    overwrite_cache: bool = False):
    """``head.backward`` of its active ``rows`` zero-padded to chunks of ``tile_rows``: every tile
    ``[tile_rows, V_b]``, each row's ``dH`` summed over the same vocabulary blocks by matmuls of
    one shape in any batch (the padded rows' gradients are 0: no term in ``dW`` or ``db``). With a
    ``logits_cache`` (of every counted row: ``rows`` are those) its tiles are read, not recomputed,
    or with ``overwrite_cache`` turned into dz in place, ``dH`` one tile's rows at a time."""
    count = padded_count(selection_size(rows), tile_rows)
    grad_entropy = None if grad_entropy is None else padded_rows(grad_entropy, rows, count)
    cache = None if logits_cache is None or not logits_cache.shape[0] else logits_cache[:count]
    grad_hidden, grad_weight, grad_bias = _padded_head(head, rows, tile_rows).backward(
        padded_summary(summary, rows, count), padded_rows(grad_logprob, rows, count), grad_entropy, needs_grad,
        grad_accum_dtype, cache, overwrite_cache)
    if grad_hidden is not None:
        part, grad_hidden = grad_hidden, head.hidden.new_zeros(head.hidden.shape)
        grad_hidden[rows] = part[:selection_size(rows)].to(grad_hidden.dtype)
    return grad_hidden, grad_weight, grad_bias
