"""``tpo_kernels::linear_logprobs``: per-token log-probs (and entropies) of
``z = hidden @ weight.T (+ bias)`` as a ``torch.library`` custom op, the logits never materialized.

The tiled head (:class:`~tpo_kernels.ops.linear_head.TiledLinearHead`) does the work, forward and
backward; this module registers the forward op and two backward ops (each with a fake
implementation): ``linear_logprobs_backward``, which leaves the logits cache as it is, and
``linear_logprobs_backward_``, which may overwrite it with ``dz``; the autograd rule that joins
them (it saves the forward's :class:`~tpo_kernels.backends.rows.RowSummary`, through its
``to_op`` / ``from_op``, and the logits cache, and takes the second backward only when nothing
reads the cache again: an eager backward that keeps no graph); and :func:`linear_logprobs`, which
keeps the logits cache only when a gradient will be taken, as the policy's budget for the
vocabulary says (:meth:`TilePolicy.logits_cache_budget`).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..backends.rows import RowRequest, RowSummary, compute_dtype, op_outputs, row_gradients
from ..backends import backend_by_key
from ._tags import host_sync_tags
from .linear_head import TiledLinearHead
from .padded_rows import padded_count
from .tiles import HeadTiles, TilePolicy, invariant_tile_shape

__all__ = ["HeadTiles", "TilePolicy", "linear_logprobs"]


def _policy(min_tile_tokens: int, accum_bytes: int, matmul_out_dtype: Optional[bool],
            logits_cache_bytes: int = 0, batch_invariant: bool = False) -> TilePolicy:
    """The tile policy from the op's settings (its tile budget is the chunk size the op takes)."""
    return TilePolicy(logits_bytes=0, min_tile_tokens=min_tile_tokens, accum_bytes=accum_bytes,
                      matmul_out_dtype=matmul_out_dtype, logits_cache_bytes=logits_cache_bytes,
                      batch_invariant=batch_invariant)


def _head(inputs: Tuple[Tensor, Tensor, Optional[Tensor], Tensor], request: RowRequest, tiles: HeadTiles,
          backend: str, cache_candidates: Optional[Tensor] = None) -> TiledLinearHead:
    """The tiled head over ``inputs = (hidden, weight, bias, labels)``."""
    inv_t, transform = request.transform()
    return TiledLinearHead(*inputs, backend_by_key(backend), inv_t, tiles, transform=transform,
                           cache_candidates=cache_candidates)


def _logits_dtype(hidden: Tensor, weight: Tensor, head_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype the head forms its logits in: the inputs', promoted with ``head_dtype``."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    return dtype if head_dtype is None else torch.promote_types(dtype, head_dtype)


# Reads back the counts of its row classes (one tolist), validate or not: no CUDA-graph capture.
@torch.library.custom_op("tpo_kernels::linear_logprobs", mutates_args=(), **host_sync_tags())
def _linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, request: List[float],
                     chunk_size: int, min_tile_tokens: int, accum_bytes: int, grad_accum_dtype: torch.dtype,
                     backend: str, matmul_out_dtype: Optional[bool] = None, logits_cache_bytes: int = 0,
                     cache_candidates: Optional[Tensor] = None, batch_invariant: bool = False,
                     head_dtype: Optional[torch.dtype] = None) -> op_outputs(extra=1):
    row = RowRequest.from_op(request)
    policy = _policy(min_tile_tokens, accum_bytes, matmul_out_dtype, logits_cache_bytes, batch_invariant)
    tiles = HeadTiles(chunk_size=chunk_size, policy=policy, grad_accum_dtype=grad_accum_dtype, head_dtype=head_dtype)
    head = _head((hidden, weight, bias, labels), row, tiles, backend, cache_candidates)
    summary = head.forward(row.token_fields, _cache_rows(head.policy, hidden, weight, head_dtype, chunk_size))
    # A label >= V (validate=False checks none) lies in no tile, whose row ops read it as column 0:
    # its row's results become NaN, as the row ops' are (DESIGN.md, "Ids outside the vocabulary");
    # has_label is already False there.
    beyond = labels >= weight.shape[0]
    # The logits cache: an output, so that autograd can save it.
    return (*summary.masked_fill(beyond, float("nan")).to_op(), head.logits_cache)


def _cache_rows(policy: TilePolicy, hidden: Tensor, weight: Tensor, head_dtype: Optional[torch.dtype],
                chunk_size: int) -> int:
    """Rows of the logits cache; under ``batch_invariant`` (every row or none) padded to the tiles'."""
    dtype = _logits_dtype(hidden, weight, head_dtype)
    rows = policy.logits_cache_rows(hidden.shape[0], weight.shape[0], dtype)
    if policy.batch_invariant and rows:
        rows = padded_count(rows, invariant_tile_shape(*weight.shape, chunk_size, policy, weight.dtype, weight.dtype,
                                                       dtype)[0])
    return rows


@_linear_logprobs.register_fake
def _(hidden, weight, bias, labels, request, chunk_size, min_tile_tokens, accum_bytes, grad_accum_dtype, backend,
      matmul_out_dtype=None, logits_cache_bytes=0, cache_candidates=None, batch_invariant=False, head_dtype=None):
    rows, dtype = hidden.shape[0], _logits_dtype(hidden, weight, head_dtype)
    acc = compute_dtype(dtype)
    policy = TilePolicy(logits_bytes=0, min_tile_tokens=min_tile_tokens, logits_cache_bytes=logits_cache_bytes,
                        batch_invariant=batch_invariant)
    summary = RowSummary.zeros(rows, dtype=acc, device=hidden.device,
                               fields=RowRequest.from_op(request).token_fields)
    cache_rows = _cache_rows(policy, hidden, weight, head_dtype, chunk_size)
    return (*summary.to_op(), hidden.new_empty(cache_rows, weight.shape[0], dtype=dtype))


def _backward_fake(hidden, weight, bias, labels, summary, grad_logprobs, grad_entropy, logits_cache, cache_candidates,
                   needs_hidden, needs_weight, needs_bias, *settings):
    return (torch.empty_like(hidden) if needs_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if needs_weight else hidden.new_empty(0),
            weight.new_empty(weight.shape[0]) if needs_bias else hidden.new_empty(0))


def _backward_op(name: str, overwrite_cache: bool):
    """The backward op ``name``. Both read back the counts of their row classes (one tolist),
    validate or not: no CUDA-graph capture. Without ``overwrite_cache`` the logits cache is left as
    it is (a kept graph, torch.compile); with it the op may turn the cache into dz in place
    (TiledLinearHead._backward_in_cache), so its schema declares the mutation."""

    @torch.library.custom_op(name, mutates_args=("logits_cache",) if overwrite_cache else (), **host_sync_tags())
    def backward(
        hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, summary: List[Tensor],
        grad_logprobs: Tensor, grad_entropy: Optional[Tensor], logits_cache: Tensor,
        cache_candidates: Optional[Tensor], needs_hidden: bool, needs_weight: bool, needs_bias: bool,
        request: List[float], chunk_size: int, min_tile_tokens: int, accum_bytes: int,
        grad_accum_dtype: torch.dtype, backend: str, matmul_out_dtype: Optional[bool],
        batch_invariant: bool = False, head_dtype: Optional[torch.dtype] = None,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        policy = _policy(min_tile_tokens, accum_bytes, matmul_out_dtype, batch_invariant=batch_invariant)
        tiles = HeadTiles(chunk_size=chunk_size, policy=policy, grad_accum_dtype=grad_accum_dtype,
                          head_dtype=head_dtype)
        head = _head((hidden, weight, bias, labels), RowRequest.from_op(request), tiles, backend, cache_candidates)
        # The entropy is read only with its gradient.
        row_summary = RowSummary.from_op(summary, fields=() if grad_entropy is None else ("entropy",))
        grads = head.backward(row_summary, grad_logprobs, grad_entropy, (needs_hidden, needs_weight, needs_bias),
                              grad_accum_dtype, logits_cache, overwrite_cache)
        # A custom op returns tensors only: an empty one stands for "not requested".
        return tuple(hidden.new_empty(0) if grad is None else grad for grad in grads)

    backward.register_fake(_backward_fake)
    return backward


_linear_logprobs_backward = _backward_op("tpo_kernels::linear_logprobs_backward", overwrite_cache=False)
_linear_logprobs_backward_overwriting = _backward_op("tpo_kernels::linear_logprobs_backward_", overwrite_cache=True)


def _graph_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph``, ``create_graph``): then a
    later backward reads the saved logits cache again. Unknown (torch without the query) counts as
    kept."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


def _setup_context(ctx, inputs, output):
    (hidden, weight, bias, labels, request, chunk_size, min_tile_tokens, accum_bytes, grad_accum_dtype, backend,
     matmul_out_dtype, logits_cache_bytes, cache_candidates, batch_invariant, head_dtype) = inputs
    *summary, logits_cache = output  # the RowSummary's to_op tensors, then the cache
    ctx.save_for_backward(hidden, weight, bias, labels, logits_cache, cache_candidates, *summary)
    ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
    # The backward ops' settings, in their schema's order.
    ctx.settings = (request, chunk_size, min_tile_tokens, accum_bytes, grad_accum_dtype, backend, matmul_out_dtype,
                    batch_invariant, head_dtype)
    ctx.fields, ctx.has_bias = RowRequest.from_op(request).token_fields, bias is not None


def _backward(ctx, *output_grads):
    hidden, weight, bias, labels, logits_cache, cache_candidates, *saved = ctx.saved_tensors
    summary = RowSummary.from_op(saved, fields=ctx.fields)
    # Of each output, None where none arrived; the last output is the logits cache.
    summary_grads = RowSummary.from_op(output_grads[:-1], fields=ctx.fields)
    grad_logprobs, grad_entropy = row_gradients(labels >= 0, summary, summary_grads.label_logprob,
                                                summary_grads.entropy)
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
    # The cache is read by this backward only unless the graph is kept. Traced (torch.compile,
    # AOT: functional or fake tensors), an in-place op would work on a copy: the cache stays as it is.
    overwrite = (logits_cache.numel() > 0 and type(logits_cache) is Tensor and not torch.compiler.is_compiling()
                 and not _graph_kept())
    backward_op = _linear_logprobs_backward_overwriting if overwrite else _linear_logprobs_backward
    grads = backward_op(hidden, weight, bias, labels, saved, grad_logprobs, grad_entropy, logits_cache,
                        cache_candidates, *needs, *ctx.settings)
    grads = [grad if need else None for grad, need in zip(grads, needs)]
    return (*grads,) + (None,) * (len(ctx.needs_input_grad) - 3)  # labels, the settings and the candidates


_linear_logprobs.register_autograd(_backward, setup_context=_setup_context)


def linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, *,
                    request: RowRequest, tiles: "HeadTiles", backend: str,
                    cache_candidates: Optional[Tensor] = None) -> RowSummary:
    """The :class:`RowSummary` of ``softcap(scale * (hidden [M, H] @ weight.T (+ bias)))`` tempered
    (the request's :class:`tpo_kernels.backends.rows.LogitTransform`) for int64 ``labels``
    (negative: skipped), in the compute dtype, with the per-token fields the request asks for;
    differentiable in hidden, weight, bias. ``tiles``: how the head cuts its work (its
    ``head_dtype``, its policy's ``batch_invariant``). The policy's
    logits cache is kept only when a gradient will be taken, for the counted rows among
    ``cache_candidates`` (``[M]`` bool; None: every counted row) that fit it."""
    policy = tiles.policy
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    cache_bytes = policy.logits_cache_budget(weight.shape[0]) if wants_grad else 0
    *summary, _ = _linear_logprobs(hidden, weight, bias, labels, request.to_op(), tiles.chunk_size,
                                   policy.min_tile_tokens, policy.accum_bytes, tiles.grad_accum_dtype, backend,
                                   policy.matmul_out_dtype, cache_bytes, cache_candidates if cache_bytes else None,
                                   policy.batch_invariant, tiles.head_dtype)
    return RowSummary.from_op(summary, fields=request.token_fields)
