"""The frozen, typed request a public function hands to the pipeline (:mod:`tpo_kernels.functional`): the
arguments as the user passed them (checked by the pipeline, not here), grouped by what they
describe: the settings (:class:`Options`), where the data lives (:class:`Placement`), the source
of the log-probs (:class:`Logits`, :class:`Head` or :class:`Logprobs`) and the batch; and the
types of the public signatures: :data:`BackendArg` (what ``backend=`` takes) and
:data:`LossOutput` (what a loss returns)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .backends import Backend
from .ops import TilePolicy

BackendArg = Union[str, Backend]  # a registered backend's name ("auto", "triton", ...) or an instance
LossOutput = Union[Tensor, Tuple[Tensor, dict]]  # the loss, or (loss, aux) with return_aux=True


@dataclass(frozen=True)
class SamplingMask:
    """The kept sets a top-k / top-p sampler sampled from, one per token of the call, as vLLM
    returns them: a CSR over every token (``offsets [M + 1]``, M = ``labels.numel()``, tokens in
    flat row-major order), token ``i``'s set being ``token_ids[offsets[i]:offsets[i + 1]]``. A
    token with an empty set does not count. Pass it as ``sampling_mask=`` (so is a
    ``(token_ids, offsets)`` tuple, or a padded int tensor ``[*labels.shape, S]``, negative: none)."""

    token_ids: Tensor  # [P] integer ids
    offsets: Tensor  # [M + 1] integer, from 0 to P, non-decreasing

    @staticmethod
    def from_lists(rows: Sequence[Sequence[int]], device=None) -> "SamplingMask":
        """From one list of kept ids per token (flat row-major order; ``[]``: the token does not count)."""
        counts = torch.tensor([0] + [len(row) for row in rows], dtype=torch.int64)
        ids = torch.tensor([i for row in rows for i in row], dtype=torch.int64)
        return SamplingMask(token_ids=ids.to(device), offsets=counts.cumsum(0).to(device))


@dataclass(frozen=True)
class Options:
    """The settings of a call, as the user passed them."""

    eta: float = 1.0
    anchor: bool = True
    temperature: float = 1.0
    logit_scale: float = 1.0
    logit_softcap: Optional[float] = None
    reduction: str = "mean"
    backend: BackendArg = "auto"
    return_aux: bool = False
    return_entropy: bool = False
    validate: bool = True
    score_eps: float = 1e-6
    length_normalize: bool = False  # sequence-level losses only
    entropy_coef: float = 0.0  # sequence-level losses on logits or a head only


@dataclass(frozen=True)
class Placement:
    """Where the call's data lives: groups split over ``process_group``, the vocabulary over
    ``vocab_parallel_group``, each completion's positions over ``context_parallel_group`` (see
    :mod:`tpo_kernels.distributed`)."""

    process_group: object = None
    vocab_parallel_group: object = None
    vocab_start_index: Optional[int] = None
    context_parallel_group: object = None


@dataclass(frozen=True)
class Logits:
    """Vocabulary logits ``[..., V]`` (or this rank's shard ``[..., V_r]``)."""

    logits: Tensor
    inplace_backward: bool = False


@dataclass(frozen=True)
class Head:
    """Hidden states and an lm_head (or this rank's vocabulary shard of it): logits tile by tile."""

    hidden: Tensor
    weight: Tensor
    bias: Optional[Tensor] = None
    chunk_size: Optional[int] = None
    grad_accum_dtype: torch.dtype = torch.float32
    tile_policy: Optional[TilePolicy] = None
    logits_cache_bytes: int = 0
    head_dtype: Optional[torch.dtype] = None
    batch_invariant: bool = False


@dataclass(frozen=True)
class Logprobs:
    """Per-token log-probs a trainer has already computed: the row op is done."""

    logprobs: Tensor


Source = Union[Logits, Head, Logprobs]


@dataclass(frozen=True)
class Batch:
    """The batch arguments of a sequence-level loss."""

    labels: Optional[Tensor]
    scores: Tensor
    group_size: Optional[int] = None
    group_ids: Optional[Tensor] = None
    cu_seqlens: Optional[Tensor] = None
    mask: Optional[Tensor] = None
    ignore_index: int = -100
    old_logprobs: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    beta: float = 0.0
    seq_log_weights: Optional[Tensor] = None  # [N] log w per completion
    sampling_mask: object = None  # SamplingMask, (token_ids, offsets) or [*labels.shape, S] ids


@dataclass(frozen=True)
class SequenceRequest:
    function: str
    source: Source
    batch: Batch
    options: Options
    placement: Placement


@dataclass(frozen=True)
class LogprobsRequest:
    function: str
    source: Union[Logits, Head]
    labels: Tensor
    ignore_index: int
    options: Options
    placement: Placement
    sampling_mask: object = None  # as Batch.sampling_mask


@dataclass(frozen=True)
class CandidateRequest:
    function: str
    source: Union[Logits, Head]
    candidates: Tensor
    scores: Tensor
    old_logprobs: Optional[Tensor]
    options: Options
    placement: Placement
