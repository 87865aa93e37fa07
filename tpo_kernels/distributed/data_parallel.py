"""Groups split over data-parallel ranks: gather [N]-sized rows, run the group stage on the whole
batch, give each rank's tokens their share of the gradient."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..group_op import group_sum, segment_sum
from ..layout import build_layout
from ..ops.group import group_targets, reduce_groups

from .collectives import _check_group, all_gather_stacked, gather_rows



class DataParallelGroups:
    """The group stage of sequence-level TPO when a batch is split over the ranks of
    ``process_group``.

    Grouping (the same kind on every rank): ``group_ids [N_r]`` hold global ids, a group being
    every completion with that id on any rank; ``group_size=K`` means K contiguous completions of
    the concatenation of the ranks' batches in rank order (a group may straddle ranks; only the
    total N must be a multiple of K). Ranks may hold different numbers of completions.
    """

    def __init__(self, process_group, group_size, group_ids, device: torch.device, input_name: str) -> None:
        _check_group("process_group", process_group)
        if (group_size is None) == (group_ids is None):
            raise ValueError("pass exactly one of group_size (K contiguous completions per prompt) or group_ids [N]")
        if group_size is not None:
            if not isinstance(group_size, int) or isinstance(group_size, bool):
                raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
            if group_size < 1:
                raise ValueError(f"group_size must be >= 1, got {group_size}")
        else:
            if not isinstance(group_ids, Tensor):
                raise TypeError(f"group_ids must be a torch.Tensor, got {type(group_ids).__name__}")
            if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
                raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
            if group_ids.device != device:
                raise ValueError(f"group_ids is on {group_ids.device} but {input_name} is on {device}")
        self.group, self.group_size, self.group_ids = process_group, group_size, group_ids

    @staticmethod
    def local_grouping() -> Tuple[int, None]:
        """``(group_size, group_ids)`` for checking the local batch: completions only (the real
        groups are formed after the gather), hence one group per completion."""
        return 1, None

    def loss(self, token_lp: Tensor, batch, settings, key: str):
        layout, acc = batch.layout, token_lp.dtype
        n = layout.num_seqs
        if self.group_ids is not None and tuple(self.group_ids.shape) != (n,):
            raise ValueError(f"group_ids must have shape [N]=({n},), got {tuple(self.group_ids.shape)}")
        columns = [segment_sum(token_lp, layout), batch.scores.to(acc)]
        has_old = batch.old_seq_logprobs is not None
        if has_old:
            columns.append(batch.old_seq_logprobs.to(acc))
        if batch.beta > 0:  # per-completion sums of the k3 term and of counted tokens
            diff = batch.ref_logprobs - token_lp
            k3 = torch.where(batch.valid, torch.exp(diff) - diff - 1.0, 0.0)
            columns += [segment_sum(k3, layout), segment_sum(batch.valid.to(acc), layout)]
        local = torch.stack(columns, dim=1)

        # Sizes, plus what every rank must agree on, so that a mismatch fails on every rank alike.
        kind = -1 if self.group_ids is None else -2
        meta = torch.tensor([n, local.shape[1], self.group_size or kind, int(batch.beta > 0), int(has_old)],
                            dtype=torch.int64, device=token_lp.device)
        metas = all_gather_stacked(meta, self.group, "sizes").tolist()
        if any(m[1:] != metas[0][1:] for m in metas):
            raise ValueError(
                "process_group: ranks disagree on the grouping (group_size / group_ids), on passing "
                f"old_logprobs or on beta > 0; per rank [N, columns, group_size, beta>0, old]: {metas}"
            )
        sizes = tuple(m[0] for m in metas)
        total, rank = sum(sizes), dist.get_rank(self.group)
        rows = gather_rows(local, self.group, sizes, "rows")
        if self.group_ids is None:
            if total % self.group_size != 0:
                raise ValueError(
                    f"group_size must divide the number of completions over all ranks, N={total} "
                    f"(per rank {list(sizes)}), got {self.group_size}"
                )
            global_layout = build_layout(total, token_lp.device, padded_shape=(total, 1), group_size=self.group_size)
        else:
            ids = self.group_ids.to(torch.int64)
            padded = ids.new_zeros(max(sizes))
            padded[:n] = ids
            stacked = all_gather_stacked(padded, self.group, "group_ids")
            global_ids = torch.cat([stacked[r, :m] for r, m in enumerate(sizes)])
            global_layout = build_layout(total, token_lp.device, padded_shape=(total, 1), group_ids=global_ids)

        ell = rows[:, 0].contiguous()
        scores = rows[:, 1].detach().contiguous()
        old = rows[:, 2].detach().contiguous() if has_old else None
        # Each completion is a "token" of a one-token sequence: the group op's layout is [N, 1].
        result = group_targets(ell, global_layout, scores, old_seq_logprobs=old, eta=settings.eta,
                               anchor=settings.anchor, backend=key)
        loss = reduce_groups(result.group_loss, settings.reduction)
        if batch.beta > 0:
            k3_sum, counted = rows[:, -2], rows[:, -1]
            if settings.reduction == "mean":
                kl = k3_sum.sum() / counted.sum()
            elif settings.reduction == "sum":
                kl = k3_sum.sum()
            else:
                kl = group_sum(k3_sum, global_layout) / group_sum(counted.detach(), global_layout)
            loss = loss + batch.beta * kl
        if not settings.return_aux:
            return loss
        mine = slice(sum(sizes[:rank]), sum(sizes[:rank]) + n)
        weight = 1.0 / global_layout.num_groups if settings.reduction == "mean" else 1.0
        aux = {
            "token_logprobs": token_lp.detach().view(batch.token_shape),
            "seq_logprobs": columns[0].detach(),
            "p": result.p[mine].detach(),
            "q": result.q[mine].detach(),
            "u": result.u[mine].detach(),
            "coef": (result.coef[mine] * weight).detach(),
            "group_loss": result.group_loss.detach(),
            "seq_offset": mine.start,
        }
        return loss, aux


def data_parallel_groups(process_group, group_size, group_ids, device: torch.device, input_name: str,
                         shard=None) -> Optional[DataParallelGroups]:
    """None without a ``process_group`` (the single-process path), else the checked grouping.
    With a vocabulary ``shard`` (:class:`~.vocab_parallel.VocabShard`) too, the two groups must differ (a 2-D mesh): ranks splitting
    the batch hold different tokens, so they cannot also split one token's vocabulary."""
    if process_group is None:
        return None
    _check_group("process_group", process_group)
    if dist.get_world_size(process_group) == 1:  # nothing to gather: the single-process path
        return None
    groups = DataParallelGroups(process_group, group_size, group_ids, device, input_name)
    if shard is not None and _ranks(shard.group) == _ranks(process_group):
        raise ValueError(
            "the vocabulary is sharded over the ranks of process_group, which hold different completions; "
            "use a tensor-parallel group for the vocabulary (for FSDP2, call the loss inside the wrapped "
            "module's forward, where the lm_head weight is unsharded)"
        )
    return groups


def _ranks(group) -> List[int]:
    return list(dist.get_process_group_ranks(group))
