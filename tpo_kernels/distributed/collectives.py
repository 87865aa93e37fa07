"""Collectives of tpo_kernels, each logged (count_collectives) and named by purpose."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as seen by the calling rank. ``payload_bytes``: the tensor this rank puts
    in (an all-gather's input, an all-reduce's buffer); ``output_bytes``: what it gets back."""

    op: str  # "all_gather" or "all_reduce"
    purpose: str
    world_size: int
    payload_bytes: int
    output_bytes: int


class CollectiveLog(List[CollectiveRecord]):
    """The collectives one rank issued inside :func:`count_collectives`, in order."""

    def payload_bytes(self, purpose: Optional[str] = None) -> int:
        return sum(r.payload_bytes for r in self if purpose is None or r.purpose == purpose)

    def received_bytes(self, purpose: Optional[str] = None) -> int:
        """Bytes that arrive from other ranks: ``(P-1) * payload`` for an all-gather,
        ``2 (P-1) / P * payload`` for a ring all-reduce (either direction)."""
        total = 0.0
        for r in self:
            if purpose is not None and r.purpose != purpose:
                continue
            p = r.world_size
            total += (p - 1) * r.payload_bytes if r.op == "all_gather" else 2 * (p - 1) / p * r.payload_bytes
        return int(round(total))


_LOGS: List[CollectiveLog] = []


@contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Log every collective tpo_kernels issues on this rank while the block runs (forward and
    backward)."""
    log = CollectiveLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def _record(op: str, purpose: str, world: int, payload: Tensor, output: Tensor) -> None:
    if not _LOGS:
        return
    record = CollectiveRecord(op=op, purpose=purpose, world_size=world,
                              payload_bytes=payload.numel() * payload.element_size(),
                              output_bytes=output.numel() * output.element_size())
    for log in _LOGS:
        log.append(record)


def all_gather_stacked(x: Tensor, group, purpose: str) -> Tensor:
    """``[P, *x.shape]``: every rank's ``x`` (same shape everywhere), in group rank order."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty(world * x.numel())  # the concatenated form (gloo has no stacked form)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.view(-1), group=group)
    _record("all_gather", purpose, world, x, out)
    return out.view(world, *x.shape)


def all_gather_ragged(local: Tensor, sizes, group, purpose: str) -> Tensor:
    """``[sum(sizes), ...]``: every rank's ``local`` rows (``sizes[r]`` of them on rank ``r``, the
    same trailing shape everywhere) concatenated in group rank order: one all-gather of the rows
    padded to the largest count."""
    padded = local.new_zeros((max(max(sizes), 1), *local.shape[1:]))
    padded[: local.shape[0]] = local
    stacked = all_gather_stacked(padded, group, purpose)
    return torch.cat([stacked[r, :n] for r, n in enumerate(sizes)])


def all_reduce_sum(x: Tensor, group, purpose: str) -> Tensor:
    """In-place sum of ``x`` over the group (the only float all-reduce: ``dH`` of the fused path)."""
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    _record("all_reduce", purpose, dist.get_world_size(group), x, x)
    return x
