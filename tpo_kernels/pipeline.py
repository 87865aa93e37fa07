"""The one pipeline every public function runs, for one rank and many.

A public function states its call as a frozen request (:mod:`tpo_kernels.requests`:
:class:`SequenceRequest`, :class:`LogprobsRequest`, :class:`CandidateRequest`); the pipeline

1. checks it (:mod:`tpo_kernels.checks`: every check lives there),
2. decides where the vocabulary lives -- whole, or sharded over ``vocab_parallel_group`` (the
   row ops of :mod:`tpo_kernels.ops.vocab_shard` with :class:`~tpo_kernels.distributed.VocabShard`
   as their seam) -- and where the groups live -- local, or gathered over ``process_group``
   (:class:`~tpo_kernels.ops.group.GroupObjective` with a
   :class:`~tpo_kernels.distributed.GroupGather`),
3. when a group is involved, has the ranks agree before any collective that could wait on a
   peer (:func:`~tpo_kernels.distributed.agree`): a local failure or a disagreement becomes the
   same error on every rank,
4. runs the row op (:mod:`tpo_kernels.ops`) and the group stage, and assembles the aux.

:mod:`tpo_kernels.ops` and :mod:`tpo_kernels.distributed` are leaves below this module: neither
checks user input, and ``ops`` does not know ranks exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from . import checks
from . import distributed
from ._dtypes import compute_dtype
from .group_math import group_sum, portable_group_targets
from .backends import backend_key, get_backend
from .layout import candidate_layout
from .ops import TilePolicy, candidate_logits, linear_candidate_logits, linear_logprobs, token_logprobs
from .ops.group import GroupObjective
from .ops.transform import LogitTransform, folded_inv_temperature
from .ops.vocab_shard import shard_linear_logprobs, shard_logprobs
from .requests import (CandidateRequest, Head, Logits, Logprobs, LogprobsRequest, Options, Placement, SequenceRequest,
                       Source)

LossOutput = Union[Tensor, Tuple[Tensor, dict]]


# Every name a setting may take that is longer than a record field: the agreement words a
# disagreement on them by name (see tpo_kernels.distributed.agreement).
distributed.agreement.register_names(
    "tpo_loss", "tpo_loss_from_logprobs", "fused_linear_tpo_loss", "selective_logprobs", "fused_linear_logprobs",
    "token_tpo_loss", "fused_linear_token_tpo_loss",
)


# ----------------------------------------------------------------------------- a call, checked


@dataclass
class _Checked:
    """One rank's call after its local checks."""

    settings: checks.LossSettings
    key: str  # the backend, as the ops take it
    device: torch.device
    dtype: torch.dtype  # the compute dtype
    rows: Tuple  # what the row op reads (per source kind)
    labels: Optional[Tensor]  # [M] int64, -1 where not counted (None for candidates)
    batch: Optional[checks.PreparedBatch] = None
    group_size: Optional[int] = None  # of a batch split over ranks: K over the concatenation
    shard_request: Optional[distributed.ShardRequest] = None  # this rank's vocabulary shard, if split


def _resolve_source(source: Source, where: Placement):
    """``(source with local tensors, shard request | None)``: the vocabulary's placement, before
    any check that needs its size."""
    if isinstance(source, Logits):
        logits, shard = distributed.vocab_shard("logits", source.logits, where.vocab_parallel_group,
                                                where.vocab_start_index)
        return Logits(logits, source.inplace_backward), shard, source.logits
    if isinstance(source, Head):
        hidden, weight, bias, shard = distributed.vocab_parallel_head(source.hidden, source.weight, source.bias,
                                                                      where.vocab_parallel_group,
                                                                      where.vocab_start_index)
        return Head(hidden, weight, bias, source.chunk_size, source.grad_accum_dtype, source.tile_policy,
                    source.logits_cache_bytes), shard, None
    return source, None, None


def _data_group(process_group):
    """``(data-parallel group | None, failure | None)``: the group (None for one rank: nothing to
    gather), or why ``process_group`` is none (then this rank has no group to report on, unless a
    vocabulary group carries the error)."""
    if process_group is None:
        return None, None
    try:
        checks.check_group("process_group", process_group)
        return (process_group if torch.distributed.get_world_size(process_group) > 1 else None), None
    except Exception as error:  # noqa: BLE001 - reported to the peers or raised below
        return None, error


def _vocab_group_hint(source: Source, where: Placement):
    """The group this call's vocabulary would be split over, read without any check, so that a
    rank whose placement checks fail still joins its peers' exchange on it and reports there:
    ``vocab_parallel_group`` when it is a process group, else the mesh group a DTensor logits /
    weight is sharded over on the vocabulary, else None."""
    if where.vocab_parallel_group is not None:
        group = where.vocab_parallel_group
        ready = torch.distributed.is_available() and torch.distributed.is_initialized()
        return group if ready and isinstance(group, torch.distributed.ProcessGroup) else None
    tensor, dim = (source.logits, -1) if isinstance(source, Logits) else (
        (source.weight, 0) if isinstance(source, Head) else (None, 0))
    if not distributed.vocab_parallel.is_dtensor(tensor):
        return None
    try:
        return distributed.vocab_parallel.dtensor_vocab_group(tensor, dim)
    except Exception:  # noqa: BLE001 - a malformed DTensor: no group to report on
        return None


def _settings(options: Options, temperature: Optional[float] = None) -> checks.LossSettings:
    return checks.check_settings(
        eta=options.eta, anchor=options.anchor, temperature=options.temperature if temperature is None else temperature,
        reduction=options.reduction, return_aux=options.return_aux, validate=options.validate,
        return_entropy=options.return_entropy, logit_scale=options.logit_scale, logit_softcap=options.logit_softcap,
        score_eps=options.score_eps, length_normalize=options.length_normalize, entropy_coef=options.entropy_coef,
    )


def _check_sharded_transform(settings: checks.LossSettings, sharded: bool) -> None:
    if sharded and settings.logit_softcap is not None:
        raise ValueError("logit_softcap is not supported with a vocabulary-parallel head or logits "
                         "(vocab_parallel_group / DTensor shards); logit_scale is")


def _check_rows(source: Source, sharded: bool, original) -> Tuple[Tuple, torch.device, torch.dtype, int]:
    """The row op's inputs: ``(rows, device, compute dtype, vocabulary size of this rank)``."""
    if isinstance(source, Logits):
        logits = checks.check_logits(source.logits)
        inplace_backward = checks.check_flag("inplace_backward", source.inplace_backward)
        matrix, copied = logits_rows(logits, sharded)
        # Overwrite the buffer only when it is ours or an intermediate activation, never a leaf
        # (a DTensor's local shard neither, when the DTensor is a leaf). Under torch.compile the
        # graph owns the buffers: the backward is out of place.
        owner = logits if original is None else original
        inplace = not torch.compiler.is_compiling() and (copied or (inplace_backward and owner.grad_fn is not None))
        return ("logits", matrix, inplace), logits.device, compute_dtype(logits.dtype), logits.shape[-1]
    hidden, weight, bias = source.hidden, source.weight, source.bias
    checks.check_head(hidden, weight, bias)
    chunk_size = checks.check_chunk_size(source.chunk_size)
    accum = checks.check_grad_accum_dtype(source.grad_accum_dtype, weight.dtype)
    checks.check_tile_policy(source.tile_policy, TilePolicy)
    policy = source.tile_policy or TilePolicy.for_device(hidden.device)
    cache = checks.check_logits_cache(source.logits_cache_bytes, policy.logits_cache_bytes, sharded)
    policy = policy.with_logits_cache(cache)
    flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    if chunk_size is None:  # the tile budget, in rows of V
        chunk_size = policy.chunk_size(flat.shape[0], weight.shape[0])
    tiles = dict(chunk_size=chunk_size, policy=policy, grad_accum_dtype=accum)
    dtype = compute_dtype(torch.promote_types(hidden.dtype, weight.dtype))
    return ("head", flat, weight, bias, tiles), hidden.device, dtype, weight.shape[0]


def _token_shape(source: Source) -> Tuple[int, ...]:
    tensor = source.logprobs if isinstance(source, Logprobs) else (
        source.logits if isinstance(source, Logits) else source.hidden)
    return tuple(tensor.shape) if isinstance(source, Logprobs) else tuple(tensor.shape[:-1])


def _check_sequence(request: SequenceRequest, source: Source, sharded: bool, whole: bool, original) -> _Checked:
    batch = request.batch
    if isinstance(source, Logprobs):
        logprobs = checks.check_float_tensor("logprobs", source.logprobs, (1, 2))
        settings = _settings(request.options, temperature=1.0)
        device, dtype, vocab_size = logprobs.device, compute_dtype(logprobs.dtype), 1
        # Every position is a "label" 0 of a one-entry vocabulary; the mask says which count.
        labels = torch.zeros(logprobs.shape, dtype=torch.int64, device=device)
        rows: Tuple = ("logprobs", logprobs)
    else:
        rows, device, dtype, vocab_size = _check_rows(source, sharded, original)
        settings = _settings(request.options)
        labels = batch.labels
    _check_sharded_transform(settings, sharded)
    key = backend_key(get_backend(request.options.backend, device))
    input_name = {"logits": "logits", "head": "hidden", "logprobs": "logprobs"}[rows[0]]
    prepared = checks.prepare_batch(
        _token_shape(source), None if sharded else vocab_size, device, dtype, labels, batch.scores,
        group_size=batch.group_size, group_ids=batch.group_ids, cu_seqlens=batch.cu_seqlens, mask=batch.mask,
        ignore_index=batch.ignore_index, old_logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs,
        beta=batch.beta, input_name=input_name, validate=settings.validate, whole=whole,
        length_normalize=settings.length_normalize,
    )
    # A part split over ranks: K counts over every rank's completions, checked once the sizes are agreed.
    return _Checked(settings, key, device, dtype, rows, prepared.labels, prepared, prepared.split_group_size)


# ----------------------------------------------------------------------------- agreement


def _agreed_settings(function: str, checked: Optional[_Checked], extra: dict) -> dict:
    """Everything that changes the result and must be the same on every rank."""
    names = ("function", "compute dtype", "eta", "anchor", "temperature", "logit_scale", "logit_softcap",
             "reduction", "return_aux", "return_entropy", "validate", "score_eps", "length_normalize", "beta",
             "entropy_coef", "old_logprobs", "ref_logprobs", *extra)
    if checked is None:  # this rank failed its checks: the verdict reports that first
        return dict.fromkeys(names)
    s, batch = checked.settings, checked.batch
    values = (function, str(checked.dtype).replace("torch.", ""), s.eta, s.anchor, 1.0 / s.inv_temperature,
              s.logit_scale, s.logit_softcap, s.reduction, s.return_aux, s.return_entropy, s.validate,
              s.score_eps, s.length_normalize, 0.0 if batch is None else batch.beta, s.entropy_coef,
              batch is not None and batch.old_seq_logprobs is not None,
              batch is not None and batch.ref_logprobs is not None, *extra.values())
    return dict(zip(names, values))


def _record_device(group, checked: Optional[_Checked]) -> torch.device:
    """A device the group's backend moves tensors on: the inputs' when known, else the CPU (or
    the current CUDA device for NCCL)."""
    if checked is not None:
        return checked.device
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _vocabulary_group(checked: Optional[_Checked], hint):
    """The group of this call's vocabulary exchange: the resolved shard's, or (this rank's checks
    failed) the group its arguments name."""
    if checked is None:
        return hint
    return None if checked.shard_request is None else checked.shard_request.group


def _agree_on_vocabulary(request, group, checked: Optional[_Checked], failure: Optional[BaseException]):
    """Every rank of ``vocab_parallel_group`` states its shard, its tokens and its settings;
    returns ``(VocabShard | None, failure | None)``, the same verdict on every rank."""
    shard_request = None if checked is None else checked.shard_request
    hidden = checked.rows[1].shape[-1] if checked is not None and checked.rows[0] == "head" else 0
    tokens = 0 if checked is None else checked.labels.numel()
    settings = _agreed_settings(request.function, checked, {"tokens": tokens, "hidden size": hidden})
    labels = torch.zeros((), dtype=torch.int64) if checked is None else checks.fingerprint(checked.labels)
    size = 0 if shard_request is None else shard_request.size
    start = -1 if shard_request is None or shard_request.start is None else shard_request.start
    agreement = distributed.agree(
        group, "vocab_parallel_group", _record_device(group, checked), failure=failure,
        counts={"size": size, "start": start}, settings=settings, fingerprints={"labels": labels},
    )
    if agreement.error is not None:
        return None, agreement.error
    try:
        shard = distributed.VocabShard.place(shard_request, [c["size"] for c in agreement.counts],
                                             [c["start"] for c in agreement.counts])
        # The labels are the same on every rank (their fingerprints agree): so is this verdict.
        checks.check_labels_below(checked.labels, shard.vocab_size, checked.settings.validate)
    except ValueError as error:
        return None, distributed.agreement.agreed(error)
    return shard, None


def _agree_on_groups(group, function: str, checked: Optional[_Checked], failure: Optional[BaseException], *,
                     group_size: Optional[int], group_ids: Optional[Tensor], count: int, any_kept: bool,
                     all_kept: bool, per_item: int = 1, extra: Optional[dict] = None, what: str = "completion"):
    """Every rank of ``process_group`` states how many completions (states) it holds and its
    settings; returns ``(GroupGather | None, failure | None)``, the same verdict on every rank."""
    grouping = "ids" if group_ids is not None else group_size
    settings = _agreed_settings(function, checked, dict(extra or {}, grouping=grouping))
    agreement = distributed.agree(
        group, "process_group", _record_device(group, checked), failure=failure,
        counts={"count": count, "any kept": int(any_kept), "all kept": int(all_kept)}, settings=settings,
    )
    if agreement.error is not None:
        return None, agreement.error
    sizes = tuple(c["count"] for c in agreement.counts)
    try:
        checks.check_split_batch(sizes, group_size, [c["any kept"] for c in agreement.counts],
                                    checked.settings.validate, what)
    except ValueError as error:
        return None, distributed.agreement.agreed(error)
    return distributed.GroupGather(group, tuple(n * per_item for n in sizes), group_size or per_item, group_ids,
                                   all(c["all kept"] for c in agreement.counts)), None


def _checked_or_failure(check: Callable[[], _Checked], distributed_call: bool,
                        failure: Optional[BaseException] = None):
    """Run the local checks (unless ``failure`` already stopped this rank); on one rank a failure
    raises here, across ranks any exception the checks raise (argument checks, the backend's
    resolution, placement and shard checks, cache budgets) is reported to the peers, which raise
    the same error instead of waiting for this rank at their next collective."""
    if failure is not None:
        if not distributed_call:
            raise failure
        return None, failure
    try:
        return check(), None
    except Exception as error:  # noqa: BLE001 - every rank raises it after the exchange
        if not distributed_call:
            raise
        return None, error


# ----------------------------------------------------------------------------- row ops


def _row_logprobs(checked: _Checked, shard, with_entropy: bool,
                  cache_candidates: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """The row op on the whole vocabulary, or on this rank's shard of it; ``cache_candidates``:
    the tokens a fused head's logits cache may hold (None: every counted token)."""
    s, kind = checked.settings, checked.rows[0]
    if kind == "logprobs":
        return torch.where(checked.labels >= 0, checked.rows[1].reshape(-1).to(checked.dtype), 0.0), None
    if shard is not None:  # a shard's row ops take the scale folded into 1/temperature (no cap)
        inv_temperature = folded_inv_temperature(s.inv_temperature, s.logit_scale, None)
        if kind == "logits":
            _, matrix, inplace = checked.rows
            return shard_logprobs(matrix, checked.labels, shard, inv_temperature=inv_temperature,
                                  with_entropy=with_entropy, inplace_backward=inplace, backend=checked.key)
        _, flat, weight, bias, tiles = checked.rows
        return shard_linear_logprobs(flat, weight, bias, checked.labels, shard, inv_temperature=inv_temperature,
                                     with_entropy=with_entropy, backend=checked.key, **tiles)
    transform = dict(inv_temperature=s.inv_temperature, logit_scale=s.logit_scale, logit_softcap=s.logit_softcap,
                     with_entropy=with_entropy, backend=checked.key)
    if kind == "logits":
        _, matrix, inplace = checked.rows
        return token_logprobs(matrix, checked.labels, inplace_backward=inplace, **transform)
    _, flat, weight, bias, tiles = checked.rows
    return linear_logprobs(flat, weight, bias, checked.labels, **transform, **tiles, cache_candidates=cache_candidates)


def _signal_tokens(checked: _Checked, gather) -> Optional[Tensor]:
    """``[M]`` bool: the tokens of the groups that can carry a gradient, the candidates of a fused
    head's logits cache. On-policy with the anchor and no KL term, a group whose standardized
    scores are all 0 (its scores tie) has ``q == p`` bit for bit, so its tokens' gradient is
    exactly 0 and the backward never reads their logits: the cache's slots go to the others.
    Decided from the scores alone, on the device (no read-back). None (every counted token) when
    there is no cache, or when the gradient's support is not known before the forward: off-policy,
    without the anchor, with a KL term, or with the groups gathered over ranks."""
    s, batch = checked.settings, checked.batch
    if checked.rows[0] != "head" or not checked.rows[4]["policy"].logits_cache_bytes or gather is not None:
        return None
    if not torch.is_grad_enabled():  # nothing is cached without a backward
        return None
    if (not s.anchor or batch.old_seq_logprobs is not None or batch.beta > 0 or s.entropy_coef > 0
            or batch.layout.num_groups == 0):  # an entropy bonus gives every counted token a gradient
        return None
    layout = batch.layout
    # u from the group op itself (u does not depend on the log-probs): one tie rule, not two.
    u = portable_group_targets(torch.zeros(layout.num_tokens, dtype=torch.float64, device=checked.device), layout,
                               batch.scores, eta=1.0, anchor=True, score_eps=s.score_eps).u
    signal = group_sum((u != 0).to(torch.float64), layout) > 0
    return (layout.token_seq >= 0) & signal[layout.seq_group[layout.token_seq.clamp(min=0)]]


# ----------------------------------------------------------------------------- the three runs


def _distributed_keywords(where: Placement) -> tuple:
    return tuple(name for name in ("process_group", "vocab_parallel_group")
                 if getattr(where, name) is not None)


def sequence_loss(request: SequenceRequest) -> LossOutput:
    """Sequence-level TPO: row op, then the group stage over local or gathered groups."""
    checks.check_traceable(request.function, request.options.validate, _distributed_keywords(request.placement))
    data_group, failure = _data_group(request.placement.process_group)
    hint = _vocab_group_hint(request.source, request.placement)
    batch = request.batch

    def check() -> _Checked:
        source, shard_request, original = _resolve_source(request.source, request.placement)
        if shard_request is not None and data_group is not None:
            checks.check_groups_apart(shard_request.group, data_group)
        checked = _check_sequence(request, source, shard_request is not None, data_group is None, original)
        checked.shard_request = shard_request
        return checked

    checked, failure = _checked_or_failure(check, hint is not None or data_group is not None, failure)
    shard = gather = None
    vocab_group = _vocabulary_group(checked, hint)
    if vocab_group is not None:
        shard, failure = _agree_on_vocabulary(request, vocab_group, checked, failure)
    if data_group is not None:
        prepared = None if checked is None else checked.batch
        gather, failure = _agree_on_groups(
            data_group, request.function, checked, failure, group_size=None if checked is None else checked.group_size,
            group_ids=None if prepared is None else batch.group_ids,
            count=0 if prepared is None else prepared.layout.num_seqs,
            any_kept=prepared is not None and prepared.any_kept, all_kept=prepared is None or prepared.kept is None,
        )
    if failure is not None:
        raise failure

    settings, prepared = checked.settings, checked.batch
    # The entropy bonus reads the token entropy (and sends its gradient) through the row op's own
    # vocabulary pass: no second pass, no [tokens, vocab] tensor.
    with_entropy = settings.return_entropy or settings.entropy_coef > 0
    token_lp, entropy = _row_logprobs(checked, shard, with_entropy, _signal_tokens(checked, gather))
    objective = GroupObjective(
        prepared.layout, prepared.scores, old_seq_logprobs=prepared.old_seq_logprobs, eta=settings.eta,
        anchor=settings.anchor, reduction=settings.reduction, backend=checked.key, beta=prepared.beta,
        ref_logprobs=prepared.ref_logprobs, valid=prepared.valid, gather=gather, kept=prepared.kept,
        score_eps=settings.score_eps, length_normalize=settings.length_normalize,
        entropy_coef=settings.entropy_coef,
    )
    loss = objective.forward(token_lp, entropy)
    if not settings.return_aux:
        return loss
    aux = objective.aux()
    aux["token_logprobs"] = aux["token_logprobs"].view(prepared.token_shape)
    if settings.return_entropy:
        aux["token_entropy"] = entropy.detach().view(prepared.token_shape)
    return loss, aux


def selective_logprobs(request: LogprobsRequest) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Per-token log-probs (and entropies) of the labels, over a whole or sharded vocabulary."""
    checks.check_traceable(request.function, request.options.validate, _distributed_keywords(request.placement))
    hint = _vocab_group_hint(request.source, request.placement)

    def check() -> _Checked:
        source, shard_request, original = _resolve_source(request.source, request.placement)
        rows, device, dtype, vocab_size = _check_rows(source, shard_request is not None, original)
        options = request.options
        inv_temperature = 1.0 / checks.check_positive("temperature", options.temperature)
        scale, cap = checks.check_logit_transform(options.logit_scale, options.logit_softcap, inv_temperature)
        settings = checks.LossSettings(
            eta=1.0, anchor=True, inv_temperature=inv_temperature, reduction="none", return_aux=False,
            validate=checks.check_flag("validate", options.validate),
            return_entropy=checks.check_flag("return_entropy", options.return_entropy), logit_scale=scale,
            logit_softcap=cap,
        )
        _check_sharded_transform(settings, shard_request is not None)
        key = backend_key(get_backend(options.backend, device))
        input_name = "logits" if rows[0] == "logits" else "hidden"
        labels = checks.prepare_labels(request.labels, _token_shape(source), None if shard_request else vocab_size,
                                          device, input_name, request.ignore_index, settings.validate)
        return _Checked(settings, key, device, dtype, rows, labels, shard_request=shard_request)

    checked, failure = _checked_or_failure(check, hint is not None)
    shard = None
    vocab_group = _vocabulary_group(checked, hint)
    if vocab_group is not None:
        shard, failure = _agree_on_vocabulary(request, vocab_group, checked, failure)
    if failure is not None:
        raise failure
    token_lp, entropy = _row_logprobs(checked, shard, checked.settings.return_entropy)
    shape = request.labels.shape
    if checked.settings.return_entropy:
        return token_lp.view(shape), entropy.view(shape)
    return token_lp.view(shape)


def candidate_loss(request: CandidateRequest) -> LossOutput:
    """Token-level TPO: each state's K candidates form a group (states may be split over ranks)."""
    checks.check_traceable(request.function, request.options.validate, _distributed_keywords(request.placement))
    source = request.source
    data_group, failure = _data_group(request.placement.process_group)

    def check() -> _Checked:
        options = request.options
        if isinstance(source, Logits):
            matrix = checks.check_logits(source.logits, (2,))
            num_states, vocab_size, device = matrix.shape[0], matrix.shape[1], matrix.device
            dtype, input_name = compute_dtype(matrix.dtype), "logits"
        else:
            checks.check_head(source.hidden, source.weight, source.bias, hidden_ndims=(2,), same_dtype=True)
            num_states, vocab_size, device = source.hidden.shape[0], source.weight.shape[0], source.hidden.device
            dtype, input_name = compute_dtype(source.hidden.dtype), "hidden"
        settings = _settings(options)
        key = backend_key(get_backend(options.backend, device))
        candidates, scores, old = checks.prepare_candidates(
            num_states, vocab_size, device, dtype, request.candidates, request.scores, request.old_logprobs,
            input_name, settings.validate, whole=data_group is None,
        )
        return _Checked(settings, key, device, dtype, (input_name, candidates, scores, old), None)

    checked, failure = _checked_or_failure(check, data_group is not None, failure)
    gather = None
    if data_group is not None:
        num_states, num_cand = (0, 0) if checked is None else tuple(checked.rows[1].shape)
        gather, failure = _agree_on_groups(
            data_group, request.function, checked, failure, group_size=None, group_ids=None, count=num_states,
            any_kept=True, all_kept=True, per_item=num_cand, extra={"candidates per state": num_cand}, what="state",
        )
    if failure is not None:
        raise failure

    settings, key = checked.settings, checked.key
    _, candidates, scores, old = checked.rows
    if isinstance(source, Logits):
        matrix, _ = rows(source.logits)
        gather_logits = lambda inv_t: candidate_logits(matrix, candidates, inv_temperature=inv_t,  # noqa: E731
                                                       backend=key)
    else:
        gather_logits = lambda inv_t: linear_candidate_logits(source.hidden, source.weight, source.bias,  # noqa: E731
                                                              candidates, inv_temperature=inv_t, backend=key)
    cand = transformed_candidates(gather_logits, settings)
    num_states, num_cand = cand.shape
    objective = GroupObjective(
        candidate_layout(num_states, num_cand, cand.device), scores.reshape(-1),
        old_seq_logprobs=None if old is None else old.reshape(-1), eta=settings.eta, anchor=settings.anchor,
        reduction=settings.reduction, backend=key, gather=gather, score_eps=settings.score_eps,
    )
    loss = objective.forward(cand.reshape(-1))
    if not settings.return_aux:
        return loss
    aux = objective.aux()
    state_loss = aux.pop("group_loss")
    per_member = {name: aux[name].view(num_states, num_cand) for name in ("seq_logprobs", "p", "q", "u", "coef")}
    per_member["candidate_logits"] = per_member.pop("seq_logprobs")
    per_member["state_loss"] = state_loss
    if gather is not None:
        per_member["state_offset"] = aux["seq_offset"] // max(num_cand, 1)
    return loss, per_member


# ----------------------------------------------------------------------------- row layouts


def transformed_candidates(gather: Callable[[float], Tensor], settings: checks.LossSettings) -> Tensor:
    """Tempered candidate logits through the logit transform. ``gather(inv_temperature)`` gives
    ``[R, K]`` candidate logits times that factor: the scale folds in without a cap; with one,
    the raw logits are gathered and capped in plain autograd (``[R, K]`` entries only)."""
    transform = LogitTransform.of(settings.logit_scale, settings.logit_softcap)
    if transform is None:
        return gather(folded_inv_temperature(settings.inv_temperature, settings.logit_scale, None))
    return transform.differentiable(gather(1.0)) * settings.inv_temperature


def rows(x: Tensor) -> Tuple[Tensor, bool]:
    """``[..., D]`` as a ``[M, D]`` matrix the row ops read in place (unit column stride, rows
    that flatten into one row stride >= D), else a contiguous copy; True when that needed a copy."""
    width = x.shape[-1]
    row_stride = _flat_row_stride(x)
    if x.numel() > 0 and x.stride(-1) == 1 and row_stride is not None and row_stride >= width:
        return x.reshape(-1, width), False  # a view
    return x.reshape(-1, width).contiguous(), True


def logits_rows(x: Tensor, sharded: bool = False) -> Tuple[Tensor, bool]:
    """:func:`rows` for the log-prob row op, which also reads ``[B, T, V]`` logits whose rows do
    not flatten into one row stride (``logits[:, :-1]``) piece by piece: such logits pass as they
    are, instead of a copy (which would triple the peak memory of the logits path). A vocabulary
    shard's row op takes a matrix."""
    if (not sharded and x.dim() == 3 and x.numel() > 0 and x.stride(-1) == 1 and _flat_row_stride(x) is None
            and x.stride(1) >= x.shape[2] and x.stride(0) >= x.shape[1] * x.stride(1)):  # rows never overlap
        return x, False
    return rows(x)


def _flat_row_stride(x: Tensor) -> Optional[int]:
    """The row stride of ``x`` flattened to ``[M, D]`` without a copy, or None when its leading
    dims do not merge (``logits[:, :-1]``: the rows of consecutive batch entries are further
    apart than those within one). Size-1 dims do not count."""
    dims = [(size, stride) for size, stride in zip(x.shape[:-1], x.stride()[:-1]) if size != 1]
    for (_, outer_stride), (inner_size, inner_stride) in zip(dims, dims[1:]):
        if outer_stride != inner_size * inner_stride:
            return None
    return dims[-1][1] if dims else x.shape[-1]
