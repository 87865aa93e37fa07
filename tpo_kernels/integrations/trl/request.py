"""The request a TargetPOTrainer loss call hands the patched model forward (:mod:`.head`), read
again by the metrics (:mod:`.metrics`): one frozen record, built by keyword."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

from ... import SamplingMask, kit


@dataclass(frozen=True, kw_only=True)
class TPORequest:
    """What the model's patched forward computes from its final hidden states, and with what.

    Always read (the vocabulary pass): ``labels`` ([N, C] completion ids), ``mask`` ([N, C] bool:
    the counted tokens), ``sampling_mask`` (the sampler's kept sets of the N rows' tokens, replayed
    by the loss; None: the full vocabulary), ``temperature``, ``backend``, ``cast_lm_head_to_fp32``
    (the head in float32) and ``token_entropy`` (compute each token's entropy).

    ``logprobs_only``: return the rows' token log-probs (and entropy) instead of a loss; the
    fields below are then not read.

    The loss: ``scores`` ([N]), ``group_size`` (whole groups of consecutive rows) or ``group_ids``
    ([N], global ids) with ``process_group`` (groups spanning processes; None otherwise),
    ``metric_group_ids`` (the call's rows' group ids, own then detached, for the metrics),
    ``old_logprobs`` / ``ref_logprobs`` ([N, C], on the same kept sets; None when unused),
    ``seq_log_weights`` ([N] or None), ``detached`` (the window's other rows of the call's groups,
    a :class:`tpo_kernels.kit.LossRows` without gradient, or None), ``beta``, ``eta``, ``anchor``,
    ``score_eps``, ``length_normalize``, ``entropy_coef`` (the bonus this call applies) and
    ``router_aux_loss`` (also return the model's MoE load-balancing loss).
    """

    labels: Tensor
    mask: Tensor
    temperature: float
    backend: str
    cast_lm_head_to_fp32: bool
    token_entropy: bool
    sampling_mask: Optional[SamplingMask] = None
    logprobs_only: bool = False
    scores: Optional[Tensor] = None
    group_size: Optional[int] = None
    group_ids: Optional[Tensor] = None
    process_group: Any = None
    metric_group_ids: Optional[Tensor] = None
    old_logprobs: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    seq_log_weights: Optional[Tensor] = None
    detached: Optional[kit.LossRows] = None
    beta: float = 0.0
    eta: float = 1.0
    anchor: bool = True
    score_eps: float = 1e-6
    length_normalize: bool = False
    entropy_coef: float = 0.0
    router_aux_loss: bool = False

    def __post_init__(self):
        if not self.logprobs_only and self.scores is None:
            raise ValueError("a TPORequest for a loss needs scores (or logprobs_only=True)")
        if not self.logprobs_only and (self.group_size is None) == (self.group_ids is None):
            raise ValueError("a TPORequest for a loss needs exactly one of group_size and group_ids")
