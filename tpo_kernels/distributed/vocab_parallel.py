"""Vocabulary-parallel heads and logits: per-token partials merged across ranks in rank order."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..backends import backend_by_key
from ..ops.linear import TiledLinearHead, TilePolicy, merge_blocks
from ..ops.logprobs import row_gradients

from .collectives import _check_group, all_gather_stacked, all_reduce_sum



@dataclass(frozen=True)
class VocabShard:
    """This rank's contiguous slice ``[start, start + size)`` of a vocabulary of ``vocab_size``
    ids, split over ``group``."""

    group: object
    start: int
    size: int
    vocab_size: int


def _dtensor_type():
    # A DTensor can only exist once torch.distributed.tensor has been imported: avoid importing it.
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def _is_dtensor(x) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(x, cls)


def _dtensor_shard(name: str, x, dim: int, group, start: Optional[int]) -> Tuple[Tensor, VocabShard]:
    """The local shard of a DTensor sharded along ``dim`` (the vocabulary) on one mesh
    dimension and replicated on the others."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415

    dim = dim % x.dim()
    mesh, placements = x.device_mesh, x.placements
    sharded = [i for i, p in enumerate(placements) if type(p) is Shard and p.dim == dim]
    others_ok = all(isinstance(p, Replicate) for i, p in enumerate(placements) if i not in sharded)
    if len(sharded) != 1 or not others_ok:
        raise ValueError(
            f"{name} as a DTensor must be sharded on the vocabulary (dim {dim}) over one mesh dimension and "
            f"replicated on the others, got placements {placements}"
        )
    mesh_dim = sharded[0]
    mesh_group = mesh.get_group(mesh_dim)
    if group is not None and group is not mesh_group:
        raise ValueError(f"vocab_parallel_group differs from the mesh dimension {name} is sharded over")
    world, coord, vocab = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim), x.shape[dim]
    chunk = -(-vocab // world)  # DTensor's Shard splits like torch.chunk
    shard_start = min(coord * chunk, vocab)
    local = x.to_local()
    if local.shape[dim] != min(chunk, vocab - shard_start):
        raise ValueError(f"{name}: unexpected DTensor shard size {local.shape[dim]} for {vocab} ids over {world} ranks")
    if start is not None and start != shard_start:
        raise ValueError(f"vocab_start_index={start} but {name}'s DTensor shard starts at {shard_start}")
    return local, VocabShard(mesh_group, shard_start, local.shape[dim], vocab)


def vocab_shard(name: str, x, group, start, dim: int = -1) -> Tuple[Tensor, Optional[VocabShard]]:
    """Resolve a possibly vocabulary-sharded input: ``(local tensor, shard or None)``.

    A DTensor sharded along ``dim`` gives its local shard and its mesh dimension's group. A plain
    tensor with ``group`` is this rank's contiguous shard; shards are ordered by group rank
    (offset = sizes of the lower ranks) unless ``start`` gives the offset. Shard sizes (and the
    offsets) are all-gathered once, and the shards must tile ``[0, V)``."""
    if _is_dtensor(x):
        return _dtensor_shard(name, x, dim, group, start)
    if group is None:
        if start is not None:
            raise ValueError("vocab_start_index needs vocab_parallel_group")
        return x, None
    _check_group("vocab_parallel_group", group)
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
        raise ValueError(f"vocab_start_index must be an int >= 0 or None, got {start!r}")
    size = x.shape[dim]
    if size == 0:
        raise ValueError(f"{name} must hold at least one vocabulary entry on every rank")
    meta = torch.tensor([size, -1 if start is None else start], dtype=torch.int64, device=x.device)
    shards = all_gather_stacked(meta, group, "vocab_shards").tolist()
    explicit = [s for _, s in shards]
    if (start is None) != (explicit[0] == -1) or any((s == -1) != (explicit[0] == -1) for s in explicit):
        raise ValueError("vocab_start_index must be given on every rank of vocab_parallel_group or on none")
    if explicit[0] == -1:
        explicit = [sum(n for n, _ in shards[:r]) for r in range(len(shards))]
    spans = sorted(zip(explicit, (n for n, _ in shards)))
    vocab = sum(n for _, n in spans)
    if [s for s, _ in spans] != [sum(n for _, n in spans[:i]) for i in range(len(spans))]:
        raise ValueError(f"vocabulary shards (start, size) must tile [0, {vocab}) without gaps or overlap, got {spans}")
    rank = dist.get_rank(group)
    return x, VocabShard(group, explicit[rank], size, vocab)


def _merge_partials(stats: Tensor, logprob: Tensor, entropy: Optional[Tensor], owned: Tensor, counted: Tensor,
                    shard: VocabShard, inv_temperature: float) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Per-token ``(stats [2, M], logprob, entropy | None)`` over the whole vocabulary from every
    rank's shard summary (row max, log-sum, label log-prob where the shard owns the label,
    entropy): one all-gather of ``[C, M]``, merged in rank order with the same exact block merge
    the fused-linear path uses across vocabulary blocks, so every rank gets the same bits."""
    parts = [stats[0], stats[1], logprob, owned.to(stats.dtype)] + ([] if entropy is None else [entropy])
    gathered = all_gather_stacked(torch.stack(parts), shard.group, "partials")  # [P, C, M]

    def summary(rank):
        g = gathered[rank]
        return g[0], g[1], g[2], (None if entropy is None else g[4]), g[3] != 0

    row = summary(0)
    for rank in range(1, gathered.shape[0]):
        row = merge_blocks(row, summary(rank), inv_temperature)
    merged_stats = torch.stack([torch.where(counted, row[0], 0.0), torch.where(counted, row[1], 0.0)])
    merged_entropy = None if entropy is None else torch.where(counted, row[3], 0.0)
    return merged_stats, torch.where(counted, row[2], 0.0), merged_entropy


def _shard_labels(labels: Tensor, shard: VocabShard) -> Tuple[Tensor, Tensor]:
    """``(owned, local)``: whether this shard holds the label, and its id in the shard."""
    local = labels - shard.start
    owned = (labels >= 0) & (local >= 0) & (local < shard.size)
    return owned, local


class _VocabParallelLogprobs(torch.autograd.Function):
    """Token log-probs (and entropies) of vocabulary-sharded ``[M, V_r]`` logits."""

    @staticmethod
    def forward(ctx, logits, labels, shard, inv_temperature, with_entropy, inplace_backward, key):
        counted = labels >= 0
        owned, local = _shard_labels(labels, shard)
        # Every counted row is read (label 0 stands in when another shard owns it).
        read_labels = torch.where(counted, torch.where(owned, local, 0), -1)
        stats, logprob, entropy = backend_by_key(key).row_forward(
            logits, read_labels, inv_temperature=inv_temperature, with_entropy=with_entropy
        )
        stats, logprob, entropy = _merge_partials(stats, logprob, entropy, owned, counted, shard, inv_temperature)
        grad_labels = torch.where(owned, local, -1)
        ctx.save_for_backward(logits, grad_labels, counted, stats, logprob, entropy if with_entropy else None)
        ctx.settings = (inv_temperature, with_entropy, inplace_backward, key)
        return logprob, entropy if with_entropy else logprob.new_empty(0)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, grad_labels, counted, stats, logprob, entropy = ctx.saved_tensors
        inv_temperature, with_entropy, inplace_backward, key = ctx.settings
        grad_logprobs, grad_entropy, entropy = row_gradients(counted, logprob, entropy, grad_logprobs, grad_entropy,
                                                             with_entropy)
        args = (grad_labels, stats, logprob, grad_logprobs, grad_entropy, entropy, inv_temperature, key)
        if inplace_backward:
            torch.ops.tpo_kernels.logprobs_backward_(logits, *args)
            grad = logits
        else:
            grad = torch.ops.tpo_kernels.logprobs_backward(logits, *args)
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: Tensor, labels: Tensor, shard: VocabShard, *, inv_temperature: float,
                            with_entropy: bool, inplace_backward: bool,
                            backend: str) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`tpo_kernels.ops.token_logprobs` of this rank's ``[M, V_r]`` logits shard: the same
    ``(logprobs [M], entropy [M] | None)`` on every rank of the shard's group, over the whole
    vocabulary. The logits gradient is local to the shard (no collective)."""
    logprobs, entropy = _VocabParallelLogprobs.apply(logits, labels, shard, inv_temperature, with_entropy,
                                                     inplace_backward, backend)
    return logprobs, (entropy if with_entropy else None)


class _VocabParallelLinearLogprobs(torch.autograd.Function):
    """Token log-probs (and entropies) of ``hidden @ weight_shard.T (+ bias_shard)``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, shard, inv_temperature, with_entropy, chunk_size, policy,
                grad_accum_dtype, key):
        head = TiledLinearHead(hidden, weight, bias, labels, backend_by_key(key), inv_temperature, chunk_size,
                               policy, vocab_offset=shard.start)
        stats, logprob, entropy = head.forward(with_entropy)
        owned, _ = _shard_labels(labels, shard)
        stats, logprob, entropy = _merge_partials(stats, logprob, entropy, owned, labels >= 0, shard, inv_temperature)
        ctx.save_for_backward(hidden, weight, bias, labels, stats, logprob, entropy if with_entropy else None)
        ctx.settings = (shard, inv_temperature, with_entropy, chunk_size, policy, grad_accum_dtype, key)
        return logprob, entropy if with_entropy else logprob.new_empty(0)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, stats, logprob, entropy = ctx.saved_tensors
        shard, inv_temperature, with_entropy, chunk_size, policy, grad_accum_dtype, key = ctx.settings
        counted = labels >= 0
        grad_logprobs, grad_entropy, entropy = row_gradients(counted, logprob, entropy, grad_logprobs, grad_entropy,
                                                             with_entropy)
        head = TiledLinearHead(hidden, weight, bias, labels, backend_by_key(key), inv_temperature, chunk_size,
                               policy, vocab_offset=shard.start)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        grad_hidden, grad_weight, grad_bias = head.backward(stats, logprob, grad_logprobs, grad_entropy, entropy,
                                                            needs, grad_accum_dtype)
        if grad_hidden is not None:  # every shard's contribution to dH
            all_reduce_sum(grad_hidden, shard.group, "hidden_grad")
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def vocab_parallel_linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                                   shard: VocabShard, *, inv_temperature: float, with_entropy: bool,
                                   chunk_size: int, policy: TilePolicy, grad_accum_dtype: torch.dtype,
                                   backend: str) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`tpo_kernels.ops.linear_logprobs` with this rank's vocabulary shard of the head:
    the same ``(logprobs [M], entropy [M] | None)`` on every rank of the shard's group. Backward:
    ``dW`` / ``db`` of the shard, and ``dH`` summed over the group (one all-reduce)."""
    logprobs, entropy = _VocabParallelLinearLogprobs.apply(
        hidden, weight, bias, labels, shard, inv_temperature, with_entropy, chunk_size, policy,
        grad_accum_dtype, backend,
    )
    return logprobs, (entropy if with_entropy else None)


def vocab_parallel_head(hidden, weight, bias, group, start):
    """``(hidden, weight, bias, shard | None)``: the local tensors of an lm_head that may be
    split on the vocabulary (a plain shard with ``group``, or DTensors sharded on dim 0)."""
    weight, shard = vocab_shard("weight", weight, group, start, dim=0)
    if shard is None:
        return hidden, weight, bias, None
    hidden = replicated_local("hidden", hidden)
    if _is_dtensor(bias):
        bias, bias_shard = _dtensor_shard("bias", bias, 0, None, None)
        if (bias_shard.start, bias_shard.size) != (shard.start, shard.size):
            raise ValueError("bias must be sharded on the vocabulary like weight")
    return hidden, weight, bias, shard


def replicated_local(name: str, x):
    """A DTensor replicated on every mesh dimension (e.g. hidden states next to a
    vocabulary-sharded head) as its local tensor; anything else unchanged."""
    if not _is_dtensor(x):
        return x
    from torch.distributed.tensor import Replicate  # noqa: PLC0415

    if not all(isinstance(p, Replicate) for p in x.placements):
        raise ValueError(f"{name} as a DTensor must be replicated (the tokens of every vocabulary shard), "
                         f"got placements {x.placements}")
    return x.to_local()
