"""The public functional API, in the style of ``torch.nn.functional``.

Every function states its call as a request and runs the one pipeline
(:mod:`tpo_kernels.pipeline`): checks, the ranks' agreement when the call spans ranks, the row
op (:mod:`tpo_kernels.ops`) and, for the losses, the group stage
(:class:`tpo_kernels.ops.group.GroupObjective`).

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

from . import pipeline
from .requests import (BackendArg, Batch, Head, Logits, Logprobs, LogprobsRequest, LossOutput, Options, Placement,
                       SequenceRequest)
from .ops import TilePolicy
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
    return pipeline.sequence_loss(SequenceRequest(
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
    return pipeline.sequence_loss(SequenceRequest(
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
    return pipeline.selective_logprobs(LogprobsRequest(
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
    return pipeline.sequence_loss(SequenceRequest(
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
    return pipeline.selective_logprobs(LogprobsRequest(
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
