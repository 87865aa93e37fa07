"""The vocabulary of a call, resolved before any check that needs its size and without any
collective: a DTensor's local shard and mesh group, or a plain tensor's shard of
``vocab_parallel_group`` (:class:`ShardRequest`). The ranks then exchange their requests with their
checks and place the shards (:meth:`tpo_kernels.distributed.VocabShard.place`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from torch import Tensor

from ..checks import placement
from .call import is_dtensor  # plan/call.py imports this module only for a sharded vocabulary


def dtensor_vocab_group(x, dim: int):
    """The process group of the mesh dimension a DTensor is sharded over along ``dim`` (the
    first such one), or None; no check (the group a rank reports a failed check on)."""
    from torch.distributed.tensor import Shard  # noqa: PLC0415

    dim = dim % x.dim()
    for mesh_dim, p in enumerate(x.placements):
        if type(p) is Shard and p.dim == dim:
            return x.device_mesh.get_group(mesh_dim)
    return None


def _dtensor_shard(name: str, x, dim: int, group, start: Optional[int]) -> Tuple[Tensor, "ShardRequest"]:
    """The local shard of a DTensor sharded along ``dim`` (the vocabulary) on one mesh
    dimension and replicated on the others."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415

    dim = dim % x.dim()
    mesh, placements = x.device_mesh, x.placements
    sharded = [i for i, p in enumerate(placements) if type(p) is Shard and p.dim == dim]
    others = all(isinstance(p, Replicate) for i, p in enumerate(placements) if i not in sharded)
    placement.check_dtensor_vocab(name, dim, placements, sharded, others)
    mesh_dim = sharded[0]
    mesh_group = mesh.get_group(mesh_dim)
    world, coord, vocab = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim), x.shape[dim]
    chunk = -(-vocab // world)  # DTensor's Shard splits like torch.chunk
    shard_start = min(coord * chunk, vocab)
    local = x.to_local()
    placement.check_dtensor_shard(name, group, mesh_group, start, shard_start, local.shape[dim],
                                  min(chunk, vocab - shard_start), vocab, world)
    return local, ShardRequest(mesh_group, local.shape[dim], shard_start)


def vocab_shard(name: str, x, group, start, dim: int = -1) -> Tuple[Tensor, Optional["ShardRequest"]]:
    """Resolve a possibly vocabulary-sharded input without any collective: ``(local tensor,
    shard request or None)``. A DTensor sharded along ``dim`` gives its local shard, its mesh
    dimension's group and its offset; a plain tensor with ``group`` is this rank's contiguous
    shard, at ``start`` or (None) after the lower ranks' shards. The pipeline exchanges every
    rank's request with its checks and then places the shards (:meth:`VocabShard.place`)."""
    start = placement.check_vocab_start_index(start, group) if not is_dtensor(x) else start
    if is_dtensor(x):
        return _dtensor_shard(name, x, dim, group, start)
    if group is None:
        return x, None
    placement.check_group("vocab_parallel_group", group)
    placement.check_shard_size(name, x, dim)
    return x, ShardRequest(group, x.shape[dim], start)


@dataclass(frozen=True)
class ShardRequest:
    """This rank's shard before the ranks have agreed: its group, size and start (None: after
    the lower ranks' shards)."""

    group: object
    size: int
    start: Optional[int]


def vocab_parallel_head(hidden, weight, bias, group, start):
    """``(hidden, weight, bias, shard request | None)``: the local tensors of an lm_head that may
    be split on the vocabulary (a plain shard with ``group``, or DTensors sharded on dim 0)."""
    weight, shard = vocab_shard("weight", weight, group, start, dim=0)
    if shard is None:
        return hidden, weight, bias, None
    hidden = replicated_local("hidden", hidden)
    if is_dtensor(bias):
        bias, bias_shard = _dtensor_shard("bias", bias, 0, None, None)
        placement.check_bias_shard((bias_shard.start, bias_shard.size), (shard.start, shard.size))
    return hidden, weight, bias, shard


def replicated_local(name: str, x):
    """A DTensor replicated on every mesh dimension (e.g. hidden states next to a
    vocabulary-sharded head) as its local tensor; anything else unchanged."""
    if not is_dtensor(x):
        return x
    from torch.distributed.tensor import Replicate  # noqa: PLC0415

    placement.check_replicated(name, x.placements, all(isinstance(p, Replicate) for p in x.placements))
    return x.to_local()
