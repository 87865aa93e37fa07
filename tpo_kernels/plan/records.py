"""The plan of a call: what its check pass (:mod:`tpo_kernels.plan.call`) hands the work, as
frozen records built by keyword. A :class:`Plan` holds each stage's settings record
(:class:`~tpo_kernels.backends.rows.RowRequest`, :class:`~tpo_kernels.group_math.GroupRule`,
:class:`~tpo_kernels.ops.group.LossWeights`, :class:`~tpo_kernels.checks.arguments.CallFlags`), the
backend, the compute dtype, what the row op reads (:class:`LogitsRows`, :class:`HeadRows`,
:class:`LogprobRows` or :class:`CandidateRows`), the flat labels, the prepared batch and, for a
vocabulary split over ranks, this rank's shard request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from ..backends.kept_sets import KeptSets
from ..checks.arguments import CallFlags
from ..checks.batches import PreparedBatch
from ..group_math import GroupRule
from ..ops import HeadTiles, RowRequest
from ..ops.group import LossWeights


@dataclass(frozen=True)
class LogitsRows:
    """The log-prob row op reads a ``[M, V]`` matrix, or a ``[B, T, V]`` view whose rows do not
    flatten into one row stride (``logits[:, :-1]``), in place."""

    matrix: Tensor
    inplace_backward: bool  # the backward may overwrite the logits' buffer


@dataclass(frozen=True)
class HeadRows:
    """The fused head's row op reads hidden states ``[M, H]`` and an lm_head, tile by tile."""

    hidden: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    tiles: HeadTiles


@dataclass(frozen=True)
class LogprobRows:
    """Per-token log-probs a trainer computed: no row op."""

    logprobs: Tensor


@dataclass(frozen=True)
class CandidateRows:
    """Token-level TPO: each state's candidate ids, their scores and old log-probs."""

    input_name: str  # "logits" or "hidden"
    candidates: Tensor  # [R, K] int64
    scores: Tensor  # [R, K]
    old_logprobs: Optional[Tensor]


RowSource = Union[LogitsRows, HeadRows, LogprobRows, CandidateRows]


@dataclass(frozen=True)
class Plan:
    """One rank's call after its check pass: each stage's settings as its own record."""

    row: RowRequest  # the row op's (for candidates: the logit transform of the candidate logits)
    rule: Optional[GroupRule]  # the group op's (None: per-token log-probs, no group stage)
    weights: Optional[LossWeights]  # what the group stage applies around the op
    flags: CallFlags
    backend: str  # the backend's key, as the ops take it
    device: torch.device
    dtype: torch.dtype  # the compute dtype
    rows: RowSource
    labels: Optional[Tensor]  # [M] int64, -1 where not counted (None for candidates)
    batch: Optional[PreparedBatch] = None
    group_size: Optional[int] = None  # of a batch split over ranks: the checked K (over the concatenation)
    shard_request: object = None  # this rank's vocabulary shard (distributed.ShardRequest), if split
    kept: Optional[KeptSets] = None  # sampling_mask's kept sets: the row op runs over them (replay)


@dataclass(frozen=True)
class RankGroups:
    """The checked groups a sequence-level batch is split over (None: not split that way, or a
    group of one rank): its completions over ``data``, each completion's positions over ``context``."""

    data: object = None
    context: object = None


@dataclass(frozen=True)
class CheckedCall:
    """A call after its check pass on this rank: its plan, or the failure its peers raise too."""

    plan: Optional[Plan]  # None when a check failed
    failure: Optional[BaseException]
    data_group: object = None  # the process group the groups are gathered over (None: local groups)
    vocab_group: object = None  # the group of the vocabulary exchange (None: the whole vocabulary here)
    context_group: object = None  # the group the completions' positions are split over (None: all here)

