"""The tiled linear head (:class:`TiledLinearHead`): per-token log-probs (and entropies) of
``z = hidden @ weight.T (+ bias)`` and their gradients, without ever materializing the ``[tokens,
vocab]`` logits. The custom op ``tpo_kernels::linear_logprobs`` (:mod:`.linear`) and the row ops on
a vocabulary shard (:mod:`.vocab_shard`) run it.

Logits exist one tile at a time (a block of tokens times a block of the vocabulary, at most
``chunk_size * V`` entries). The forward keeps, per token, the :class:`RowSummary` of the row ops
(max and log-sum, the label's log-prob and, on request, the entropy), merged across vocabulary
blocks with bounded terms only (:meth:`~tpo_kernels.backends.rows.RowSummary.merge`). The backward receives a
per-token gradient ``g`` (and ``ge`` for entropies), recomputes the logits of the tokens with a
nonzero one only, tile by tile, turns them in place into ``dz`` with the backend's row backward
(the forward's statistics cover the whole vocabulary, so a block's softmax is exact) and applies
the chain rule of the linear layer::

    dH[rows] += dz @ W[block]          dW[block] += dz.T @ h[rows]          db[block] += dz.sum(0)

Tokens of tied on-policy groups (``g == 0`` exactly) cost no backward matmul at all. The backward's
tiles take every active token times a vocabulary block as wide as the logits budget allows
(:func:`~tpo_kernels.ops.tiles.backward_plan`): each ``dW`` block is one matmul written in the
weight's dtype (its sum over tokens in the matmul's fp32 accumulator; no accumulator tensor, fill or
conversion). Where that does not fit (or ``grad_accum_dtype`` asks for wider sums), tokens come in
chunks and ``dW`` is summed over them in a per-block accumulator of that dtype. :class:`TilePolicy`
holds these budgets per device; its ``batch_invariant`` tiles are one shape in any batch.

With a logit soft cap (:class:`tpo_kernels.backends.rows.LogitTransform`) each tile is capped into a
compute-dtype buffer before the row op; the backward multiplies the row op's ``dz'`` by its derivative.

Logits cache (``TilePolicy.logits_cache_bytes``; by default every counted row of a small
vocabulary, ``TilePolicy.small_vocab``; DESIGN.md, "Logits cache"). The forward writes the logits
of the first candidate rows that fit the budget straight into a ``[rows, V]`` cache, one matmul
(the op returns it, so autograd saves it); the candidates are the counted rows, or those a
``cache_candidates`` mask keeps (the TPO pipeline leaves out zero-signal groups' tokens). The
backward reads cached rows instead of recomputing them: three matmuls per cached token instead of
four. A backward that keeps no graph and finds every active row cached runs in the cache itself
(:meth:`TiledLinearHead._backward_in_cache`): ``dz`` overwrites the logits, and ``dH`` and ``dW``
are one matmul each, as wide as the cache. Otherwise the cache is only read (a second backward with
``retain_graph`` sees it intact) and a mispredicted row is recomputed.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from ..backends.rows import LogitTransform, RowSummary, compute_dtype, row_flags
from ..backends import Backend
from .tiles import (BackwardPlan, HeadTiles, TilePolicy, add_chunk_product, add_product, backward_plan, flat_tile,
                    full_precision_reduction, mask_indices, row_chunks, selected_rows, selection_size, tile_shape)
from .padded_rows import padded_backward, padded_forward

__all__ = ["TiledLinearHead"]


class TiledLinearHead:
    """A linear head over a flat token matrix, evaluated one tile of logits at a time.

    ``hidden`` is ``[M, H]`` contiguous, ``weight`` ``[V, H]``, ``bias`` ``[V]`` (the weight's
    dtype) or None; ``labels`` is ``[M]`` int64 with negatives marking rows that do not count. A
    tile never holds more than ``chunk_size * V`` logits (``tiles``: the call's HeadTiles). Logits are
    computed in the wider of the inputs' dtypes and ``head_dtype`` (None: theirs); only a tile's
    operands are cast.

    ``vocab_offset``: the vocabulary id of ``weight``'s first row when it is one shard of a
    vocabulary-parallel head (:mod:`tpo_kernels.distributed`). Labels stay global ids; a counted
    row whose label lies on another shard gets its logsumexp (and entropy) over this shard,
    target 0, and no one-hot term in the backward.

    ``cache_candidates``: ``[M]`` bool, the rows a logits cache may hold (the counted ones among
    them, first come); None: every counted row. Under ``policy.batch_invariant`` a head over a
    zero-padded copy of the rows (:mod:`.padded_rows`; ``padded``: it takes every row, in chunks of
    exactly ``tile_rows``) does the work.
    """

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, backend: Backend,
                 inv_temperature: float, tiles: HeadTiles, vocab_offset: int = 0,
                 transform: Optional[LogitTransform] = None, cache_candidates: Optional[Tensor] = None) -> None:
        self.hidden, self.weight, self.bias, self.labels = hidden, weight, bias, labels
        self.backend, self.inv_temperature = backend, inv_temperature
        self.tiles, self.chunk_size, self.policy = tiles, tiles.chunk_size, tiles.policy
        self.dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), tiles.head_dtype or hidden.dtype)
        self.vocab_offset, self.transform, self.cache_candidates = vocab_offset, transform, cache_candidates
        self.padded, self.tile_rows = False, 0

    def _cache_slots(self, cache_rows: int) -> Tensor:
        """``[M]`` int64: each row's place in a cache of ``cache_rows`` rows, -1 for the rows it
        does not hold. The cache holds the first counted candidate rows, in row order; the forward
        and the backward derive the same places from the labels and the candidates."""
        wanted = self.labels >= 0
        if self.cache_candidates is not None:
            wanted = wanted & self.cache_candidates
        slot = torch.cumsum(wanted, 0) - 1
        return torch.where(wanted & (slot < cache_rows), slot, -1)

    def _split_rows(self, active: Tensor, cache_rows: int):
        """The ``active`` rows (``[M]`` bool) as ``(cached, slots, recomputed)``: the rows a cache of
        ``cache_rows`` rows holds, their places in it, and the other active rows. Each is a slice
        when consecutive (no gather), else ascending indices; one read-back finds the sizes.

        The slots run from 0 when every row the cache holds is active, and the cached rows too
        when the cache holds rows ``0, 1, ...`` (each at its own index); the recomputed rows are
        then the rest of the batch when every row is active."""
        num_rows = active.shape[0]
        slot = self._cache_slots(cache_rows)
        in_cache = slot >= 0
        cached, recomputed = active & in_cache, active & ~in_cache
        misplaced = in_cache & (slot != torch.arange(num_rows, device=slot.device))
        num_cached, num_recomputed, num_in_cache, num_misplaced = torch.stack(
            (cached.sum(), recomputed.sum(), in_cache.sum(), misplaced.sum())).tolist()
        slots_from_0 = num_cached == num_in_cache
        rows_from_0 = slots_from_0 and num_misplaced == 0
        cached_rows = slice(0, num_cached) if rows_from_0 else mask_indices(cached, num_cached)
        slots = slice(0, num_cached) if slots_from_0 else slot[cached_rows]
        if rows_from_0 and num_cached + num_recomputed == num_rows:
            return cached_rows, slots, slice(num_cached, num_rows)
        return cached_rows, slots, mask_indices(recomputed, num_recomputed)

    def _block_weight(self, vocab: slice) -> Tensor:
        return self.weight[vocab].to(self.dtype)

    def _logits(self, h_rows: Tensor, vocab: slice, out: Tensor) -> Tensor:
        """``h_rows @ W[vocab].T (+ b[vocab])`` written into ``out`` (a tile: unit column stride); by
        an out_dtype matmul of uncast bf16 / fp16 operands where the policy allows it."""
        uncast = h_rows.dtype == self.weight.dtype != self.dtype and self.bias is None
        if uncast and self.policy.fused_accumulate(h_rows.device, h_rows.dtype, self.dtype):
            with full_precision_reduction(h_rows.device, h_rows.dtype):
                return torch.mm(h_rows, self.weight[vocab].t(), out_dtype=self.dtype, out=out)
        weight, h_rows = self._block_weight(vocab), h_rows.to(self.dtype)
        if self.bias is None:
            return torch.mm(h_rows, weight.t(), out=out)
        return torch.addmm(self.bias[vocab].to(self.dtype), h_rows, weight.t(), out=out)

    def _buffer(self, rows: int, vocab: int, dtype: Optional[torch.dtype] = None) -> Tensor:
        return self.hidden.new_empty(max(rows, 1) * vocab, dtype=dtype or self.dtype)

    def _vocab_width(self, vocab: slice) -> int:
        return min(vocab.stop, self.weight.shape[0]) - vocab.start

    def _cap_buffers(self, rows: int, vocab: int, count: int) -> List[Tensor]:
        """``count`` tile buffers in the compute dtype for the soft-capped logits (and their
        derivative); none without a cap."""
        if self.transform is None:
            return []
        return [self._buffer(rows, vocab, compute_dtype(self.dtype)) for _ in range(count)]

    def _cache_chunk(self, num_rows: int) -> int:
        """Rows of the cache a row op reads at once: all of them (the row ops bound their own
        temporaries), or with a soft cap a tile budget's worth; a padded head's tile rows."""
        rows = self.tile_rows if self.padded else num_rows if self.transform is None else self.chunk_size
        return min(rows, num_rows)

    def _tile(self, num_rows: int, grad_accum_dtype: torch.dtype) -> Tuple[int, int]:
        """(tokens, vocabulary entries) of a token-chunked tile over ``num_rows`` rows
        (:func:`~tpo_kernels.ops.tiles.tile_shape`)."""
        vocab_size, hidden_size = self.weight.shape
        return tile_shape(num_rows, vocab_size, hidden_size, self.chunk_size, self.policy, self.weight.dtype,
                          grad_accum_dtype, self.dtype)

    def backward_plan(self, num_rows: int, grad_accum_dtype: torch.dtype) -> BackwardPlan:
        """The backward's tiles over ``num_rows`` active rows (:func:`~tpo_kernels.ops.tiles.backward_plan`)."""
        vocab_size, hidden_size = self.weight.shape
        return backward_plan(num_rows, vocab_size, hidden_size, self.chunk_size, self.policy, self.weight.dtype,
                             self.dtype, grad_accum_dtype)

    def forward(self, fields: Tuple[str, ...] = (), cache_rows: int = 0) -> RowSummary:
        """The per-row :class:`RowSummary` of the tempered logits, with the optional ``fields`` (e.g.
        ``("entropy",)``), as the row ops define it (its ``has_label``: the label lies in this head's
        rows of the vocabulary); 0 on rows that do not count (their logits are never computed).
        ``self.logits_cache`` becomes a ``[cache_rows, V]`` tensor holding the logits of the first
        ``cache_rows`` counted candidate rows, in row order (slots past them stay unwritten).

        The cached rows' logits are written by matmuls straight into the cache (:meth:`_fill_cache`),
        then read by the row op in whole rows. The other rows' tiles are token chunks (outer loop)
        times vocabulary blocks (inner); the blocks' summaries merge with :meth:`RowSummary.merge`."""
        num_rows, vocab_size = self.hidden.shape[0], self.weight.shape[0]
        summary = RowSummary.zeros(num_rows, dtype=compute_dtype(self.dtype), device=self.hidden.device,
                                   fields=fields)
        if not self.padded:  # a padded head's cache is its outer head's (or empty)
            self.logits_cache = self.hidden.new_empty(cache_rows, vocab_size, dtype=self.dtype)
            if self.policy.batch_invariant:  # every tile [T_b, V_b]
                _, _, counted = self._split_rows(self.labels >= 0, 0)
                summary.assign(counted, padded_forward(self, counted, self._tile(0, self.weight.dtype)[0], fields))
                return summary
        # The forward's one read-back; its slots are the cache's first rows (every cached row counts).
        cached, _, uncached = self._split_rows(self.labels >= 0, 0 if self.padded else cache_rows)
        uncached = slice(0, num_rows) if self.padded else uncached
        num_cached = selection_size(cached)
        if num_cached:
            cache, chunk = self.logits_cache[:num_cached], self._cache_chunk(num_cached)
            self._fill_cache(cached, cache)
            capped = self._cap_buffers(chunk, vocab_size, 1)
            for rows, slots in zip(row_chunks(cached, chunk), row_chunks(slice(0, num_cached), chunk)):
                summary.assign(rows, self._row_forward(cache[slots], rows, 0, capped, fields))
        token_block, vocab_block = self._tile(selection_size(uncached), self.weight.dtype)
        chunks = row_chunks(uncached, token_block)
        tile_rows = max((selection_size(rows) for rows in chunks), default=0)
        buffer = self._buffer(tile_rows, vocab_block)
        capped = self._cap_buffers(tile_rows, vocab_block, 1)
        for rows in chunks:
            h_rows, row = self.hidden[rows], None
            for start in range(0, vocab_size, vocab_block):
                vocab = slice(start, start + vocab_block)
                out = (self.logits_cache[rows, vocab] if self.padded and self.logits_cache.shape[0] else
                       flat_tile(buffer, h_rows.shape[0], self._vocab_width(vocab)))  # a padded head's tiles are cached
                logits = self._logits(h_rows, vocab, out)
                block = self._row_forward(logits, rows, start, capped, fields)
                row = block if row is None else row.merge(block, self.inv_temperature)
            summary.assign(rows, row)
        return summary

    def _fill_cache(self, rows: Union[slice, Tensor], cache: Tensor) -> None:
        """``cache = hidden[rows] @ W.T (+ b)``. The matmul writes the cache itself, so no tile
        budget bounds it: one matmul, or pieces only where an operand must be cast to the logits'
        dtype (the casts stay tile-sized: token chunks of the hidden states, vocabulary blocks of the
        weight)."""
        num_rows, vocab_size = cache.shape
        token_block, vocab_block = self._tile(num_rows, self.weight.dtype)
        if self.hidden.dtype == self.dtype:
            token_block = num_rows
        if self.weight.dtype == self.dtype:
            vocab_block = vocab_size
        for row_part, slots in zip(row_chunks(rows, token_block), row_chunks(slice(0, num_rows), token_block)):
            h_rows = self.hidden[row_part]
            for start in range(0, vocab_size, vocab_block):
                vocab = slice(start, start + vocab_block)
                self._logits(h_rows, vocab, cache[slots, vocab])

    def _row_forward(self, logits: Tensor, rows: Union[slice, Tensor], start: int, capped: List[Tensor],
                     fields: Tuple[str, ...]) -> RowSummary:
        """The row op's summary of a tile of logits (the vocabulary from ``start``), read soft-capped
        through ``capped`` when there is a cap; ``has_label``: the label lies in the tile."""
        if capped:
            logits = self.transform.cap(logits, capped[0])
        local = self.labels[rows] - (self.vocab_offset + start)
        inside = (local >= 0) & (local < logits.shape[1])
        # Every row is read: a label outside the block stands in as 0, its log-prob unused.
        block = self.backend.row_forward(logits, torch.where(inside, local, 0), inv_temperature=self.inv_temperature,
                                         **row_flags(fields))
        return dataclasses.replace(block, has_label=inside)

    def backward(self, summary: RowSummary, grad_logprob: Tensor, grad_entropy: Optional[Tensor],
                 needs_grad: Tuple[bool, bool, bool], grad_accum_dtype: torch.dtype,
                 logits_cache: Optional[Tensor] = None,
                 overwrite_cache: bool = False) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """Gradients of hidden, weight and bias (None where ``needs_grad`` is False) given the
        forward's ``summary``, the per-row gradients of the log-probs and entropies (both 0 on rows
        that do not count), and the forward's ``logits_cache`` (None or empty: every row is
        recomputed). ``overwrite_cache``: the cache is not read again (the graph is not kept), so
        when it holds every active row the backward runs in it (:meth:`_backward_in_cache`).

        Rows where both are exactly 0 are skipped: no recompute, no matmul, no cache read. Tiles
        are vocabulary blocks (outer loop) times the active rows (:meth:`backward_plan`). When the
        plan takes every active row in one tile (``one_gemm``), each block's ``dW`` is one matmul
        written straight into ``dW`` in the weight's dtype (the matmul's own fp32 sum over rows; no
        accumulator, no fill, no conversion). Otherwise the rows come in token chunks and ``dW`` and
        ``db`` are summed over them in ``grad_accum_dtype``; ``dH`` is summed over vocabulary blocks
        (in that dtype too when there is more than one block)."""
        need_hidden, need_weight, need_bias = needs_grad
        hidden, weight = self.hidden, self.weight
        vocab_size, hidden_size = weight.shape
        active = grad_logprob != 0
        if grad_entropy is not None:
            active = active | (grad_entropy != 0)
        cached = logits_cache is not None and logits_cache.shape[0] > 0
        if self.policy.batch_invariant and not self.padded:  # the counted rows when cached (the cache's)
            rows = self._split_rows(self.labels >= 0 if cached else active, 0)[2]
            return padded_backward(self, rows, self._tile(0, self.weight.dtype)[0], summary, grad_logprob,
                                   grad_entropy, needs_grad, grad_accum_dtype, logits_cache, overwrite_cache)
        parts, num_active = (([(slice(0, hidden.shape[0]), slice(0, hidden.shape[0]) if cached else None)],
                              hidden.shape[0]) if self.padded else self._active_parts(active, logits_cache))
        if overwrite_cache and len(parts) == 1 and parts[0][1] is not None:
            grads = self._backward_in_cache(*parts[0], summary, grad_logprob, grad_entropy, needs_grad,
                                            grad_accum_dtype, logits_cache)
            if grads is not None:
                return grads
        plan = self.backward_plan(num_active, grad_accum_dtype)
        vocab_block = plan.vocab_block
        chunks = parts if plan.one_gemm else self._chunked(parts, self.tile_rows if self.padded else plan.token_block)
        hidden_accum = torch.promote_types(self.dtype, hidden.dtype)
        if vocab_block != vocab_size:
            hidden_accum = torch.promote_types(grad_accum_dtype, hidden_accum)

        tile_rows = num_active if plan.one_gemm else max((selection_size(rows) for rows, _ in chunks), default=0)
        # The tile buffers first: the size of the forward's, they can take that freed memory.
        buffers = [self._buffer(tile_rows, vocab_block)] + self._cap_buffers(tile_rows, vocab_block, 2)
        fuse_hidden = self.policy.fused_accumulate(hidden.device, self.dtype, hidden_accum)
        fuse_weight = self.policy.fused_accumulate(hidden.device, self.dtype, grad_accum_dtype)
        grad_hidden = hidden.new_zeros(hidden.shape, dtype=hidden_accum) if need_hidden else None
        grad_bias = weight.new_zeros(vocab_size, dtype=grad_accum_dtype) if need_bias else None
        grad_weight = None
        if need_weight:  # every block of dW is written (by its matmul or its accumulator) when a row is active
            grad_weight = torch.empty_like(weight) if chunks else torch.zeros_like(weight)
        if plan.one_gemm and chunks:
            # The active rows' hidden states in the tile's row order: a view when the parts are
            # consecutive, else gathered once (not once per vocabulary block).
            h_active = selected_rows(hidden, [rows for rows, _ in parts])
        if chunks:  # else every row has zero signal: zero gradients, no matmul
            # Each chunk's rows of the summary, selected once for every vocabulary block.
            chunk_summaries = [summary.select(rows) for rows, _ in chunks]
            block_accum = None
            if need_weight and plan.block_accumulator:
                block_accum = weight.new_empty(vocab_block, hidden_size, dtype=grad_accum_dtype)
            for start in range(0, vocab_size, vocab_block):
                vocab = slice(start, min(start + vocab_block, vocab_size))
                width = vocab.stop - start
                if need_weight and not plan.one_gemm:
                    dw = grad_weight[vocab] if block_accum is None else block_accum[:width].zero_()
                block_weight = self._block_weight(vocab) if need_hidden else None
                tile = flat_tile(buffers[0], tile_rows, width)
                offset = 0
                for index, (rows, slots) in enumerate(chunks):
                    num = selection_size(rows)
                    out = tile[offset:offset + num] if plan.one_gemm else tile[:num]
                    offset += num if plan.one_gemm else 0
                    h_rows = h_active[offset - num:offset] if plan.one_gemm else hidden[rows]
                    cached = None if slots is None else self._cached_tile(logits_cache, slots, vocab, out)
                    dlogits = self._block_grad(h_rows, rows, vocab, out, buffers[1:], cached, chunk_summaries[index],
                                               grad_logprob, grad_entropy)
                    if need_hidden:
                        add_product(grad_hidden, rows, dlogits, block_weight, fuse_hidden)
                    if need_weight and not plan.one_gemm:
                        add_chunk_product(dw, dlogits.t(), h_rows.to(self.dtype), fuse_weight,
                                           first=index == 0 and block_accum is None)
                    if need_bias:
                        grad_bias[vocab] += dlogits.sum(dim=0, dtype=grad_accum_dtype)
                if need_weight and plan.one_gemm:  # dW[block] = dz.T @ h over every active row, in W's dtype
                    with full_precision_reduction(weight.device, self.dtype):
                        torch.mm(tile.t(), h_active.to(self.dtype), out=grad_weight[vocab])
                if block_accum is not None:
                    grad_weight[vocab] = dw
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            grad_weight,
            None if grad_bias is None else grad_bias.to(weight.dtype),
        )

    def _backward_in_cache(self, rows: Union[slice, Tensor], slots: Union[slice, Tensor], summary: RowSummary,
                           grad_logprob: Tensor, grad_entropy: Optional[Tensor], needs_grad: Tuple[bool, bool, bool],
                           grad_accum_dtype: torch.dtype, logits_cache: Tensor):
        """The backward of active ``rows`` that the cache holds every one of (at ``slots``), run in
        the cache: their logits move to its first rows (only when other rows sit between them),
        turn into ``dz`` there in place, and each product is one matmul over every row::

            dH[rows] = dz @ W      dW[block] = dz[:, block].T @ h[rows]      db = dz.sum(0)

        ``dH`` over the whole vocabulary, ``dW`` written in the weight's dtype in blocks of the
        whole vocabulary (or of ``accum_bytes`` in a wider ``grad_accum_dtype``). No tile buffer
        holds ``dz``, so no logits budget cuts these matmuls small. None (the tiled backward then
        reads the cache) when the weight's dtype is not the logits' or ``grad_accum_dtype`` asks for
        sums wider than a matmul's."""
        hidden, weight = self.hidden, self.weight
        vocab_size, hidden_size = weight.shape
        num_rows = selection_size(rows)
        plan = backward_plan(num_rows, vocab_size, hidden_size, num_rows,
                             dataclasses.replace(self.policy, batch_invariant=False), weight.dtype, self.dtype,
                             grad_accum_dtype)
        if not plan.one_gemm:
            return None
        need_hidden, need_weight, need_bias = needs_grad
        if isinstance(slots, Tensor):
            self._compact(logits_cache, slots)
        dz, chunk = logits_cache[:num_rows], self._cache_chunk(num_rows)
        buffers = self._cap_buffers(chunk, vocab_size, 2)
        for part, part_slots in zip(row_chunks(rows, chunk), row_chunks(slice(0, num_rows), chunk)):
            tile = dz[part_slots]
            self._block_grad(None, part, slice(0, vocab_size), tile, buffers, tile, summary.select(part),
                             grad_logprob, grad_entropy)
        grad_hidden = grad_weight = grad_bias = None
        if need_hidden:  # the logits' dtype, at least the hidden states' (a wider weight is never cast here)
            grad_hidden = hidden.new_zeros(hidden.shape, dtype=self.dtype)
            with full_precision_reduction(hidden.device, self.dtype):
                if isinstance(rows, slice):  # a padded head's: one tile's rows at a time (row-invariant)
                    for piece in row_chunks(rows, chunk) if self.padded else [rows]:
                        torch.mm(dz[piece], weight, out=grad_hidden[piece])
                else:
                    grad_hidden.index_copy_(0, rows, torch.mm(dz, weight))
            grad_hidden = grad_hidden.to(hidden.dtype)
        if need_weight:
            grad_weight, h_rows = torch.empty_like(weight), selected_rows(hidden, [rows]).to(self.dtype)
            for start in range(0, vocab_size, plan.vocab_block):
                vocab = slice(start, start + plan.vocab_block)
                with full_precision_reduction(hidden.device, self.dtype):
                    torch.mm(dz[:, vocab].t(), h_rows, out=grad_weight[vocab])
        if need_bias:
            grad_bias = dz.sum(dim=0, dtype=grad_accum_dtype).to(weight.dtype)
        return grad_hidden, grad_weight, grad_bias

    def _compact(self, cache: Tensor, slots: Tensor) -> None:
        """Moves the cache's rows ``slots`` (ascending) to its first rows, in order, a tile at a
        time through a buffer: a chunk's sources lie at or after its own rows and after every
        earlier chunk's, so no row is overwritten before it is read."""
        count, vocab_size = slots.numel(), cache.shape[1]
        buffer = self._buffer(min(self.chunk_size, count), vocab_size)
        for rows, sources in zip(row_chunks(slice(0, count), self.chunk_size),
                                 row_chunks(slots, self.chunk_size)):
            tile = torch.index_select(cache, 0, sources, out=flat_tile(buffer, selection_size(rows), vocab_size))
            cache[rows].copy_(tile)

    def _active_parts(self, active: Tensor, logits_cache: Optional[Tensor]):
        """The ``active`` rows as ``(rows, slots)`` parts, the cached ones first (slots: their places
        in the cache; None for rows to recompute), empty parts left out, and the number of active
        rows; one read-back."""
        cache_rows = 0 if logits_cache is None else logits_cache.shape[0]
        cached, slots, recomputed = self._split_rows(active, cache_rows)
        parts = [(cached, slots), (recomputed, None)]
        parts = [(rows, part_slots) for rows, part_slots in parts if selection_size(rows)]
        return parts, sum(selection_size(rows) for rows, _ in parts)

    def _chunked(self, parts, token_block: int):
        """Each part cut into balanced chunks of at most ``token_block`` rows (slots alike)."""
        chunks = []
        for rows, slots in parts:
            rows_parts = row_chunks(rows, token_block)
            slot_parts = [None] * len(rows_parts) if slots is None else row_chunks(slots, token_block)
            chunks += list(zip(rows_parts, slot_parts))
        return chunks

    def _cached_tile(self, logits_cache: Tensor, slots: Union[slice, Tensor], vocab: slice, out: Tensor) -> Tensor:
        """The cached logits of one tile: a view of the cache for consecutive slots, else gathered
        into ``out`` (the tile's place in the buffer, which the row backward then overwrites in place)."""
        if isinstance(slots, slice):
            return logits_cache[slots, vocab]
        return torch.index_select(logits_cache[:, vocab], 0, slots, out=out)

    def _block_grad(self, h_rows, rows, vocab: slice, dlogits: Tensor, cap_buffers, cached: Optional[Tensor],
                    rows_summary: RowSummary, grad_logprob: Tensor, grad_entropy: Optional[Tensor]) -> Tensor:
        """dz for one tile (token rows x vocabulary block) in ``dlogits`` (contiguous): the row
        backward of the ``cached`` logits, or in place over the logits recomputed there. With a
        soft cap the row backward runs on the capped tile (the first of ``cap_buffers``) and the
        chain rule multiplies by the cap's derivative (the second). ``rows_summary``: the forward's
        summary of the tile's rows."""
        buffers = [None, *cap_buffers]
        logits = self._logits(h_rows, vocab, dlogits) if cached is None else cached
        row_logits = logits
        if self.transform is not None:
            derivative = self.transform.derivative(logits, buffers[2], scratch=buffers[1])
            row_logits = self.transform.cap(logits, buffers[1])
        labels = self.labels[rows] - (self.vocab_offset + vocab.start)  # ids local to the block, -1 outside it
        labels = torch.where((labels >= 0) & (labels < dlogits.shape[1]), labels, -1)
        self.backend.row_backward(
            row_logits, labels, rows_summary, grad_logprob[rows],
            grad_entropy=None if grad_entropy is None else grad_entropy[rows],
            inv_temperature=self.inv_temperature, out=row_logits if self.transform is not None else dlogits,
        )
        if self.transform is not None:
            dlogits.copy_(row_logits.mul_(derivative))
        return dlogits
