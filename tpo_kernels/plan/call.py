"""The check pass of a call: every check a public call makes, run once before any work, giving a
frozen :class:`~tpo_kernels.plan.records.Plan` (see :mod:`tpo_kernels.plan.records`).

A plan says everything the work needs and nothing it must re-check. The primitive checks live in
:mod:`tpo_kernels.checks` (one argument each; the settings in one pass,
:func:`~tpo_kernels.checks.arguments.check_options`; the batch); this module runs them in call
order and builds the records. The pipeline runs the pass inside the block whose exception the
ranks exchange (so that a failing check on one rank becomes the same error on every rank), then
agrees, then works. A vocabulary split over ranks is resolved by :mod:`tpo_kernels.plan.vocabulary`,
entered only when a vocabulary group or a DTensor is present.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ..backends.rows import compute_dtype
from ..backends import resolve_backend_key
from ..ops import HeadTiles, RowRequest, TilePolicy
from ..requests import CandidateRequest, Head, Logits, Logprobs, LogprobsRequest, Placement, SequenceRequest
from ..requests import Source
from ..checks.arguments import (check_chunk_size, check_flag, check_float_tensor, check_grad_accum_dtype, check_head,
                                check_head_dtype, check_logits, check_logits_cache, check_logits_source,
                                check_options, check_row_options, check_tile_policy)
from ..checks.batches import BatchSplit, LabelSpace, ValueChecks, prepare_batch, prepare_labels
from ..checks.candidates import prepare_candidates
from ..checks.kept_sets import check_sampling_mask
from ..checks.placement import check_distinct_groups, check_group
from .records import CandidateRows, CheckedCall, HeadRows, LogitsRows, LogprobRows, Plan, RankGroups, RowSource


# ----------------------------------------------------------------------------- compiling

# What a call checks when Dynamo traces it (``torch.compile``).
#
# Two things cannot be part of a single graph: the value checks of ``validate=True`` (they read a
# result back to the host to decide whether to raise) and the collectives of a distributed call
# (the agreement of the ranks and the gathers run eagerly). Without ``fullgraph=True`` Dynamo
# breaks the graph there and runs them eagerly, which works; with it, Dynamo stops with an error
# about ``Tensor.tolist()`` or a skipped function that names neither cause. A call traced as one
# graph therefore stops first, with an error that says what to change.


@torch.compiler.assume_constant_result
def _refuse_in_one_graph(message: str) -> bool:
    """Raise ``RuntimeError(message)`` while Dynamo traces with ``fullgraph=True`` (or under
    ``torch._dynamo.error_on_graph_break(True)``), where a graph break is an error; False
    otherwise. Runs at trace time (``assume_constant_result``): Dynamo's current frame can be
    read there, and an error raised there reaches the user with its own words first (inside
    Dynamo's ``InternalTorchDynamoError``; traced code raising would read "Observed exception").
    A Dynamo without these fields gives no verdict (False), which leaves Dynamo's own error."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator  # noqa: PLC0415

        tx = InstructionTranslator.current_tx()
        one_graph = bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))
    except Exception:  # noqa: BLE001 - another Dynamo: no verdict
        return False
    if one_graph:
        raise RuntimeError(message)
    return False


def check_traceable(function: str, validate: bool, distributed_keywords: tuple) -> None:
    """Raise one clear error when ``function`` is traced as a single graph with value checks
    (``validate=True``) or distributed keywords (``distributed_keywords``: the names of those
    that are set); nothing outside ``torch.compile``. Runs before any other check."""
    if not torch.compiler.is_compiling():
        return
    if distributed_keywords:
        names = " and ".join(distributed_keywords)
        _refuse_in_one_graph(
            f"{function} with {names} cannot be traced into one graph: distributed calls run eagerly (the ranks "
            f"agree on their inputs and gather rows with collectives). Call it outside the compiled region, or "
            f"compile without fullgraph=True so that Dynamo runs it eagerly between graphs")
    elif validate is True:
        _refuse_in_one_graph(
            f"{function} with validate=True cannot be traced into one graph: its value checks read results back "
            f"to the host. Pass validate=False under torch.compile(fullgraph=True) (or compile without "
            f"fullgraph, which runs the checks eagerly between graphs)")


# ----------------------------------------------------------------------------- placement


def checked_group(name: str, group):
    """``(group | None, failure | None)`` of the keyword ``name`` (``process_group``,
    ``context_parallel_group``): the group (None for one rank: nothing to exchange, the call is
    bitwise the call without it), or why it is none (then this rank has no group to report on,
    unless another of the call's groups carries the error)."""
    if group is None:
        return None, None
    try:
        check_group(name, group)
        return (group if torch.distributed.get_world_size(group) > 1 else None), None
    except Exception as error:  # noqa: BLE001 - reported to the peers or raised below
        return None, error


def _vocabulary_tensor(source: Source) -> Tuple[Optional[Tensor], int]:
    """The tensor that holds the vocabulary and its dimension: the logits' last, the lm_head
    weight's first; None for log-probs."""
    if isinstance(source, Logits):
        return source.logits, -1
    if isinstance(source, Head):
        return source.weight, 0
    return None, 0


def is_dtensor(x) -> bool:
    """A DTensor can only exist once torch.distributed.tensor has been imported: never import it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def vocab_group_hint(source: Source, where: Placement):
    """The group this call's vocabulary would be split over, read without any check, so that a
    rank whose placement checks fail still joins its peers' exchange on it and reports there:
    ``vocab_parallel_group`` when it is a process group, else the mesh group a DTensor logits /
    weight is sharded over on the vocabulary, else None."""
    if where.vocab_parallel_group is not None:
        group = where.vocab_parallel_group
        ready = torch.distributed.is_available() and torch.distributed.is_initialized()
        return group if ready and isinstance(group, torch.distributed.ProcessGroup) else None
    tensor, dim = _vocabulary_tensor(source)
    if not is_dtensor(tensor):
        return None
    from .vocabulary import dtensor_vocab_group  # noqa: PLC0415 - only with a DTensor

    try:
        return dtensor_vocab_group(tensor, dim)
    except Exception:  # noqa: BLE001 - a malformed DTensor: no group to report on
        return None


def _resolve_source(source: Source, where: Placement):
    """``(source with local tensors, shard request | None, the logits as passed | None)``: the
    vocabulary's placement, before any check that needs its size. A call with neither a
    vocabulary group nor a DTensor has its whole vocabulary here: plan/vocabulary.py is not entered."""
    if (where.vocab_parallel_group is None and where.vocab_start_index is None
            and not is_dtensor(_vocabulary_tensor(source)[0])):
        return source, None, None
    from .vocabulary import vocab_parallel_head, vocab_shard  # noqa: PLC0415 - only for a sharded vocabulary

    if isinstance(source, Logits):
        logits, shard = vocab_shard("logits", source.logits, where.vocab_parallel_group, where.vocab_start_index)
        return Logits(logits=logits, inplace_backward=source.inplace_backward), shard, source.logits
    if isinstance(source, Head):
        hidden, weight, bias, shard = vocab_parallel_head(source.hidden, source.weight, source.bias,
                                                          where.vocab_parallel_group, where.vocab_start_index)
        return dataclasses.replace(source, hidden=hidden, weight=weight, bias=bias), shard, None
    return source, None, None


# ----------------------------------------------------------------------------- row layouts

# How the log-prob row op reads logits: a matrix in place, a strided batch in place, or a copy.


def rows_matrix(x: Tensor) -> Tuple[Tensor, bool]:
    """``[..., D]`` as a ``[M, D]`` matrix the row ops read in place (unit column stride, rows
    that flatten into one row stride >= D), else a contiguous copy; True when that needed a copy."""
    width = x.shape[-1]
    row_stride = _flat_row_stride(x)
    if x.numel() > 0 and x.stride(-1) == 1 and row_stride is not None and row_stride >= width:
        return x.reshape(-1, width), False  # a view
    return x.reshape(-1, width).contiguous(), True


def logits_rows(x: Tensor, sharded: bool = False) -> Tuple[Tensor, bool]:
    """:func:`rows_matrix` for the log-prob row op, which also reads ``[B, T, V]`` logits whose
    rows do not flatten into one row stride (``logits[:, :-1]``) in one launch: such logits pass
    as they are, instead of a copy (which would triple the peak memory of the logits path). A
    vocabulary shard's row op takes a matrix."""
    if (not sharded and x.dim() == 3 and x.numel() > 0 and x.stride(-1) == 1 and _flat_row_stride(x) is None
            and x.stride(1) >= x.shape[2] and x.stride(0) >= x.shape[1] * x.stride(1)):  # rows never overlap
        return x, False
    return rows_matrix(x)


def _flat_row_stride(x: Tensor) -> Optional[int]:
    """The row stride of ``x`` flattened to ``[M, D]`` without a copy, or None when its leading
    dims do not merge (``logits[:, :-1]``: the rows of consecutive batch entries are further
    apart than those within one). Size-1 dims do not count."""
    dims = [(size, stride) for size, stride in zip(x.shape[:-1], x.stride()[:-1]) if size != 1]
    for (_, outer_stride), (inner_size, inner_stride) in zip(dims, dims[1:]):
        if outer_stride != inner_size * inner_stride:
            return None
    return dims[-1][1] if dims else x.shape[-1]


# ----------------------------------------------------------------------------- settings and rows


def _check_sharded_transform(row: RowRequest, sharded: bool) -> None:
    if sharded and row.logit_softcap is not None:
        raise ValueError("logit_softcap is not supported with a vocabulary-parallel head or logits "
                         "(vocab_parallel_group / DTensor shards); logit_scale is")


def _storage_root(tensor: Tensor) -> Tensor:
    """The tensor that owns ``tensor``'s storage: the root of its chain of views (``_base``, any
    depth; ``tensor`` itself when it is no view)."""
    root = tensor
    while root._base is not None:
        root = root._base
    return root


def _graph_owns_storage(tensor: Tensor) -> bool:
    """Whether ``tensor``'s storage is an intermediate activation of the autograd graph, which the
    in-place backward may overwrite: the root of its views was created by the graph (has a
    ``grad_fn``). Decided from the storage, not the view: a view of a leaf has a ``grad_fn`` of its
    own, but its storage is the leaf's (``leaf[:, :-1]``, and ``out.logits.detach().requires_grad_()``
    of a two-stage backward, which shares its storage with the model's output). A root without a
    ``grad_fn`` (a leaf, or a tensor no graph made) belongs to the caller."""
    return _storage_root(tensor).grad_fn is not None


def _check_rows(source: Source, sharded: bool, original) -> Tuple[RowSource, torch.device, torch.dtype, int]:
    """The row op's inputs: ``(rows, device, compute dtype, vocabulary size of this rank)``."""
    if isinstance(source, Logits):
        logits, inplace_backward = check_logits_source(source.logits, source.inplace_backward)
        matrix, copied = logits_rows(logits, sharded)
        # Overwrite the buffer only when it is ours (a copy) or the graph's (_graph_owns_storage),
        # never a leaf's storage, whatever view of it arrives. A DTensor's local shard is a view of
        # its local tensor made by to_local: the DTensor as passed (``original``) says whose the
        # storage is. Under torch.compile the graph owns the buffers: the backward is out of place.
        owner = logits if original is None else original
        inplace = not torch.compiler.is_compiling() and (copied or (inplace_backward and _graph_owns_storage(owner)))
        rows = LogitsRows(matrix=matrix, inplace_backward=inplace)
        return rows, logits.device, compute_dtype(logits.dtype), logits.shape[-1]
    hidden, weight, bias = source.hidden, source.weight, source.bias
    check_head(hidden, weight, bias)
    chunk_size = check_chunk_size(source.chunk_size)
    accum = check_grad_accum_dtype(source.grad_accum_dtype, weight.dtype)
    check_tile_policy(source.tile_policy, TilePolicy)
    head_dtype = check_head_dtype(source.head_dtype, torch.promote_types(hidden.dtype, weight.dtype))
    policy = source.tile_policy or TilePolicy.for_device(hidden.device)
    if check_flag("batch_invariant", source.batch_invariant):  # before chunk_size: unclipped by M under it
        policy = dataclasses.replace(policy, batch_invariant=True)
    cache = check_logits_cache(source.logits_cache_bytes, policy.logits_cache_bytes, sharded)
    policy = policy.with_logits_cache(cache)
    flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    if chunk_size is None:  # the tile budget, in rows of V
        chunk_size = policy.chunk_size(flat.shape[0], weight.shape[0])
    tiles = HeadTiles(chunk_size=chunk_size, policy=policy, grad_accum_dtype=accum,
                      head_dtype=None if source.head_dtype is None else head_dtype)
    rows = HeadRows(hidden=flat, weight=weight, bias=bias, tiles=tiles)
    dtype = compute_dtype(head_dtype)
    return rows, hidden.device, dtype, weight.shape[0]


def _checked_mask(mask, source: Source, input_name: str):
    """The metadata-checked ``sampling_mask`` (None without one), refused with a fused head's
    logits cache (replay forms no logits tile to cache). With a vocabulary shard the mask holds
    global ids, the same on every rank: each rank replays its part of every set."""
    if mask is None:
        return None
    if isinstance(source, Head) and source.logits_cache_bytes:
        raise ValueError("logits_cache_bytes > 0 has nothing to cache with a sampling_mask (replay forms no logits "
                         "tile); leave logits_cache_bytes at 0")
    device = (source.logits if isinstance(source, Logits) else source.hidden).device
    return check_sampling_mask(mask, _token_shape(source), device, input_name)


def _token_shape(source: Source) -> Tuple[int, ...]:
    if isinstance(source, Logprobs):
        return tuple(source.logprobs.shape)
    return tuple((source.logits if isinstance(source, Logits) else source.hidden).shape[:-1])

# ----------------------------------------------------------------------------- the check pass



def check_call(request: Union[SequenceRequest, LogprobsRequest, CandidateRequest]) -> CheckedCall:
    """The check pass of a call, before any work. On one rank a failing check raises here. With
    a group present (a process group, a vocabulary group, a DTensor) the failure is returned
    instead, for the ranks to exchange (the pipeline's agreement): every rank then raises it,
    none waits for a peer that has stopped."""
    where = request.placement
    keywords = tuple(name for name in ("process_group", "context_parallel_group", "vocab_parallel_group")
                     if getattr(where, name) is not None)
    check_traceable(request.function, request.options.validate, keywords)
    data_parallel, failure = checked_group("process_group", where.process_group)
    context, context_failure = checked_group("context_parallel_group", where.context_parallel_group)
    failure = failure or context_failure
    hint = None if isinstance(request, CandidateRequest) else vocab_group_hint(request.source, where)
    distributed_call = hint is not None or data_parallel is not None or context is not None
    if failure is not None and not distributed_call:
        raise failure
    plan = None
    if failure is None:
        try:
            if isinstance(request, SequenceRequest):
                plan = plan_sequence(request, RankGroups(data=data_parallel, context=context))
            elif isinstance(request, LogprobsRequest):
                plan = plan_logprobs(request)
            else:
                plan = plan_candidates(request, data_parallel)
        except Exception as error:  # noqa: BLE001 - every rank raises it after the exchange
            if not distributed_call:
                raise
            failure = error
    # The vocabulary exchange: the resolved shard's group, or (this rank's checks failed) the
    # group its arguments name.
    vocab_group = hint if plan is None else (None if plan.shard_request is None else plan.shard_request.group)
    return CheckedCall(plan=plan, failure=failure, data_group=data_parallel, vocab_group=vocab_group,
                       context_group=context)


# ----------------------------------------------------------------------------- the three plans


def plan_sequence(request: SequenceRequest, groups: RankGroups) -> Plan:
    """The check pass of a sequence-level loss (``groups``: the checked data- and context-parallel
    groups, None where absent or of one rank)."""
    source, shard_request, original = _resolve_source(request.source, request.placement)
    sharded = shard_request is not None
    present = {name: group for name, group in (("process_group", groups.data), ("context_parallel_group", groups.context),
               ("vocab_parallel_group", shard_request.group if sharded else None)) if group is not None}
    if len(present) > 1:  # one rank's call has nothing to tell apart
        check_distinct_groups(present)
    batch = request.batch
    if isinstance(source, Logprobs):
        logprobs = check_float_tensor("logprobs", source.logprobs, (1, 2))
        row, rule, weights, flags, batch = check_options(request.options, batch, temperature=1.0)
        device, dtype, vocab_size = logprobs.device, compute_dtype(logprobs.dtype), 1
        # Every position is a "label" 0 of a one-entry vocabulary; the mask says which count.
        labels = torch.zeros(logprobs.shape, dtype=torch.int64, device=device)
        rows: RowSource = LogprobRows(logprobs=logprobs)
        input_name = "logprobs"
    else:
        rows, device, dtype, vocab_size = _check_rows(source, sharded, original)
        row, rule, weights, flags, batch = check_options(request.options, batch)
        labels = request.batch.labels
        input_name = "logits" if isinstance(rows, LogitsRows) else "hidden"
    sampling = None if isinstance(source, Logprobs) else _checked_mask(batch.sampling_mask, source, input_name)
    _check_sharded_transform(row, sharded)
    key = resolve_backend_key(request.options.backend, device)
    space = LabelSpace(token_shape=_token_shape(source), vocab_size=None if sharded else vocab_size, device=device,
                       dtype=dtype, input_name=input_name)
    prepared = prepare_batch(
        batch, labels, space, validate=flags.validate,
        split=BatchSplit(completions=groups.data is not None, positions=groups.context is not None),
        length_normalize=rule.length_normalize, logprobs=rows.logprobs if isinstance(rows, LogprobRows) else None,
        sampling=sampling,
    )
    # Completions split over ranks: K counts over every rank's, checked once the sizes are agreed.
    return Plan(row=row, rule=rule, weights=weights, flags=flags,
                backend=key, device=device, dtype=dtype, rows=rows, labels=prepared.labels, batch=prepared,
                group_size=prepared.split_group_size, shard_request=shard_request, kept=prepared.kept_sets)


def plan_logprobs(request: LogprobsRequest) -> Plan:
    """The check pass of the per-token log-probs."""
    source, shard_request, original = _resolve_source(request.source, request.placement)
    sharded = shard_request is not None
    rows, device, dtype, vocab_size = _check_rows(source, sharded, original)
    options = request.options
    row, flags, ignore_index = check_row_options(options, request.ignore_index)
    _check_sharded_transform(row, sharded)
    key = resolve_backend_key(options.backend, device)
    input_name = "logits" if isinstance(rows, LogitsRows) else "hidden"
    sampling = _checked_mask(request.sampling_mask, source, input_name)
    checks = ValueChecks() if flags.validate else None
    labels = prepare_labels(request.labels, _token_shape(source), None if sharded else vocab_size, device,
                            input_name, ignore_index, flags.validate, checks=checks,
                            mask=None if sampling is None else sampling.nonempty)
    kept = None if sampling is None else sampling.build(labels, None if sharded else vocab_size, checks)
    if checks is not None:
        checks.read()
    return Plan(row=row, rule=None, weights=None, flags=flags, backend=key, device=device, dtype=dtype, rows=rows,
                labels=labels, shard_request=shard_request, kept=kept)


def plan_candidates(request: CandidateRequest, data_parallel) -> Plan:
    """The check pass of token-level TPO (``data_parallel`` as in :func:`plan_sequence`)."""
    source, options = request.source, request.options
    if isinstance(source, Logits):
        matrix = check_logits(source.logits, (2,))
        num_states, vocab_size, device = matrix.shape[0], matrix.shape[1], matrix.device
        dtype, input_name = compute_dtype(matrix.dtype), "logits"
    else:
        check_head(source.hidden, source.weight, source.bias, hidden_ndims=(2,), same_dtype=True)
        num_states, vocab_size, device = source.hidden.shape[0], source.weight.shape[0], source.hidden.device
        dtype, input_name = compute_dtype(source.hidden.dtype), "hidden"
    row, rule, weights, flags, _ = check_options(options)
    key = resolve_backend_key(options.backend, device)
    space = LabelSpace(token_shape=(num_states,), vocab_size=vocab_size, device=device, dtype=dtype,
                       input_name=input_name)
    candidates, scores, old = prepare_candidates(request.candidates, request.scores, request.old_logprobs, space,
                                                 validate=flags.validate, whole=data_parallel is None)
    rows = CandidateRows(input_name=input_name, candidates=candidates, scores=scores, old_logprobs=old)
    return Plan(row=row, rule=rule, weights=weights, flags=flags, backend=key, device=device, dtype=dtype, rows=rows,
                labels=None)
