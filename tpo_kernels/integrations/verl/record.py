"""The record of a mini-batch, and the micro-batch rows it serves: what the ``tpo`` policy loss reads
of :mod:`.mini_batch`'s mechanism (which fills it from verl's engine), apart from it, so that the
loss and the engine glue import it and not each other.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor

from ... import kit

ROW_FIELD = "tpo_row"  # the mini-batch row's index in the record, carried through verl's micro-batching


@dataclass(frozen=True)
class MiniBatchRecord:
    """Every response of one mini-batch over the data-parallel ranks (rank order), detached, on
    the CPU: ``group_ids`` (-1: no counted token), ``scores`` (u), ``seq_logprobs`` (the summed
    current log-probs of its counted tokens), ``old_seq_logprobs`` (the same for
    ``old_log_prob``), ``num_tokens`` (its counted tokens); all ``[N]``, float64 but the int64
    ids and counts. ``dp_size``: the ranks it was gathered over. ``member_ids``: the group every
    response belongs to, counted or not (:func:`.advantage.decode_members`; -1 where unknown), or
    None (then ``group_ids`` stand for them). ``weights``: each response's importance weight
    (verl's ``rollout_is_weights``, read by :func:`.advantage.response_weights`), or None."""

    group_ids: Tensor
    scores: Tensor
    seq_logprobs: Tensor
    old_seq_logprobs: Tensor
    num_tokens: Tensor
    dp_size: int
    member_ids: Optional[Tensor] = None
    weights: Optional[Tensor] = None

    @property
    def num_groups(self) -> int:
        """The groups of the mini-batch: those its responses belong to (a group whose every
        response was rejected counts, with loss 0, as under verl's ``global_batch_size``)."""
        members = self.group_ids if self.member_ids is None else self.member_ids
        return int(torch.unique(members[members >= 0]).numel())


def gather_record(group_ids: Tensor, scores: Tensor, log_prob: Tensor, old_log_prob: Tensor, mask: Tensor,
                  process_group=None, member_ids: Optional[Tensor] = None,
                  weights: Optional[Tensor] = None) -> Tuple[MiniBatchRecord, int]:
    """``(record, offset)``: the record of this rank's mini-batch rows (``[B]`` ids and scores as
    the policy loss decodes them, ``[B, T]`` current and old token log-probs, response mask, and
    optionally ``[B]`` member groups and importance weights) gathered over ``process_group``
    (None: this rank alone), and where this rank's rows start."""
    mask = mask.bool()
    members = group_ids if member_ids is None else member_ids
    local = torch.stack([
        group_ids.to(torch.float64), scores.to(torch.float64),
        (log_prob.detach().to(torch.float64) * mask).sum(1), (old_log_prob.detach().to(torch.float64) * mask).sum(1),
        mask.sum(1).to(torch.float64), members.to(mask.device, torch.float64),
        (torch.full((len(mask),), float("nan"), dtype=torch.float64, device=mask.device) if weights is None
         else weights.to(mask.device, torch.float64)),
    ], dim=1)
    gathered = kit.gather_rows(local, process_group, purpose="mini_batch_record")
    rows = gathered.rows.cpu()  # one transfer
    record = MiniBatchRecord(group_ids=rows[:, 0].to(torch.int64), scores=rows[:, 1], seq_logprobs=rows[:, 2],
                             old_seq_logprobs=rows[:, 3], num_tokens=rows[:, 4].to(torch.int64),
                             dp_size=len(gathered.sizes), member_ids=rows[:, 5].to(torch.int64),
                             weights=None if weights is None else rows[:, 6])
    return record, gathered.offset


_RECORDED: contextvars.ContextVar[Optional[Tuple[MiniBatchRecord, Tensor]]] = contextvars.ContextVar(
    "tpo_recorded_rows", default=None)


@contextlib.contextmanager
def recorded_rows(record: MiniBatchRecord, rows: Tensor) -> Iterator[None]:
    """Within the block, the ``tpo`` policy loss trains the micro-batch whose rows are ``rows``
    (``[b]`` indices into ``record``, in the micro-batch's row order) exactly, taking its groups'
    other members from ``record``."""
    token = _RECORDED.set((record, rows.detach().to(torch.int64).cpu()))
    try:
        yield
    finally:
        _RECORDED.reset(token)


def current_rows() -> Optional[Tuple[MiniBatchRecord, Tensor]]:
    """``(record, rows)`` inside :func:`recorded_rows`, else None."""
    return _RECORDED.get()
