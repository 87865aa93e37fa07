"""The public functional API, in the style of ``torch.nn.functional``, and the one pipeline its
functions run, for one rank and many (at the end of this module; token-level TPO's in
:mod:`tpo_kernels.token_functional`).

Every function states its call as a frozen request (:mod:`tpo_kernels.requests`); the pipeline

1. runs the call's check pass (:func:`tpo_kernels.plan.check_call`: every check, the placement ones
   included, before any work), which gives a frozen :class:`~tpo_kernels.plan.records.Plan`;
2. when the call spans ranks, has them agree on their plans before any collective that could wait
   on a peer (:mod:`tpo_kernels.distributed.plans`: vocabulary -> context -> data), which gives the
   call its seams, or the same error on every rank;
3. runs the row op (:mod:`tpo_kernels.ops`, on the whole vocabulary or this rank's shard) and, for
   the losses, the group stage (:class:`tpo_kernels.ops.group.GroupObjective`: local completions,
   per-completion sums over context ranks, rows gathered over data ranks), and assembles the aux.

Shared keywords of the losses:
    eta: target temperature (> 0): ``q ∝ p_old · exp(u / eta)``.
    anchor: use ``p_old`` in q (False: ``q = softmax(u / eta)``).
    score_eps: near-tie tolerance (0, or in float32's normal range): a group (state) whose scores
        have a population std of at most ``score_eps`` gets the centered scores ``u = s - mean``,
        not divided by the std, so reward noise (a spread of 1e-7) carries a signal as small as
        itself instead of a full-strength one (the paper authors' rule). Exact ties get ``u = 0``
        either way; ``score_eps=0`` standardizes every group that does not tie exactly.
    temperature: sampling temperature dividing the logits (> 0).
    logit_scale, logit_softcap: the model's own transform of its lm_head output, applied before
        the temperature: ``softcap(logit_scale * z) / temperature`` with ``softcap(x) = c * tanh(x / c)``,
        ``c = logit_softcap`` (None: no cap). Cohere: ``logit_scale``; Granite: ``1 / logits_scaling``;
        Gemma 2/3: ``logit_softcap = final_logit_softcapping``. Every function that takes logits or an
        lm_head takes them; without them those models get wrong log-probs silently.
    reduction: ``"mean"`` over groups (states for token-level TPO), ``"sum"``, or ``"none"``
        (per group: in order of first completion for ``group_size``, of sorted id for ``group_ids``).
    backend: ``"auto"``, ``"triton"``, ``"cuda"``, ``"cpu"``, ``"torch"`` or a
        :class:`tpo_kernels.backends.Backend` instance.
    return_aux: also return a dict of detached intermediate results.
    validate: check values too (label ranges, finite scores, ...), which reads results back from
        the device, and leave completions with no counted token out of their groups.
        ``validate=False`` skips those reads, for compiled and CUDA-graph use: then every
        completion must have a counted token. Shapes, dtypes and devices are always checked.
        Traced by ``torch.compile(fullgraph=True)`` with ``validate=True`` a call stops with an
        error saying to pass ``validate=False`` (without ``fullgraph`` the checks run eagerly
        between graphs). With ``validate=True``, log-probs more than rounding above 0 are
        refused (``old_logprobs``, ``ref_logprobs`` with ``beta > 0``, and the ``logprobs`` of
        :func:`tpo_loss_from_logprobs`: probabilities or negative log-likelihoods passed by
        mistake); ``group_size=1`` (a loss of 0) warns. Every scalar keyword is range-checked
        whatever ``validate`` says: ints within int64, reals finite in float32, ``beta`` and
        ``entropy_coef`` at most about 5.8e17 (so that weight times a token's term stays finite).

Distributed keywords (``process_group`` for groups split over data-parallel ranks;
``vocab_parallel_group`` and ``vocab_start_index`` for a vocabulary-sharded lm_head or logits;
``context_parallel_group`` for completions whose positions are split over ranks): see
:mod:`tpo_kernels.distributed`. A check failing on one rank raises the same error on every
rank of the call's groups. Distributed calls run eagerly: traced with ``fullgraph=True`` they stop
with an error saying so.

``context_parallel_group`` (the sequence-level losses): every rank of the group holds the same
completions (the same ``N``, ``scores``, grouping and per-completion ``old_logprobs``) and its own
positions of each, in any split (a contiguous slice, torch's load-balanced head-tail chunks, padded
``[N, T_r]`` or packed ``[M_r]`` with this rank's ``cu_seqlens``); per-token inputs (labels, mask,
per-token ``old_logprobs`` and ``ref_logprobs``) are split like the logits. Each rank reduces its
tokens to per-completion sums, the ranks all-reduce those ``[N, C]`` sums once, and every rank
runs the group stage on them: a completion with no counted token on any rank is left out, length
normalization and the token means count every rank's tokens. Every rank returns the loss of the
whole completions; its backward gives its tokens ``S`` times their gradient (``S`` the group's
size; ``D * S`` with a ``process_group`` of ``D`` ranks), so that averaging gradients over the
data x context ranks (FSDP2 / DDP over a mesh dimension that includes them) gives the
one-process gradient. The labels are shifted by the caller before the split: shift the whole
sequence (``labels = tokens[:, 1:]``), then split inputs and labels with one index map; shifting
a rank's own slice (``local_tokens[:, 1:]``) loses a label at every shard boundary.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .backends.rows import RowSummary
from .distributed import plans
from .group_math import GroupRule, group_sum, portable_group_targets
from .ops import TilePolicy, linear_logprobs, token_logprobs
from .ops.group import CompletionInputs, GroupObjective, RankSeams
from .ops.kept import kept_row_summary, linear_kept_row_summary
from .ops.tiles import EVERY_ROW
from .ops.vocab_shard import shard_linear_logprobs, shard_logprobs
from .plan import HeadRows, LogitsRows, LogprobRows, Plan, check_call
from .requests import (BackendArg, Batch, Head, Logits, Logprobs, LogprobsRequest, LossOutput, Options, Placement,
                       SequenceRequest)
from .token_functional import fused_linear_token_tpo_loss, token_tpo_loss  # token-level TPO, part of this API

__all__ = ["fused_linear_logprobs", "fused_linear_token_tpo_loss", "fused_linear_tpo_loss", "selective_logprobs",
           "token_tpo_loss", "tpo_loss", "tpo_loss_from_logprobs"]



def tpo_loss(
    logits: Tensor,
    labels: Tensor,
    scores: Tensor,
    *,
    group_size: Optional[int] = None,
    group_ids: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    ignore_index: int = -100,
    old_logprobs: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    seq_log_weights: Optional[Tensor] = None,
    sampling_mask=None,
    beta: float = 0.0,
    eta: float = 1.0,
    anchor: bool = True,
    score_eps: float = 1e-6,
    length_normalize: bool = False,
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    reduction: str = "mean",
    backend: BackendArg = "auto",
    inplace_backward: bool = True,
    return_aux: bool = False,
    return_entropy: bool = False,
    validate: bool = True,
    process_group=None,
    context_parallel_group=None,
    vocab_parallel_group=None,
    vocab_start_index: Optional[int] = None,
) -> LossOutput:
    """Sequence-level Target Policy Optimization loss on vocabulary logits.

    For each group of completions of one prompt, TPO fits the policy's group distribution
    ``p = softmax(ell)`` (``ell`` the summed completion log-probs) to the target
    ``q ∝ p_old · exp(u / eta)`` (``u`` the standardized scores) by cross-entropy
    ``-sum q log p``; the gradient on each ``ell`` is ``p - q``.

    Args:
        logits: ``[N, T, V]`` padded or ``[M, V]`` packed (with ``cu_seqlens``); bf16/fp16/fp32/fp64.
            ``logits[n, t]`` predicts ``labels[n, t]`` (already shifted).
        labels: ``[N, T]`` or ``[M]`` token ids; ``ignore_index`` marks positions that do not count.
        scores: ``[N]`` rewards of the completions.
        group_size: K, when the K completions of each prompt are contiguous (TRL / verl order).
        group_ids: ``[N]`` group id per completion, for any grouping and variable group sizes.
        cu_seqlens: ``[N+1]`` offsets of the completions in packed inputs (flash-attn convention).
        mask: optional ``[N, T]`` / ``[M]`` 0/1 mask of counted tokens (ANDed with ignore_index).
        old_logprobs: rollout-policy log-probs, per token (shape of labels) or per completion
            ``[N]``; None = on-policy (p_old = p, held constant). Per completion they are the
            sequence log-probs in the loss's convention (means with ``length_normalize``).
        length_normalize: each completion's sequence log-prob ``ell`` (and ``ell_old`` from
            per-token ``old_logprobs``) is the mean over its counted tokens instead of the sum
            (the default of the author's TRL port, GSPO-style); gradients exact.
        ref_logprobs, beta: per-token reference log-probs and the weight of the k3 KL penalty
            (token mean over counted tokens; per group for ``reduction="none"``).
        seq_log_weights: optional ``[N]`` float log-weights ``log w_i`` of the completions (e.g.
            truncated importance ratios): ``p_i ∝ w_i exp(ell_i)`` and ``q_i ∝ w_i p_old_i exp(u_i /
            eta)`` (``p_old`` unweighted; ``q_i ∝ w_i exp(u_i / eta)`` without the anchor); ``u``
            stays unweighted, over the members with ``w > 0``. A constant added per group changes
            nothing. ``-inf`` (w = 0) leaves the completion out of its group (with ``validate=False``
            the group op masks it: a group whose every w is 0 adds 0 to the loss but still counts
            in the mean over groups); NaN or ``+inf``: a ValueError (``validate=True``). Replicated,
            like ``scores``, over context ranks.
        sampling_mask: the kept set each token was sampled from (top-k / top-p replay): a
            :class:`tpo_kernels.SamplingMask`, a ``(token_ids, offsets)`` CSR over every token of the
            call (``offsets [labels.numel() + 1]``, flat row-major), or an int tensor
            ``[*labels.shape, S]`` (negative: no entry). Each token's log-prob (and entropy) is then
            over its kept set, renormalized; its gradient is 0 off the set. A token with an empty set
            does not count; a counted label outside its set is a ValueError (``validate=True``), else
            NaN. ``old_logprobs`` / ``ref_logprobs`` must be on the same sets. Per token, like the
            labels (each context rank passes its own positions'); with ``vocab_parallel_group`` (or
            DTensor shards) in global vocabulary ids, the same on every rank; not with
            ``logits_cache_bytes > 0``.
        entropy_coef: weight (finite, >= 0) of an entropy bonus: the loss becomes
            ``TPO - entropy_coef * H``, ``H`` the mean entropy of the counted tokens' tempered
            distributions, reduced as the KL term is (the token mean of the batch for ``"mean"``,
            with ``process_group`` over every rank's tokens, as one rank would on the concatenated
            batch; the token sum for ``"sum"``; each group's token mean for ``"none"``). The entropy
            and its gradient come from the loss's own vocabulary pass. 0: the loss as without it.
        inplace_backward: write the logits gradient into the logits buffer (saves a ``[M, V]``
            tensor) when that storage is an activation of the autograd graph: the root of the
            logits' views (``logits._base``, any depth) has a ``grad_fn``, as for
            ``model(...).logits[:, :-1]``. The logits' autograd version counter is bumped, so any
            other graph node that saved the same logits raises PyTorch's in-place error instead of
            reading overwritten values. A leaf's storage is never overwritten, whatever view of it
            is passed (``leaf[:, :-1]``, ``leaf.view(...)``; a two-stage backward's
            ``out.logits.detach().requires_grad_()`` is a leaf sharing the model output's storage):
            the backward is then out of place, as it is under ``torch.compile``.
        eta, anchor, score_eps, temperature, logit_scale, logit_softcap, reduction, backend, validate:
            see the module docstring.
        return_aux: also return a dict of detached ``token_logprobs``, ``seq_logprobs``, ``p``,
            ``q``, ``u``, ``coef`` (dL/d ell of the group term), ``group_loss`` and per-group
            metrics: ``kl_q_p`` (KL(q || p)), ``entropy_p``, ``entropy_q`` and ``zero_signal``
            (True where the group carries no gradient, ``p == q``).
        return_entropy: with ``return_aux``, also ``aux["token_entropy"]``: the entropy of each
            token's tempered distribution, from the same vocabulary pass (0 where not counted).
        process_group, context_parallel_group, vocab_parallel_group, vocab_start_index: see the
            module docstring (logits ``[..., V_r]`` of a vocabulary shard; their gradient stays local;
            ``[N, T_r, V]`` / ``[M_r, V]`` logits of this rank's positions of every completion).
    """
    return _sequence_loss(SequenceRequest(
        function="tpo_loss",
        source=Logits(logits=logits, inplace_backward=inplace_backward),
        batch=Batch(labels=labels, scores=scores, group_size=group_size, group_ids=group_ids,
                    cu_seqlens=cu_seqlens, mask=mask, ignore_index=ignore_index, old_logprobs=old_logprobs,
                    ref_logprobs=ref_logprobs, beta=beta, seq_log_weights=seq_log_weights,
                    sampling_mask=sampling_mask),
        options=Options(eta=eta, anchor=anchor, temperature=temperature, logit_scale=logit_scale,
                        logit_softcap=logit_softcap, reduction=reduction, backend=backend, return_aux=return_aux,
                        return_entropy=return_entropy, validate=validate, score_eps=score_eps,
                        length_normalize=length_normalize, entropy_coef=entropy_coef),
        placement=Placement(process_group=process_group, context_parallel_group=context_parallel_group,
                            vocab_parallel_group=vocab_parallel_group, vocab_start_index=vocab_start_index),
    ))


def tpo_loss_from_logprobs(
    logprobs: Tensor,
    scores: Tensor,
    *,
    mask: Optional[Tensor] = None,
    group_size: Optional[int] = None,
    group_ids: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    old_logprobs: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    seq_log_weights: Optional[Tensor] = None,
    beta: float = 0.0,
    eta: float = 1.0,
    anchor: bool = True,
    score_eps: float = 1e-6,
    length_normalize: bool = False,
    reduction: str = "mean",
    backend: BackendArg = "auto",
    return_aux: bool = False,
    validate: bool = True,
    process_group=None,
    context_parallel_group=None,
) -> LossOutput:
    """Sequence-level TPO on per-token log-probs a trainer has already computed (verl's policy
    losses, or any loop whose vocabulary pass is done): the group stage alone, differentiable in
    ``logprobs``.

    Args:
        logprobs: ``[N, T]`` padded or ``[M]`` packed (with ``cu_seqlens``) float log-probs of
            the sampled tokens under the current policy (already tempered).
        mask: ``[N, T]`` / ``[M]`` 0/1 or bool mask of the tokens that count (response mask);
            None: every token counts.
        scores, group_size, group_ids, cu_seqlens, old_logprobs, ref_logprobs, seq_log_weights, beta,
            length_normalize: as in :func:`tpo_loss`.
        eta, anchor, score_eps, reduction, backend, return_aux, validate, process_group,
            context_parallel_group: see the module docstring (with ``context_parallel_group``,
            ``logprobs`` and the mask hold this rank's positions).

    There is no ``entropy_coef`` here: the token entropy needs the vocabulary pass this function
    does not make. Add ``- coef * entropy`` from that pass yourself, or use :func:`tpo_loss` /
    :func:`fused_linear_tpo_loss`, which read it from their own pass.
    """
    return _sequence_loss(SequenceRequest(
        function="tpo_loss_from_logprobs",
        source=Logprobs(logprobs=logprobs),
        batch=Batch(labels=None, scores=scores, group_size=group_size, group_ids=group_ids,
                    cu_seqlens=cu_seqlens, mask=mask, ignore_index=-100, old_logprobs=old_logprobs,
                    ref_logprobs=ref_logprobs, beta=beta, seq_log_weights=seq_log_weights),
        options=Options(eta=eta, anchor=anchor, temperature=1.0, reduction=reduction, backend=backend,
                        return_aux=return_aux, validate=validate, score_eps=score_eps,
                        length_normalize=length_normalize),
        placement=Placement(process_group=process_group, context_parallel_group=context_parallel_group),
    ))


def selective_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    sampling_mask=None,
    backend: BackendArg = "auto",
    validate: bool = True,
    vocab_parallel_group=None,
    vocab_start_index: Optional[int] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Per-token ``log softmax(logits / temperature)[labels]`` without materializing full-vocab
    log-probs; differentiable (its backward is the fused row backward).

    Returns float32 log-probs of the labels' shape (float64 for float64 logits), 0 where
    ``labels == ignore_index``; with ``return_entropy`` also the per-token entropy of the tempered
    distribution (0 at ignored positions), which is differentiable too. Under ``torch.no_grad()``
    this is the cheap way to get old / reference log-probs. With ``vocab_parallel_group``
    (module docstring) ``logits`` is this rank's vocabulary shard ``[..., V_r]``.
    ``sampling_mask``: each token's kept set, as in :func:`tpo_loss`: the log-probs (and entropies)
    over it (replay), 0 where a set is empty.
    """
    return _logprobs(LogprobsRequest(
        function="selective_logprobs",
        source=Logits(logits=logits),
        labels=labels,
        ignore_index=ignore_index,
        options=Options(temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap,
                        backend=backend, return_entropy=return_entropy, validate=validate),
        placement=Placement(vocab_parallel_group=vocab_parallel_group, vocab_start_index=vocab_start_index),
        sampling_mask=sampling_mask,
    ))


def fused_linear_tpo_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    scores: Tensor,
    *,
    bias: Optional[Tensor] = None,
    group_size: Optional[int] = None,
    group_ids: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    ignore_index: int = -100,
    old_logprobs: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    seq_log_weights: Optional[Tensor] = None,
    sampling_mask=None,
    beta: float = 0.0,
    eta: float = 1.0,
    anchor: bool = True,
    score_eps: float = 1e-6,
    length_normalize: bool = False,
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    reduction: str = "mean",
    backend: BackendArg = "auto",
    return_aux: bool = False,
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
    grad_accum_dtype: torch.dtype = torch.float32,
    tile_policy: Optional[TilePolicy] = None,
    logits_cache_bytes: int = 0,
    head_dtype: Optional[torch.dtype] = None,
    batch_invariant: bool = False,
    validate: bool = True,
    process_group=None,
    context_parallel_group=None,
    vocab_parallel_group=None,
    vocab_start_index: Optional[int] = None,
) -> LossOutput:
    """Sequence-level TPO loss on ``logits = hidden @ weight.T (+ bias)``, computed tile by tile
    so that the ``[tokens, vocab]`` logits never exist.

    Same semantics and keywords as :func:`tpo_loss` (``entropy_coef`` included: the entropy and its
    gradient come from the same tiles). Gradients flow to ``hidden``, ``weight`` and ``bias``.

    Args:
        hidden: ``[N, T, H]`` padded or ``[M, H]`` packed (with ``cu_seqlens``) last hidden states;
            ``hidden[n, t]`` predicts ``labels[n, t]`` (already shifted).
        weight: ``[V, H]`` lm_head weight on the device of ``hidden``. Its dtype may differ from
            the hidden states' (e.g. an fp32 head under bf16 activations): logits are computed in
            the wider dtype, casting one tile at a time.
        bias: optional ``[V]`` lm_head bias, the weight's dtype.
        chunk_size: a budget of ``chunk_size * V`` logits per tile (a block of tokens times a
            block of the vocabulary); default from the tile policy (512 MiB of fp32 logits on
            CUDA, 6 MiB on CPU).
        grad_accum_dtype: dtype in which ``dW`` and ``db`` are summed over tiles (float32 by
            default; pass the weight dtype to save memory); never narrower than the weight's.
            When wider than the weight dtype (a bf16 head), ``dW`` is accumulated one vocabulary
            block of at most 256 MiB at a time.
        tile_policy: how tiles are sized (:class:`tpo_kernels.ops.TilePolicy`); default per device.
        logits_cache_bytes: memory the forward may keep for the backward as logits (whole rows, in
            the logits' dtype): cached tokens cost three matmuls instead of four. 0: every counted
            token's logits for a vocabulary of at most ``TilePolicy.small_vocab`` (16384) entries,
            else none.
        head_dtype: the dtype the logits are formed in (None: the inputs'). ``torch.float32`` for a
            bf16 / fp16 head keeps the logits from being rounded to bf16 before the softmax: each
            tile's operands are cast (on CUDA, multiplied into fp32 by one out_dtype matmul), never
            the whole weight; gradients come back in the inputs' dtypes. float32 or float64, never
            narrower than ``hidden`` and ``weight``.
        batch_invariant: a token's log-prob, entropy and row of the hidden-state gradient are the
            same bits whatever else is in the batch (its size, order, padding): every tile has one
            shape, the last zero-padded, and no byte-budgeted logits cache. Off by default (small
            calls pay for the padding). ``dW``, ``db`` and the loss's group-coupled gradients are
            sums over the batch and out of scope.
        process_group, context_parallel_group, vocab_parallel_group, vocab_start_index: see the
            module docstring (weight ``[V_r, H]`` and bias ``[V_r]`` of a vocabulary shard, or DTensors
            sharded on dim 0; ``hidden`` of this rank's positions with ``context_parallel_group``).

    The backward recomputes the logits of the tokens whose loss gradient is nonzero; tokens of
    groups whose scores tie (on-policy, ``beta == 0``) cost no matmul. Double backward is not
    supported.
    """
    return _sequence_loss(SequenceRequest(
        function="fused_linear_tpo_loss",
        source=Head(hidden=hidden, weight=weight, bias=bias, chunk_size=chunk_size, grad_accum_dtype=grad_accum_dtype,
                    tile_policy=tile_policy, logits_cache_bytes=logits_cache_bytes, head_dtype=head_dtype,
                    batch_invariant=batch_invariant),
        batch=Batch(labels=labels, scores=scores, group_size=group_size, group_ids=group_ids,
                    cu_seqlens=cu_seqlens, mask=mask, ignore_index=ignore_index, old_logprobs=old_logprobs,
                    ref_logprobs=ref_logprobs, beta=beta, seq_log_weights=seq_log_weights,
                    sampling_mask=sampling_mask),
        options=Options(eta=eta, anchor=anchor, temperature=temperature, logit_scale=logit_scale,
                        logit_softcap=logit_softcap, reduction=reduction, backend=backend, return_aux=return_aux,
                        return_entropy=return_entropy, validate=validate, score_eps=score_eps,
                        length_normalize=length_normalize, entropy_coef=entropy_coef),
        placement=Placement(process_group=process_group, context_parallel_group=context_parallel_group,
                            vocab_parallel_group=vocab_parallel_group, vocab_start_index=vocab_start_index),
    ))


def fused_linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    sampling_mask=None,
    chunk_size: Optional[int] = None,
    backend: BackendArg = "auto",
    grad_accum_dtype: torch.dtype = torch.float32,
    tile_policy: Optional[TilePolicy] = None,
    logits_cache_bytes: int = 0,
    head_dtype: Optional[torch.dtype] = None,
    batch_invariant: bool = False,
    validate: bool = True,
    vocab_parallel_group=None,
    vocab_start_index: Optional[int] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Per-token ``log softmax((hidden @ weight.T + bias) / temperature)[labels]`` without
    materializing the logits; differentiable with respect to hidden, weight and bias.

    ``hidden`` is ``[N, T, H]`` or ``[M, H]`` and ``labels`` its leading shape. Returns float32
    log-probs of the labels' shape (float64 for float64 inputs), 0 where ``labels ==
    ignore_index``; with ``return_entropy`` also the per-token entropy of the tempered
    distribution (0 at ignored positions), whose gradient flows too. Under ``torch.no_grad()``
    this is the memory-light way to get old / reference log-probs from a model's hidden states.
    ``chunk_size``, ``grad_accum_dtype``, ``tile_policy``, ``logits_cache_bytes``, ``head_dtype`` and
    ``batch_invariant`` as in :func:`fused_linear_tpo_loss`;
    ``vocab_parallel_group`` and ``vocab_start_index`` for a vocabulary-sharded head as there.
    ``sampling_mask`` as in :func:`selective_logprobs`: |S| dot products per token, no logits tile.
    """
    return _logprobs(LogprobsRequest(
        function="fused_linear_logprobs",
        source=Head(hidden=hidden, weight=weight, bias=bias, chunk_size=chunk_size, grad_accum_dtype=grad_accum_dtype,
                    tile_policy=tile_policy, logits_cache_bytes=logits_cache_bytes, head_dtype=head_dtype,
                    batch_invariant=batch_invariant),
        labels=labels,
        ignore_index=ignore_index,
        options=Options(temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap,
                        backend=backend, return_entropy=return_entropy, validate=validate),
        placement=Placement(vocab_parallel_group=vocab_parallel_group, vocab_start_index=vocab_start_index),
        sampling_mask=sampling_mask,
    ))


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


# ----------------------------------------------------------------------------- the runs


def _sequence_loss(request: SequenceRequest) -> LossOutput:
    """Sequence-level TPO: row op, then the group stage over local completions, completions whose
    positions are split over context ranks (their per-completion sums all-reduced), and/or
    completions gathered from data ranks."""
    checked = check_call(request)
    plan, failure, data_parallel = checked.plan, checked.failure, checked.data_group
    shard = gather = context = None
    if checked.vocab_group is not None:
        shard, failure = plans.agree_on_vocabulary(request, checked.vocab_group, plan, failure)
    if checked.context_group is not None:
        context, failure = plans.agree_on_context(request, checked, failure)
    if data_parallel is not None:
        prepared = None if plan is None else plan.batch
        # With positions split, which completions are kept is known once their counts are summed.
        kept_later = checked.context_group is not None and plan is not None and plan.flags.validate
        local = plans.LocalGroups(count=0 if prepared is None else prepared.layout.num_seqs,
                            any_kept=prepared is not None and (prepared.any_kept if context is None
                                                               else context.any_counted),
                            all_kept=None if kept_later else prepared is None or prepared.kept is None,
                            group_size=None if plan is None else plan.group_size,
                            group_ids=None if prepared is None else request.batch.group_ids)
        context_ranks = 1 if checked.context_group is None else torch.distributed.get_world_size(checked.context_group)
        gather, failure = plans.agree_on_groups(data_parallel, request.function, plan, failure, local,
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


def _logprobs(request: LogprobsRequest) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Per-token log-probs (and entropies) of the labels, over a whole or sharded vocabulary."""
    checked = check_call(request)
    plan, failure = checked.plan, checked.failure
    shard = None
    if checked.vocab_group is not None:
        shard, failure = plans.agree_on_vocabulary(request, checked.vocab_group, plan, failure)
    if failure is not None:
        raise failure
    summary = _row_summary(plan, shard)
    shape = request.labels.shape
    if not plan.flags.returned_fields:
        return summary.label_logprob.view(shape)
    return (summary.label_logprob.view(shape), *(getattr(summary, name).view(shape)
                                                 for name in plan.flags.returned_fields))
