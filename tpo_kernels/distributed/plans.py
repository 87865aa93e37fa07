"""The ranks agree on a call's plan, group by group, before any collective that could wait on a peer
(the mechanism: :mod:`.agreement`). Each group a call spans states what its ranks hold and every
setting that changes the result (the plan's settings records, field by field: a new field is
agreed on without an edit here), and, when every rank passed its checks and they agree, gives the
call its seam: a :class:`~.vocab_parallel.VocabShard`, a :class:`~.context_parallel.ContextSum` or
a :class:`~.data_parallel.GroupGather`. The order is vocabulary -> context -> data, each carrying
the previous verdict, so a failure on one rank is the same error on every rank of every group."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from ..backends.rows import RowRequest
from ..checks import placement
from ..checks.arguments import CallFlags
from ..checks.kept_sets import check_ids_below
from ..group_math import GroupRule
from ..ops.group import LossWeights
from ..plan import HeadRows, Plan
from .agreement import agree, agreed, register_names
from .context_parallel import ContextSum
from .data_parallel import GroupGather
from .vocab_parallel import VocabShard

# Every name a setting may take that is longer than a record field: the agreement words a
# disagreement on them by name (see tpo_kernels.distributed.agreement).
register_names(
    "tpo_loss", "tpo_loss_from_logprobs", "fused_linear_tpo_loss", "selective_logprobs", "fused_linear_logprobs",
    "token_tpo_loss", "fused_linear_token_tpo_loss",
)


# The records whose every field changes the result: the ranks agree on each field by its name, so
# a new field is agreed on without an edit here. The row request comes last: its per-token fields
# follow from settings before it (entropy_coef, return_entropy), which a disagreement names first.
_AGREED_RECORDS = (("rule", GroupRule), ("weights", LossWeights), ("flags", CallFlags), ("row", RowRequest))


def agreed_settings(function: str, plan: Optional[Plan], extra: dict) -> dict:
    """Everything that changes the result and must be the same on every rank, by name (None for
    a record the call has not, and for everything when this rank failed its checks: the verdict
    reports that first)."""
    batch = None if plan is None else plan.batch
    settings = {"function": function, "compute dtype": None if plan is None else str(plan.dtype).replace("torch.", "")}
    for attribute, record_type in _AGREED_RECORDS:
        record = None if plan is None else getattr(plan, attribute)
        for field in dataclasses.fields(record_type):
            value = None if record is None else getattr(record, field.name)
            settings[field.name] = ",".join(value) if isinstance(value, tuple) else value  # names travel as text
    settings["old_logprobs"] = None if plan is None else batch is not None and (
        batch.old_seq_logprobs is not None or batch.old_token_sums is not None)
    settings["ref_logprobs"] = None if plan is None else batch is not None and batch.ref_logprobs is not None
    settings["seq_log_weights"] = None if plan is None else batch is not None and batch.seq_log_weights is not None
    settings["sampling_mask"] = None if plan is None else plan.kept is not None
    settings.update(extra if plan is not None else dict.fromkeys(extra))
    return settings


def _record_device(group, plan: Optional[Plan]) -> torch.device:
    """A device the group's backend moves tensors on: the inputs' when known, else the CPU (or
    the current CUDA device for NCCL)."""
    if plan is not None:
        return plan.device
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on_vocabulary(request, group, plan: Optional[Plan], failure: Optional[BaseException]):
    """Every rank of ``vocab_parallel_group`` states its shard, its tokens and its settings;
    returns ``(VocabShard | None, failure | None)``, the same verdict on every rank."""
    shard_request = None if plan is None else plan.shard_request
    tiles = plan.rows.tiles if plan is not None and isinstance(plan.rows, HeadRows) else None
    head = {"hidden size": 0 if tiles is None else plan.rows.hidden.shape[-1],  # the head's tiles: one shape per rank
            "head dtype": None if tiles is None else str(tiles.head_dtype).replace("torch.", ""),
            "batch invariant": tiles is not None and tiles.policy.batch_invariant}
    tokens = 0 if plan is None else plan.labels.numel()
    settings = agreed_settings(request.function, plan, {"tokens": tokens, **head})
    labels = torch.zeros((), dtype=torch.int64) if plan is None else placement.fingerprint(plan.labels)
    size = 0 if shard_request is None else shard_request.size
    start = -1 if shard_request is None or shard_request.start is None else shard_request.start
    agreement = agree(
        group, "vocab_parallel_group", _record_device(group, plan), failure=failure,
        counts={"size": size, "start": start}, settings=settings, fingerprints={"labels": labels},
    )
    if agreement.error is not None:
        return None, agreement.error
    try:
        shard = VocabShard.place(shard_request, [c["size"] for c in agreement.counts],
                                             [c["start"] for c in agreement.counts])
        # The labels are the same on every rank (their fingerprints agree): so is this verdict.
        placement.check_labels_below(plan.labels, shard.vocab_size, plan.flags.validate)
        check_ids_below(plan.kept, shard.vocab_size, plan.flags.validate)  # sampling_mask: global ids
    except ValueError as error:
        return None, agreed(error)
    return shard, None


def _bits(values: Optional[Tensor]) -> Tensor:
    """A 0-d int64 fingerprint of float64 ``values`` by their bits (0 for None), on their device."""
    return torch.zeros((), dtype=torch.int64) if values is None else placement.fingerprint(values.view(torch.int64))


def agree_on_context(request, checked, failure: Optional[BaseException]):
    """Every rank of ``context_parallel_group`` (``checked.context_group``) states its tokens,
    whether any of them counts, its settings and fingerprints of the completions it shares with
    its peers (scores, group ids, per-completion old log-probs); returns ``(ContextSum | None,
    failure | None)``, the same verdict on every rank. Without a data group, whether some
    completion has a counted token anywhere is decided here; with one, on the data record."""
    plan, group = checked.plan, checked.context_group
    batch = None if plan is None else plan.batch
    group_ids = None if plan is None else request.batch.group_ids
    settings = agreed_settings(request.function, plan, {
        "completions": 0 if batch is None else batch.layout.num_seqs,
        "grouping": "ids" if group_ids is not None else (None if plan is None else plan.group_size),
        "old_logprobs per token": batch is not None and batch.old_token_sums is not None})
    no_value = torch.zeros((), dtype=torch.int64)
    fingerprints = {"scores": no_value if batch is None else _bits(batch.scores),
                    "group_ids": no_value if group_ids is None else placement.fingerprint(group_ids),
                    "old_logprobs": no_value if batch is None else _bits(batch.old_seq_logprobs),
                    "seq_log_weights": no_value if batch is None else _bits(batch.seq_log_weights)}
    agreement = agree(
        group, "context_parallel_group", _record_device(group, plan), failure=failure,
        counts={"tokens": 0 if plan is None else plan.labels.numel(),
                "any counted": int(batch is not None and batch.any_kept)},
        settings=settings, fingerprints=fingerprints,
    )
    if agreement.error is not None:
        return None, agreement.error
    any_counted = any(c["any counted"] for c in agreement.counts)
    if checked.data_group is None:
        try:
            placement.check_context_batch(any_counted, plan.flags.validate)
        except ValueError as error:
            return None, agreed(error)
    return ContextSum(group=group, any_counted=any_counted), None


@dataclasses.dataclass(frozen=True)
class LocalGroups:
    """What this rank holds of groups split over ``process_group``: ``count`` completions (or
    states of ``per_item`` candidates each), whether any / all of them are kept (None: not known
    before the group stage, for completions whose positions are split over context ranks), and
    how they group (``group_size`` over every rank's, or ``group_ids``)."""

    count: int
    any_kept: bool
    all_kept: Optional[bool]
    group_size: Optional[int] = None
    group_ids: Optional[Tensor] = None
    per_item: int = 1
    what: str = "completion"


def agree_on_groups(group, function: str, plan: Optional[Plan], failure: Optional[BaseException],
                     local: LocalGroups, extra: Optional[dict] = None):
    """Every rank of ``process_group`` states how many completions (states) it holds and its
    settings; returns ``(GroupGather | None, failure | None)``, the same verdict on every rank."""
    grouping = "ids" if local.group_ids is not None else local.group_size
    settings = agreed_settings(function, plan, dict(extra or {}, grouping=grouping))
    agreement = agree(
        group, "process_group", _record_device(group, plan), failure=failure,
        counts={"count": local.count, "any kept": int(local.any_kept),
                "all kept": -1 if local.all_kept is None else int(local.all_kept)},
        settings=settings,
    )
    if agreement.error is not None:
        return None, agreement.error
    sizes = tuple(c["count"] for c in agreement.counts)
    try:
        placement.check_split_batch(sizes, local.group_size, [c["any kept"] for c in agreement.counts],
                                    plan.flags.validate, local.what)
    except ValueError as error:
        return None, agreed(error)
    all_kept = [c["all kept"] for c in agreement.counts]  # -1: unknown, read once from the gathered rows
    return GroupGather(group=group, sizes=tuple(n * local.per_item for n in sizes),
                                   group_size=local.group_size or local.per_item, group_ids=local.group_ids,
                                   all_kept=None if min(all_kept) < 0 else all(all_kept)), None


__all__ = ["LocalGroups", "agree_on_context", "agree_on_groups", "agree_on_vocabulary", "agreed_settings"]
