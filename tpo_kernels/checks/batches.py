"""A sequence-level batch (padded or packed, groups by size or id) and token-level candidates,
checked and described as flat rows plus a layout."""

from __future__ import annotations

from dataclasses import dataclass
import os
import sys
import warnings
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from ..group_math import BatchLayout, build_layout, length_weights, segment_sum
from .arguments import check_batch_tensors, check_integer_dtype, check_integer_tensor, check_tensor, reject_meta


# ----------------------------------------------------------------------------- value checks

# Value checks read back from the device together, once per call.
#
# A check of values (label ranges, finite scores, ...) needs its result on the host to raise an
# error, and every read-back makes the host wait for the device. The value checks of one call are
# therefore computed on the device as 0-d bool tensors, stacked and read back with one
# ``tolist()``; only when a check fails is more read, to word its error.


class ValueChecks:
    """Conditions gathered during a call and read back by :meth:`read`, in the order added."""

    def __init__(self) -> None:
        self._conditions: List[Tensor] = []
        self._errors: List[Optional[Callable[[], Exception]]] = []

    def require(self, holds: Tensor, error: Callable[[], Exception]) -> None:
        """At :meth:`read`, raise ``error()`` unless the 0-d bool ``holds`` is True."""
        self._conditions.append(holds)
        self._errors.append(error)

    def observe(self, value: Tensor) -> int:
        """Read the 0-d bool ``value`` back with the checks; returns its index in :meth:`read`."""
        self._conditions.append(value)
        self._errors.append(None)
        return len(self._conditions) - 1

    def read(self) -> List[bool]:
        """One read-back of every condition; raises the error of the first that fails."""
        if not self._conditions:
            return []
        values = torch.stack([c.reshape(()) for c in self._conditions]).tolist()
        for holds, error in zip(values, self._errors):
            if error is not None and not holds:
                raise error()
        return values


# ----------------------------------------------------------------------------- labels


def _label_error(labels: Tensor, bad: Tensor, vocab_size: int) -> ValueError:
    found = labels[bad][0].item()  # reads back, on the error path only
    return ValueError(
        f"labels must hold ids in [0, {vocab_size}) or ignore_index at counted positions; found {found}"
    )


def prepare_labels(labels, token_shape, vocab_size: Optional[int], device: torch.device, input_name: str,
                   ignore_index, validate: bool, mask: Optional[Tensor] = None,
                   checks: Optional[ValueChecks] = None, metadata_checked: bool = False) -> Tensor:
    """Flat int64 ``[M]`` labels with -1 at the positions that do not count (``ignore_index``,
    or False in the flat bool ``mask``); with ``validate``, counted ids are checked to lie in
    ``[0, vocab_size)`` (``[0, inf)`` for ``vocab_size`` None, a shard's vocabulary before the
    shards are placed): added to ``checks`` when given, else read back here. ``ignore_index``:
    checked with the call's settings (:func:`~tpo_kernels.checks.arguments.check_ignore_index`);
    ``metadata_checked``: the labels' type, dtype and device too (a batch's, with its scores)."""
    if not metadata_checked:
        check_integer_tensor("labels", labels, device, input_name)
    if tuple(labels.shape) != tuple(token_shape):
        raise ValueError(
            f"labels must have shape {tuple(token_shape)} (the leading dims of {input_name}), got {tuple(labels.shape)}"
        )
    # Compared as int64, the labels' value range: in a narrower dtype torch would wrap
    # ignore_index (an int32 label 1 would equal 2**32 + 1).
    flat = labels.reshape(-1).to(torch.int64)
    counted = flat != ignore_index
    if mask is not None:
        counted = counted & mask
    if validate:
        pending = ValueChecks() if checks is None else checks
        bad = counted & (flat < 0) if vocab_size is None else counted & ((flat < 0) | (flat >= vocab_size))
        pending.require(~bad.any(), lambda: _label_error(flat, bad, vocab_size))
        if checks is None:
            pending.read()
    return torch.where(counted, flat, -1).contiguous()


# ----------------------------------------------------------------------------- sequence batches

# Log-probabilities are at most 0. A log-prob above 0 by more than this (per counted token;
# per completion, this times its counted tokens for sums, this for means) is not rounding: it is
# a sign flip (negative log-likelihoods), probabilities, or logits passed as log-probs. Rounding
# near 0 is far below it: fp32 log-softmax of logits up to 1e3 is off by ~1e-4 at most. The rule
# holds for every log-prob input a call reads with validate=True: old_logprobs, ref_logprobs and
# the logprobs of tpo_loss_from_logprobs.
OLD_LOGPROB_SLACK = 1e-2


@dataclass(frozen=True)
class LabelSpace:
    """What the labels index: the shape they must have (the leading dims of the input), the
    vocabulary (None: a shard's, bounded once the shards are placed), the device, the compute dtype
    and the input's name (``logits``, ``hidden``, ``logprobs``) for the messages."""

    token_shape: Tuple[int, ...]
    vocab_size: Optional[int]
    device: torch.device
    dtype: torch.dtype
    input_name: str = "logits"


@dataclass(frozen=True)
class BatchSplit:
    """How one rank's batch is a part of the whole: its ``completions`` are some of the batch's
    (split over data-parallel ranks), its ``positions`` some of each completion's (split over
    context-parallel ranks); neither: the whole batch."""

    completions: bool = False
    positions: bool = False


@dataclass
class PreparedBatch:
    token_shape: Tuple[int, ...]  # labels.shape: (N, T) padded or (M,) packed
    labels: Tensor  # [M] int64, -1 on rows that do not count (masked, ignore_index, outside)
    layout: BatchLayout
    scores: Tensor  # [N] float64
    old_seq_logprobs: Optional[Tensor]  # [N] float64, or None (on-policy)
    beta: float
    ref_logprobs: Optional[Tensor]  # [M] compute dtype, 0 where not counted; None when beta == 0
    # Part of a batch split over ranks: which completions have a counted token ([N] bool, None =
    # all, unchecked with validate=False, or decided on the counts summed over context ranks); the
    # groups are formed after the gather. any_kept: some completion has a counted token here.
    kept: Optional[Tensor] = None
    any_kept: bool = True
    # Of a split batch: the checked group_size, K over the concatenation of the ranks' completions
    # when they are split (None with group_ids).
    split_group_size: Optional[int] = None
    # Positions split over ranks, per-token old_logprobs: [N] float64 sums over this rank's counted
    # tokens (summed over the ranks, then divided by the counts with length_normalize).
    old_token_sums: Optional[Tensor] = None
    seq_log_weights: Optional[Tensor] = None  # [N] float64 log w (finite or -inf), or None
    kept_sets: object = None  # the KeptSets of sampling_mask (checks/kept_sets.py), or None


def _check_cu_seqlens(cu_seqlens, device: torch.device, num_tokens: int, input_name: str,
                      validate: bool) -> Tuple[Tensor, Tuple[int, int]]:
    """int64 ``cu_seqlens`` and the host ints the packed layout needs (rows covered, longest
    completion), read back once together with the check of the values."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    check_integer_dtype("cu_seqlens", cu_seqlens)
    reject_meta("cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int64)
    seq_len = cu_seqlens[1:] - cu_seqlens[:-1]
    read = [cu_seqlens[-1], seq_len.max()]
    if validate:
        read.append((cu_seqlens[0] != 0) | (seq_len < 0).any() | (cu_seqlens[-1] > num_tokens))
    values = torch.stack(read).tolist()
    if validate and values[2]:
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at most at M={num_tokens} "
            f"(the rows of {input_name}); got {cu_seqlens.tolist()[:8]}..."
        )
    return cu_seqlens, (values[0], values[1])


# Frames a warning skips to reach the user's call: this package's, and torch.nn's (module calls).
_OWN_DIRS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                  for path in (os.path.dirname(os.path.abspath(__file__)), torch.nn.__file__))


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` called here that points at the first frame outside
    tpo_kernels and torch.nn (the user's call), whatever path led here."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_OWN_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def check_grouping(group_size, group_ids, num_seqs: int, device: torch.device, input_name: str,
                   whole: bool = True) -> Optional[int]:
    """The checked ``group_size`` as a Python int (None with ``group_ids``). ``whole=False``: this
    rank's part of a batch split over ranks, where ``group_size`` counts over the concatenation
    (its divisibility is checked once the ranks' sizes are known)."""
    if (group_size is None) == (group_ids is None):
        raise ValueError("pass exactly one of group_size (K contiguous completions per prompt) or group_ids [N]")
    if group_size is not None:  # an int >= 1, checked with the call's settings
        if group_size == 1 and not torch.compiler.is_compiling():
            warnings.warn("group_size=1: every group holds a single completion, whose target is itself (p = q = 1), "
                          "so the loss is 0 and trains nothing; pass the number of completions per prompt (>= 2)",
                          UserWarning, stacklevel=_caller_stacklevel())
        if whole and num_seqs % group_size != 0:
            raise ValueError(f"group_size must divide the number of completions N={num_seqs}, got {group_size}")
        return group_size
    check_integer_tensor("group_ids", group_ids, device, input_name)
    if tuple(group_ids.shape) != (num_seqs,):
        raise ValueError(f"group_ids must have shape [N]=({num_seqs},), got {tuple(group_ids.shape)}")
    return None


def check_scores(scores, shape: Tuple[int, ...], device: torch.device, input_name: str,
                 acc: torch.dtype, checks: Optional[ValueChecks], shape_name: str,
                 metadata_checked: bool = False) -> Tensor:
    """Scores as float64 whatever ``acc``: the group math standardizes them in float64 (fp32 would
    lose spreads below ~1e-22 or above ~1e19, and float64 scores closer than fp32 resolution).
    Finiteness is added to ``checks`` (None: not checked). The message formats ``shape`` only on
    failure: formatting a symbolic size would pin it under torch.compile(dynamic=True).
    ``metadata_checked``: the scores' type and device already checked (with a batch's labels)."""
    if not metadata_checked:
        check_tensor("scores", scores, device, input_name)
    if scores.dtype == torch.bool or scores.dtype.is_complex:
        raise TypeError(f"scores must be a real tensor, got {scores.dtype}")
    if tuple(scores.shape) != shape:
        raise ValueError(f"scores must have {shape_name}={shape}, got {tuple(scores.shape)}")
    scores = scores.to(torch.float64).contiguous()
    if checks is not None:
        checks.require(torch.isfinite(scores).all(), lambda: ValueError("scores must be finite (found NaN or inf)"))
    return scores


def _check_mask(mask, token_shape, device: torch.device, input_name: str,
                checks: Optional[ValueChecks]) -> Tensor:
    check_tensor("mask", mask, device, input_name)
    if tuple(mask.shape) != token_shape:
        raise ValueError(f"mask must have the shape of labels {token_shape}, got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask.reshape(-1)
    if checks is not None:
        checks.require(((mask == 0) | (mask == 1)).all(),
                       lambda: ValueError("mask must hold only 0 and 1 (or be a bool tensor)"))
    return mask.reshape(-1) != 0


def _require_log_probabilities(checks: ValueChecks, name: str, values: Tensor, slack, where: str) -> None:
    """Add to ``checks``: ``values`` (the log-probs ``name``) are at most ``slack`` (a float or a
    tensor of ``values``' shape) above 0. NaN passes here (a finiteness check words it)."""
    positive = values > slack
    checks.require(~positive.any(), lambda: ValueError(
        f"{name} must be log-probabilities (<= 0); found {values[positive][0].item():.6g} {where} "
        f"(more than rounding above 0: negative log-likelihoods, probabilities or logits?)"))


def check_float_values(name: str, x, device, input_name: str) -> None:
    check_tensor(name, x, device, input_name)
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a float tensor, got {x.dtype}")


def prepare_batch(
    batch,
    labels,
    space: LabelSpace,
    *,
    validate: bool = True,
    split: BatchSplit = BatchSplit(),
    length_normalize: bool = False,
    logprobs: Optional[Tensor] = None,
    sampling=None,
) -> PreparedBatch:
    """Check a sequence-level batch and describe it as flat ``[M]`` rows plus a layout.

    ``batch``: the call's :class:`tpo_kernels.requests.Batch`, its scalars already checked with the
    settings (:func:`~tpo_kernels.checks.arguments.check_options`); ``labels`` in place of its own.

    ``space``: what the labels index (``space.vocab_size`` None: a vocabulary shard's, not known yet;
    the upper bound of the labels is checked once the shards are placed). ``split.completions``: this rank's completions of a batch
    split over ranks: it may hold no completion or none with a counted token, its layout has one
    group per completion, and ``kept`` / ``any_kept`` say which completions the gathered groups
    keep. ``split.positions``: this rank's positions of every completion: it may hold no counted
    token (``any_kept`` observes whether it holds one), which completions are kept is decided on
    the counts summed over the ranks (``kept`` None), and per-token ``old_logprobs`` give
    ``old_token_sums``. ``length_normalize``: per-token ``old_logprobs`` give each completion's mean
    over its counted tokens instead of the sum (per-completion ones are used as given). ``logprobs``: the per-token
    log-probs of :func:`tpo_kernels.tpo_loss_from_logprobs`, checked (with ``validate``) at
    counted tokens by the rule of ``old_logprobs``. ``sampling``: a checked ``sampling_mask`` (empty set: not counted)."""
    scores, group_size, group_ids, cu_seqlens, mask = (batch.scores, batch.group_size, batch.group_ids,
                                                       batch.cu_seqlens, batch.mask)
    ignore_index, old_logprobs, ref_logprobs, beta = batch.ignore_index, batch.old_logprobs, batch.ref_logprobs, batch.beta
    token_shape, vocab_size, device, acc, input_name = (tuple(space.token_shape), space.vocab_size, space.device,
                                                        space.dtype, space.input_name)
    if len(token_shape) == 2:
        if cu_seqlens is not None:
            raise ValueError(
                f"cu_seqlens is for packed inputs ({input_name} [M, ...], labels [M]); got padded labels {token_shape}"
            )
        num_seqs, num_tokens = token_shape[0], token_shape[0] * token_shape[1]
    elif len(token_shape) == 1:
        if cu_seqlens is None:
            raise ValueError(
                f"packed inputs ({input_name} [M, ...], labels [M]) need cu_seqlens [N+1]; "
                "for padded inputs pass labels of shape [N, T]"
            )
        num_tokens = token_shape[0]
        cu_seqlens, packed_extent = _check_cu_seqlens(cu_seqlens, device, num_tokens, input_name, validate)
        num_seqs = cu_seqlens.numel() - 1
    else:
        raise ValueError(f"labels must be [N, T] (padded) or [M] (packed), got shape {token_shape}")
    whole = not split.completions  # every completion here, with all or some of its positions
    if num_seqs == 0 and whole:
        raise ValueError("the batch holds no completion (N == 0)")
    group_size = check_grouping(group_size, group_ids, num_seqs, device, input_name, whole)
    split_group_size = group_size if split.completions or split.positions else None
    if not whole:  # one group per completion here; the real groups form after the gather
        group_size, group_ids = 1, None
    shape = dict(padded_shape=token_shape) if len(token_shape) == 2 else dict(cu_seqlens=cu_seqlens,
                                                                            packed_extent=packed_extent)
    layout = build_layout(num_tokens, device, group_size=group_size, group_ids=group_ids, **shape)
    # The value checks, read back once at the end (see ValueChecks above).
    checks = ValueChecks() if validate else None
    counted = None if len(token_shape) == 2 else layout.token_seq >= 0  # padded: every row is inside
    if mask is not None:
        flat_mask = _check_mask(mask, token_shape, device, input_name, checks)
        counted = flat_mask if counted is None else counted & flat_mask
    if sampling is not None:  # a token with an empty kept set does not count
        counted = sampling.nonempty if counted is None else counted & sampling.nonempty
    check_batch_tensors(labels, scores, device, input_name)  # one pass over their metadata
    flat_labels = prepare_labels(labels, token_shape, vocab_size, device, input_name, ignore_index, validate,
                                 mask=counted, checks=checks, metadata_checked=True)
    scores = check_scores(scores, (num_seqs,), device, input_name, acc, checks, "shape [N]", metadata_checked=True)
    log_weights = batch.seq_log_weights
    if log_weights is not None:  # log w: finite, or -inf for w = 0 (the completion is left out)
        check_float_values("seq_log_weights", log_weights, device, input_name)
        if tuple(log_weights.shape) != (num_seqs,):
            raise ValueError(f"seq_log_weights must have shape [N]=({num_seqs},), got {tuple(log_weights.shape)}")
        log_weights = log_weights.to(torch.float64).contiguous()
        if checks is not None:
            checks.require(~(torch.isnan(log_weights) | (log_weights == float("inf"))).any(), lambda: ValueError(
                "seq_log_weights must be finite or -inf (a weight of 0); found NaN or +inf"))
    kept_sets = None if sampling is None else sampling.build(flat_labels, vocab_size, checks)
    valid = flat_labels >= 0
    all_counted = any_counted = None
    if validate:
        # Completions with no counted token (e.g. truncated and masked) are left out of their group.
        counted_tokens = segment_sum(valid.to(torch.int64), layout)
        counted_seqs = counted_tokens > 0
        if log_weights is not None:  # w = 0: left out like a completion with no counted token
            counted_seqs = counted_seqs & (log_weights > float("-inf"))
        if whole and not split.positions:
            checks.require(counted_seqs.any(),
                           lambda: ValueError("no completion has a counted token (all masked or ignore_index)"))
        else:  # the other ranks' tokens may count
            any_counted = checks.observe(counted_seqs.any())
        if not split.positions:  # with positions split, kept is decided on the summed counts
            all_counted = checks.observe(counted_seqs.all())
        if logprobs is not None:
            given = torch.where(valid, logprobs.detach().reshape(-1), 0.0)
            _require_log_probabilities(checks, "logprobs", given, OLD_LOGPROB_SLACK, "at a counted token")

    # Old log-probs: per token (shape of labels, summed over counted tokens) or per completion,
    # in float64 like the group math (sums over long completions lose digits in fp32).
    old_seq = old_sums = None
    if old_logprobs is not None:
        check_float_values("old_logprobs", old_logprobs, device, input_name)
        if tuple(old_logprobs.shape) == token_shape:
            old_tokens = torch.where(valid, old_logprobs.reshape(-1).to(torch.float64), 0.0)
            if validate:
                _require_log_probabilities(checks, "old_logprobs", old_tokens, OLD_LOGPROB_SLACK, "at a counted token")
            if split.positions:  # a partial sum: the mean needs every rank's count
                old_sums = segment_sum(old_tokens, layout)
            else:
                if length_normalize:
                    old_tokens = old_tokens * length_weights(valid, layout, torch.float64)
                old_seq = segment_sum(old_tokens, layout)
        elif tuple(old_logprobs.shape) == (num_seqs,):
            old_seq = old_logprobs.to(torch.float64).contiguous()
            if validate:  # sums carry one rounding per counted token (this rank's: stricter); means one
                slack = OLD_LOGPROB_SLACK * (1 if length_normalize else counted_tokens.clamp(min=1))
                _require_log_probabilities(checks, "old_logprobs", old_seq, slack, "for a completion")
        else:
            raise ValueError(
                f"old_logprobs must be per token {token_shape} or per completion ({num_seqs},), got {tuple(old_logprobs.shape)}"
            )
        if validate:
            old_values = old_seq if old_sums is None else old_sums
            checks.require(torch.isfinite(old_values).all(),
                           lambda: ValueError("old_logprobs must be finite at counted tokens"))

    # KL-to-reference (k3) term.
    ref_flat = None
    if beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs (per-token log-probs under the reference policy)")
        check_float_values("ref_logprobs", ref_logprobs, device, input_name)
        if tuple(ref_logprobs.shape) != token_shape:
            raise ValueError(f"ref_logprobs must have the shape of labels {token_shape}, got {tuple(ref_logprobs.shape)}")
        ref_flat = torch.where(valid, ref_logprobs.reshape(-1).to(acc), 0.0)
        if validate:
            _require_log_probabilities(checks, "ref_logprobs", ref_flat, OLD_LOGPROB_SLACK, "at a counted token")
            checks.require(torch.isfinite(ref_flat).all(),
                           lambda: ValueError("ref_logprobs must be finite at counted tokens"))

    if not validate:
        return PreparedBatch(token_shape=token_shape, labels=flat_labels, layout=layout, scores=scores,
                             old_seq_logprobs=old_seq, beta=beta, ref_logprobs=ref_flat,
                             split_group_size=split_group_size, old_token_sums=old_sums,
                             seq_log_weights=log_weights, kept_sets=kept_sets)
    observed = checks.read()
    if not whole or split.positions:
        kept = None if all_counted is None or observed[all_counted] else counted_seqs
        return PreparedBatch(token_shape=token_shape, labels=flat_labels, layout=layout, scores=scores,
                             old_seq_logprobs=old_seq, beta=beta, ref_logprobs=ref_flat, kept=kept,
                             any_kept=bool(observed[any_counted]), split_group_size=split_group_size,
                             old_token_sums=old_sums, seq_log_weights=log_weights, kept_sets=kept_sets)
    if not observed[all_counted]:
        layout = build_layout(num_tokens, device, group_size=group_size, group_ids=group_ids,
                              members=counted_seqs, **shape)
    return PreparedBatch(token_shape=token_shape, labels=flat_labels, layout=layout, scores=scores,
                         old_seq_logprobs=old_seq, beta=beta, ref_logprobs=ref_flat, seq_log_weights=log_weights, kept_sets=kept_sets)
