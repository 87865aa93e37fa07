"""Batch layout: which flat token belongs to which completion, and which completion to which group.

Every path flattens tokens to ``M`` rows (padded ``[N, T]`` -> ``M = N*T``; packed: the rows given,
split by ``cu_seqlens``). Completion ``n`` owns rows ``[seq_start[n], seq_start[n] + seq_len[n])``.
Groups are listed as ``group_members[group_offsets[g]:group_offsets[g+1]]`` (completion indices in
ascending order), so both contiguous ``group_size`` batches and arbitrary ``group_ids`` share one
description. Group ``g`` of ``group_ids`` is the g-th smallest distinct id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor


@dataclass
class BatchLayout:
    num_tokens: int  # M, rows of the flat token matrix
    num_seqs: int  # N
    num_groups: int  # G
    seq_start: Tensor  # [N] int64, first row of each completion
    seq_len: Tensor  # [N] int64
    max_seq_len: int
    token_seq: Tensor  # [M] int64, completion of each row, -1 for rows outside every completion
    seq_group: Tensor  # [N] int64, group of each completion
    group_offsets: Tensor  # [G+1] int64
    group_members: Tensor  # [N] int64, completions sorted by group (stable)
    max_group_size: int
    group_size: Optional[int]  # K when every group is K contiguous completions, else None
    padded_len: Optional[int]  # T for a padded [N, T] batch, None for packed

    def op_args(self) -> tuple:
        """The layout as the tensors and ints a custom op can take (see :meth:`from_op_args`)."""
        return (
            self.seq_start, self.seq_len, self.token_seq, self.seq_group, self.group_offsets,
            self.group_members, self.num_groups, self.max_seq_len, self.max_group_size,
            self.group_size or 0, self.padded_len or 0,
        )

    @classmethod
    def from_op_args(cls, seq_start, seq_len, token_seq, seq_group, group_offsets, group_members,
                     num_groups, max_seq_len, max_group_size, group_size, padded_len) -> "BatchLayout":
        return cls(
            num_tokens=token_seq.numel(), num_seqs=seq_start.numel(), num_groups=num_groups,
            seq_start=seq_start, seq_len=seq_len, max_seq_len=max_seq_len, token_seq=token_seq,
            seq_group=seq_group, group_offsets=group_offsets, group_members=group_members,
            max_group_size=max_group_size, group_size=group_size or None, padded_len=padded_len or None,
        )


def build_layout(
    num_tokens: int,
    device: torch.device,
    *,
    padded_shape: Optional[tuple] = None,
    cu_seqlens: Optional[Tensor] = None,
    packed_extent: Optional[Tuple[int, int]] = None,
    group_size: Optional[int] = None,
    group_ids: Optional[Tensor] = None,
    members: Optional[Tensor] = None,
) -> BatchLayout:
    """Build the layout from a padded ``(N, T)`` shape or packed ``cu_seqlens`` (already validated)
    with its ``packed_extent``: the rows covered (``cu_seqlens[-1]``) and the longest completion,
    host ints the caller reads back together with its checks (read here when not given).

    Read-backs: none with ``group_size``; two with ``group_ids`` (the number of groups and the
    largest); three with ``members`` (the kept completions, the groups, the largest).

    ``members`` (``[N]`` bool) leaves completions out of every group: they get no probability
    mass and no gradient (completions with no counted token). A group left with no member is
    dropped."""
    if padded_shape is not None:
        n, t = padded_shape
        seq_start = torch.arange(n, device=device, dtype=torch.int64) * t
        seq_len = torch.full((n,), t, device=device, dtype=torch.int64)
        token_seq = torch.arange(n, device=device, dtype=torch.int64).repeat_interleave(t)
        max_seq_len = t
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        n = cu.numel() - 1
        seq_start = cu[:-1].contiguous()
        seq_len = (cu[1:] - cu[:-1]).contiguous()
        token_seq = torch.full((num_tokens,), -1, device=device, dtype=torch.int64)
        if packed_extent is None:  # one read-back; the public functions pass it with their checks
            packed_extent = torch.stack([cu[-1], seq_len.max()]).tolist() if n > 0 else (int(cu[-1]), 0)
        covered, max_seq_len = packed_extent
        token_seq[:covered] = torch.arange(n, device=device, dtype=torch.int64).repeat_interleave(
            seq_len, output_size=covered
        )

    if members is not None:
        ids = group_ids.to(device) if group_ids is not None else torch.arange(n, device=device) // group_size
        kept = torch.nonzero(members.to(device)).squeeze(1)
        _, kept_group, counts = torch.unique(ids[kept], sorted=True, return_inverse=True, return_counts=True)
        seq_group = torch.zeros(n, device=device, dtype=torch.int64)  # 0 for the left-out: p = q = 0
        seq_group[kept] = kept_group.to(torch.int64)
        g = counts.numel()
        group_offsets = torch.zeros(g + 1, device=device, dtype=torch.int64)
        group_offsets[1:] = torch.cumsum(counts, 0)
        group_members = kept[torch.sort(kept_group, stable=True).indices]
        max_group_size = int(counts.max())
        contiguous_k = None
    elif group_ids is None:
        k = group_size
        g = n // k
        seq_group = torch.arange(n, device=device, dtype=torch.int64) // k
        group_offsets = torch.arange(g + 1, device=device, dtype=torch.int64) * k
        group_members = torch.arange(n, device=device, dtype=torch.int64)
        max_group_size = k
        contiguous_k = k
    else:
        _, seq_group, counts = torch.unique(group_ids.to(device), sorted=True, return_inverse=True,
                                            return_counts=True)
        seq_group = seq_group.to(torch.int64)
        g = counts.numel()
        group_offsets = torch.zeros(g + 1, device=device, dtype=torch.int64)
        group_offsets[1:] = torch.cumsum(counts, 0)
        group_members = torch.sort(seq_group, stable=True).indices
        max_group_size = int(counts.max())
        contiguous_k = None

    return BatchLayout(
        num_tokens=num_tokens,
        num_seqs=n,
        num_groups=g,
        seq_start=seq_start,
        seq_len=seq_len,
        max_seq_len=max_seq_len,
        token_seq=token_seq,
        seq_group=seq_group,
        group_offsets=group_offsets,
        group_members=group_members,
        max_group_size=max_group_size,
        group_size=contiguous_k,
        padded_len=padded_shape[1] if padded_shape is not None else None,
    )


def candidate_layout(num_states: int, num_candidates: int, device: torch.device) -> BatchLayout:
    """Token-level TPO as a sequence-level batch: each of the ``R * K`` candidates is a
    "completion" of one token, and each state's K candidates form a group."""
    return build_layout(
        num_states * num_candidates,
        device,
        padded_shape=(num_states * num_candidates, 1),
        group_size=num_candidates,
    )


def pair_runs(candidates: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The (r, k) candidate pairs, numbered ``r * K + k``, stably sorted by token id:
    ``(order, tokens, offsets)``. The pairs of the distinct id ``tokens[i]`` are
    ``order[offsets[i]:offsets[i+1]]`` in ascending (r, k) order, so that per-token sums over
    them (weight and bias gradients) run in a fixed order."""
    flat = candidates.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens, lengths = torch.unique_consecutive(flat[order], return_counts=True)
    offsets = torch.zeros(tokens.numel() + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return order, tokens, offsets
