"""The one pipeline every public function runs, for one rank and many.

A public function states its call as a frozen request (:mod:`tpo_kernels.requests`:
:class:`SequenceRequest`, :class:`LogprobsRequest`, :class:`CandidateRequest`); the pipeline

1. runs the call's check pass (:mod:`tpo_kernels.plan.call`: every check, the placement ones
   included, before any work), which gives a frozen :class:`~tpo_kernels.plan.records.Plan`:
   whole or sharded vocabulary, what the row op reads, the prepared batch;
2. when a group is involved, has the ranks agree on their plans before any collective that
   could wait on a peer (:func:`~tpo_kernels.distributed.agree`), group by group in the order
   vocabulary -> context -> data, each carrying the previous verdict: a failed check or a
   disagreement on one rank becomes the same error on every rank of every group;
3. runs the row op (:mod:`tpo_kernels.ops`: on the whole vocabulary, or on this rank's shard of
   it through :class:`~tpo_kernels.distributed.VocabShard`) and the group stage
   (:class:`~tpo_kernels.ops.group.GroupObjective`: on local completions, on per-completion sums
   all-reduced over ``context_parallel_group`` by a :class:`~tpo_kernels.distributed.ContextSum`,
   and/or on rows gathered over ``process_group`` by a :class:`~tpo_kernels.distributed.GroupGather`),
   and assembles the aux.

:mod:`tpo_kernels.ops` and :mod:`tpo_kernels.distributed` are leaves below this module: neither
checks user input, and ``ops`` does not know ranks exist.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from .checks import placement
from . import distributed
from .checks.arguments import CallFlags
from .checks.kept_sets import check_ids_below
from .plan import HeadRows, LogitsRows, LogprobRows, Plan, check_call
from .plan.call import rows_matrix
from .group_math import GroupRule, candidate_layout, group_sum, portable_group_targets
from .ops import RowRequest, candidate_logits, linear_candidate_logits, linear_logprobs, token_logprobs
from .ops.kept import kept_row_summary, linear_kept_row_summary
from .ops.group import CompletionInputs, GroupObjective, LossWeights, RankSeams
from .ops.tiles import EVERY_ROW
from .ops.vocab_shard import shard_linear_logprobs, shard_logprobs
from .requests import CandidateRequest, Logits, LogprobsRequest, LossOutput, SequenceRequest
from .backends.row_summary import RowSummary


# Every name a setting may take that is longer than a record field: the agreement words a
# disagreement on them by name (see tpo_kernels.distributed.agreement).
distributed.agreement.register_names(
    "tpo_loss", "tpo_loss_from_logprobs", "fused_linear_tpo_loss", "selective_logprobs", "fused_linear_logprobs",
    "token_tpo_loss", "fused_linear_token_tpo_loss",
)


# ----------------------------------------------------------------------------- agreement

# The records whose every field changes the result: the ranks agree on each field by its name, so
# a new field is agreed on without an edit here. The row request comes last: its per-token fields
# follow from settings before it (entropy_coef, return_entropy), which a disagreement names first.
_AGREED_RECORDS = (("rule", GroupRule), ("weights", LossWeights), ("flags", CallFlags), ("row", RowRequest))


def _agreed_settings(function: str, plan: Optional[Plan], extra: dict) -> dict:
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


def _agree_on_vocabulary(request, group, plan: Optional[Plan], failure: Optional[BaseException]):
    """Every rank of ``vocab_parallel_group`` states its shard, its tokens and its settings;
    returns ``(VocabShard | None, failure | None)``, the same verdict on every rank."""
    shard_request = None if plan is None else plan.shard_request
    tiles = plan.rows.tiles if plan is not None and isinstance(plan.rows, HeadRows) else None
    head = {"hidden size": 0 if tiles is None else plan.rows.hidden.shape[-1],  # the head's tiles: one shape per rank
            "head dtype": None if tiles is None else str(tiles.head_dtype).replace("torch.", ""),
            "batch invariant": tiles is not None and tiles.policy.batch_invariant}
    tokens = 0 if plan is None else plan.labels.numel()
    settings = _agreed_settings(request.function, plan, {"tokens": tokens, **head})
    labels = torch.zeros((), dtype=torch.int64) if plan is None else placement.fingerprint(plan.labels)
    size = 0 if shard_request is None else shard_request.size
    start = -1 if shard_request is None or shard_request.start is None else shard_request.start
    agreement = distributed.agree(
        group, "vocab_parallel_group", _record_device(group, plan), failure=failure,
        counts={"size": size, "start": start}, settings=settings, fingerprints={"labels": labels},
    )
    if agreement.error is not None:
        return None, agreement.error
    try:
        shard = distributed.VocabShard.place(shard_request, [c["size"] for c in agreement.counts],
                                             [c["start"] for c in agreement.counts])
        # The labels are the same on every rank (their fingerprints agree): so is this verdict.
        placement.check_labels_below(plan.labels, shard.vocab_size, plan.flags.validate)
        check_ids_below(plan.kept, shard.vocab_size, plan.flags.validate)  # sampling_mask: global ids
    except ValueError as error:
        return None, distributed.agreement.agreed(error)
    return shard, None


def _bits(values: Optional[Tensor]) -> Tensor:
    """A 0-d int64 fingerprint of float64 ``values`` by their bits (0 for None), on their device."""
    return torch.zeros((), dtype=torch.int64) if values is None else placement.fingerprint(values.view(torch.int64))


def _agree_on_context(request, checked, failure: Optional[BaseException]):
    """Every rank of ``context_parallel_group`` (``checked.context_group``) states its tokens,
    whether any of them counts, its settings and fingerprints of the completions it shares with
    its peers (scores, group ids, per-completion old log-probs); returns ``(ContextSum | None,
    failure | None)``, the same verdict on every rank. Without a data group, whether some
    completion has a counted token anywhere is decided here; with one, on the data record."""
    plan, group = checked.plan, checked.context_group
    batch = None if plan is None else plan.batch
    group_ids = None if plan is None else request.batch.group_ids
    settings = _agreed_settings(request.function, plan, {
        "completions": 0 if batch is None else batch.layout.num_seqs,
        "grouping": "ids" if group_ids is not None else (None if plan is None else plan.group_size),
        "old_logprobs per token": batch is not None and batch.old_token_sums is not None})
    no_value = torch.zeros((), dtype=torch.int64)
    fingerprints = {"scores": no_value if batch is None else _bits(batch.scores),
                    "group_ids": no_value if group_ids is None else placement.fingerprint(group_ids),
                    "old_logprobs": no_value if batch is None else _bits(batch.old_seq_logprobs),
                    "seq_log_weights": no_value if batch is None else _bits(batch.seq_log_weights)}
    agreement = distributed.agree(
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
            return None, distributed.agreement.agreed(error)
    return distributed.ContextSum(group=group, any_counted=any_counted), None


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


def _agree_on_groups(group, function: str, plan: Optional[Plan], failure: Optional[BaseException],
                     local: LocalGroups, extra: Optional[dict] = None):
    """Every rank of ``process_group`` states how many completions (states) it holds and its
    settings; returns ``(GroupGather | None, failure | None)``, the same verdict on every rank."""
    grouping = "ids" if local.group_ids is not None else local.group_size
    settings = _agreed_settings(function, plan, dict(extra or {}, grouping=grouping))
    agreement = distributed.agree(
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
        return None, distributed.agreement.agreed(error)
    all_kept = [c["all kept"] for c in agreement.counts]  # -1: unknown, read once from the gathered rows
    return distributed.GroupGather(group=group, sizes=tuple(n * local.per_item for n in sizes),
                                   group_size=local.group_size or local.per_item, group_ids=local.group_ids,
                                   all_kept=None if min(all_kept) < 0 else all(all_kept)), None


# ----------------------------------------------------------------------------- row ops


def _row_summary(plan: Plan, shard, cache_candidates: Optional[Tensor] = None) -> RowSummary:
    """The row op's :class:`RowSummary` on the whole vocabulary, or on this rank's shard of it;
    ``cache_candidates``: the tokens a fused head's logits cache may hold (None: every counted
    token). Per-token log-probs a trainer computed come back as a summary of their own."""
    request, rows = plan.row, plan.rows
    if plan.kept is not None:  # replay: the row op over each token's kept set (a shard: its part, merged)
        request = request if shard is None else request.folded()
        if isinstance(rows, LogitsRows):
            return kept_row_summary(rows.matrix, plan.kept, request, plan.backend, seam=shard)
        return linear_kept_row_summary(rows.hidden, rows.weight, rows.bias, plan.kept, request, plan.backend,
                                       seam=shard)
    if isinstance(rows, LogprobRows):
        counted = plan.labels >= 0
        logprobs = torch.where(counted, rows.logprobs.reshape(-1).to(plan.dtype), 0.0)
        unknown = logprobs.new_zeros(()).expand_as(logprobs)  # no row statistics: no vocabulary was read
        return RowSummary(row_max=unknown, log_sum=unknown, label_logprob=logprobs, entropy=None, has_label=counted)
    if shard is not None:  # a shard's row ops take the scale folded into 1/temperature (no cap)
        if isinstance(rows, LogitsRows):
            return shard_logprobs(rows.matrix, plan.labels, shard, request=request.folded(),
                                  inplace_backward=rows.inplace_backward, backend=plan.backend)
        return shard_linear_logprobs(rows.hidden, rows.weight, rows.bias, plan.labels, shard,
                                     request=request.folded(), tiles=rows.tiles, backend=plan.backend)
    if isinstance(rows, LogitsRows):
        return token_logprobs(rows.matrix, plan.labels, request=request, inplace_backward=rows.inplace_backward,
                              backend=plan.backend)
    return linear_logprobs(rows.hidden, rows.weight, rows.bias, plan.labels, request=request, tiles=rows.tiles,
                           backend=plan.backend, cache_candidates=cache_candidates)


def _signal_tokens(plan: Plan, rule: GroupRule, seams: RankSeams) -> Optional[Tensor]:
    """``[M]`` bool: the tokens of the groups that can carry a gradient, the candidates of a fused
    head's logits cache of a bounded budget. On-policy with the anchor and no KL term, a group whose standardized
    scores are all 0 (its scores tie) has ``q == p`` bit for bit, so its tokens' gradient is
    exactly 0 and the backward never reads their logits: the cache's slots go to the others.
    Decided from the scores alone by the group op of the same ``rule`` the loss runs (no
    read-back). None (every counted token) when there is no cache, or when the gradient's support
    is not known before the forward: off-policy, without the anchor, with a KL term, or with the
    batch split over ranks (the groups gathered, or the completions' positions split)."""
    weights, batch = plan.weights, plan.batch
    if (not isinstance(plan.rows, HeadRows) or seams.gather is not None or seams.context is not None
            or plan.kept is not None):  # replay caches no logits
        return None
    budget = plan.rows.tiles.policy.logits_cache_budget(plan.rows.weight.shape[0])
    if not budget or budget >= EVERY_ROW:  # no cache, or one of every row: no slot to give away
        return None
    if not torch.is_grad_enabled():  # nothing is cached without a backward
        return None
    if (not rule.anchor or batch.old_seq_logprobs is not None or weights.beta > 0 or weights.entropy_coef > 0
            or batch.layout.num_groups == 0):  # an entropy bonus gives every counted token a gradient
        return None
    layout = batch.layout
    # u from the group op itself (u does not depend on the log-probs): one tie rule, not two.
    u = portable_group_targets(torch.zeros(layout.num_tokens, dtype=torch.float64, device=plan.device), layout,
                               batch.scores, seq_log_weights=batch.seq_log_weights, **rule.kernel_args()).u
    signal = group_sum((u != 0).to(torch.float64), layout) > 0
    return (layout.token_seq >= 0) & signal[layout.seq_group[layout.token_seq.clamp(min=0)]]


# ----------------------------------------------------------------------------- the three runs


def sequence_loss(request: SequenceRequest) -> LossOutput:
    """Sequence-level TPO: row op, then the group stage over local completions, completions whose
    positions are split over context ranks (their per-completion sums all-reduced), and/or
    completions gathered from data ranks."""
    checked = check_call(request)
    plan, failure, data_parallel = checked.plan, checked.failure, checked.data_group
    shard = gather = context = None
    if checked.vocab_group is not None:
        shard, failure = _agree_on_vocabulary(request, checked.vocab_group, plan, failure)
    if checked.context_group is not None:
        context, failure = _agree_on_context(request, checked, failure)
    if data_parallel is not None:
        prepared = None if plan is None else plan.batch
        # With positions split, which completions are kept is known once their counts are summed.
        kept_later = checked.context_group is not None and plan is not None and plan.flags.validate
        local = LocalGroups(count=0 if prepared is None else prepared.layout.num_seqs,
                            any_kept=prepared is not None and (prepared.any_kept if context is None
                                                               else context.any_counted),
                            all_kept=None if kept_later else prepared is None or prepared.kept is None,
                            group_size=None if plan is None else plan.group_size,
                            group_ids=None if prepared is None else request.batch.group_ids)
        context_ranks = 1 if checked.context_group is None else torch.distributed.get_world_size(checked.context_group)
        gather, failure = _agree_on_groups(data_parallel, request.function, plan, failure, local,
                                           extra={"context_parallel_group size": context_ranks})
    if failure is not None:
        raise failure

    prepared = plan.batch
    seams = RankSeams(gather=gather, context=context)
    summary = _row_summary(plan, shard, _signal_tokens(plan, plan.rule, seams))
    completions = CompletionInputs(scores=prepared.scores, seq_log_weights=prepared.seq_log_weights,
                                   old_seq_logprobs=prepared.old_seq_logprobs,
                                   old_token_sums=prepared.old_token_sums, kept=prepared.kept,
                                   kept_after_sum=context is not None and plan.flags.validate)
    objective = GroupObjective(
        prepared.layout, completions, rule=plan.rule, weights=plan.weights, backend=plan.backend,
        ref_logprobs=prepared.ref_logprobs, valid=prepared.labels >= 0, seams=seams,
    )
    loss = objective.forward(summary.label_logprob, summary.entropy)
    if not plan.flags.return_aux:
        return loss
    aux = objective.aux()
    aux["token_logprobs"] = aux["token_logprobs"].view(prepared.token_shape)
    for name in plan.flags.returned_fields:  # e.g. aux["token_entropy"]
        aux[f"token_{name}"] = getattr(summary, name).detach().view(prepared.token_shape)
    return loss, aux


def selective_logprobs(request: LogprobsRequest) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Per-token log-probs (and entropies) of the labels, over a whole or sharded vocabulary."""
    checked = check_call(request)
    plan, failure = checked.plan, checked.failure
    shard = None
    if checked.vocab_group is not None:
        shard, failure = _agree_on_vocabulary(request, checked.vocab_group, plan, failure)
    if failure is not None:
        raise failure
    summary = _row_summary(plan, shard)
    shape = request.labels.shape
    if not plan.flags.returned_fields:
        return summary.label_logprob.view(shape)
    return (summary.label_logprob.view(shape), *(getattr(summary, name).view(shape)
                                                 for name in plan.flags.returned_fields))


def candidate_loss(request: CandidateRequest) -> LossOutput:
    """Token-level TPO: each state's K candidates form a group (states may be split over ranks)."""
    checked = check_call(request)
    plan, failure, data_parallel = checked.plan, checked.failure, checked.data_group
    gather = None
    if data_parallel is not None:
        num_states, num_cand = (0, 0) if plan is None else tuple(plan.rows.candidates.shape)
        local = LocalGroups(count=num_states, any_kept=True, all_kept=True, per_item=num_cand, what="state")
        gather, failure = _agree_on_groups(data_parallel, request.function, plan, failure, local,
                                           extra={"candidates per state": num_cand})
    if failure is not None:
        raise failure

    key, rows = plan.backend, plan.rows
    source = request.source
    if isinstance(source, Logits):
        matrix, _ = rows_matrix(source.logits)
        gather_logits = lambda inv_t: candidate_logits(matrix, rows.candidates, inv_temperature=inv_t,  # noqa: E731
                                                       backend=key)
    else:
        gather_logits = lambda inv_t: linear_candidate_logits(source.hidden, source.weight, source.bias,  # noqa: E731
                                                              rows.candidates, inv_temperature=inv_t, backend=key)
    cand = transformed_candidates(gather_logits, plan.row)
    num_states, num_cand = cand.shape
    old = None if rows.old_logprobs is None else rows.old_logprobs.reshape(-1)
    completions = CompletionInputs(scores=rows.scores.reshape(-1), old_seq_logprobs=old)
    objective = GroupObjective(candidate_layout(num_states, num_cand, cand.device), completions, rule=plan.rule,
                               weights=plan.weights, backend=key, seams=RankSeams(gather=gather))
    loss = objective.forward(cand.reshape(-1))
    if not plan.flags.return_aux:
        return loss
    aux = objective.aux()
    state_loss = aux.pop("group_loss")
    per_member = {name: aux[name].view(num_states, num_cand) for name in ("seq_logprobs", "p", "q", "u", "coef")}
    per_member["candidate_logits"] = per_member.pop("seq_logprobs")
    per_member["state_loss"] = state_loss
    if gather is not None:
        per_member["state_offset"] = aux["seq_offset"] // max(num_cand, 1)
    return loss, per_member


# ----------------------------------------------------------------------------- candidates


def transformed_candidates(gather: Callable[[float], Tensor], request: RowRequest) -> Tensor:
    """Tempered candidate logits through the logit transform. ``gather(inv_temperature)`` gives
    ``[R, K]`` candidate logits times that factor: the scale folds in without a cap; with one,
    the raw logits are gathered and capped in plain autograd (``[R, K]`` entries only)."""
    factor, transform = request.transform()
    if transform is None:
        return gather(factor)
    return transform.differentiable(gather(1.0)) * factor
