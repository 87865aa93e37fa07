"""Token-level TPO in the public functional API (:mod:`tpo_kernels.functional`; paper Sec. 3.4):
K scored candidate next tokens per state, from logits or from hidden states and an lm_head.
Shared keywords as documented in :mod:`tpo_kernels.functional`."""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor

from .backends.rows import RowRequest
from .distributed import plans
from .group_math import candidate_layout
from .ops import candidate_logits, linear_candidate_logits
from .ops.group import CompletionInputs, GroupObjective, RankSeams
from .plan import check_call
from .plan.call import rows_matrix
from .requests import BackendArg, CandidateRequest, Head, Logits, LossOutput, Options, Placement


def token_tpo_loss(
    logits: Tensor,
    candidates: Tensor,
    scores: Tensor,
    *,
    old_logprobs: Optional[Tensor] = None,
    eta: float = 1.0,
    anchor: bool = True,
    score_eps: float = 1e-6,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    reduction: str = "mean",
    backend: BackendArg = "auto",
    return_aux: bool = False,
    validate: bool = True,
    process_group=None,
) -> LossOutput:
    """Token-level TPO (paper Sec. 3.4): at each state, fit the policy's distribution over K
    scored candidate next tokens to the TPO target by cross-entropy.

    With tempered candidate logits ``c[r, k] = z[r, y[r, k]] / tau``, ``p[r] = softmax_k c[r]``
    (the vocabulary logsumexp cancels), so only the K candidate logits of each row are read and
    the gradient ``w (p - q) / tau`` is nonzero only at those entries.

    Args:
        logits: ``[R, V]`` vocabulary logits of R states (flatten ``[B, T, V]`` with your mask
            first); bf16/fp16/fp32/fp64. Math runs in fp32 (fp64 for fp64 logits).
        candidates: ``[R, K]`` integer token ids in ``[0, V)``. A repeated id is a separate group
            member with the same logit; its gradients add up (in ascending k order).
        scores: ``[R, K]`` finite scores of the candidates; standardized within each state
            (population std; a state whose K scores tie gets u = 0, hence zero on-policy gradient;
            one whose std is at most ``score_eps`` keeps ``u = s - mean``, undivided).
        old_logprobs: ``[R, K]`` candidate log-probs under the rollout policy (anchored target
            ``q ∝ p_old exp(u/eta)``). Only differences within a state matter, so full-vocab
            log-probs and raw logits of the rollout policy both work; they are used as given,
            not divided by ``temperature``. None: on-policy, ``p_old = p`` held constant.
        return_aux: also return a dict of detached ``[R, K]`` ``candidate_logits`` (tempered),
            ``p``, ``q``, ``u``, ``coef`` (dLoss/d candidate logit, ``w (p - q)``) and ``[R]``
            ``state_loss``.
        eta, anchor, score_eps, temperature, logit_scale, logit_softcap, reduction, backend, validate:
            see the :mod:`tpo_kernels.functional` docstring.
        process_group: states split over data-parallel ranks: every rank returns the loss of the
            concatenated states (the mean over all ranks' states for ``"mean"``) and its states get
            ``P`` times their gradient of it, so that after DDP averaging every parameter has the
            single-process gradient (see :mod:`tpo_kernels.distributed`). ``aux["state_loss"]``
            then covers every rank's states, ``aux["state_offset"]`` is this rank's first.
    """
    return _candidate_loss(CandidateRequest(
        function="token_tpo_loss",
        source=Logits(logits=logits),
        candidates=candidates,
        scores=scores,
        old_logprobs=old_logprobs,
        options=Options(eta=eta, anchor=anchor, temperature=temperature, logit_scale=logit_scale,
                        logit_softcap=logit_softcap, reduction=reduction, backend=backend, return_aux=return_aux,
                        validate=validate, score_eps=score_eps),
        placement=Placement(process_group=process_group),
    ))


def fused_linear_token_tpo_loss(
    hidden: Tensor,
    weight: Tensor,
    candidates: Tensor,
    scores: Tensor,
    *,
    bias: Optional[Tensor] = None,
    old_logprobs: Optional[Tensor] = None,
    eta: float = 1.0,
    anchor: bool = True,
    score_eps: float = 1e-6,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    reduction: str = "mean",
    backend: BackendArg = "auto",
    return_aux: bool = False,
    validate: bool = True,
    process_group=None,
) -> LossOutput:
    """:func:`token_tpo_loss` on the logits ``hidden [R, H] @ weight.T (+ bias)`` without forming
    them: each candidate logit is the dot product ``hidden[r] . weight[y] (+ bias[y])``, so forward
    and backward cost O(R*K*H) and no ``[R, V]`` tensor exists. The weight gradient is a dense
    ``[V, H]`` tensor, zero except the candidate rows, which are summed deterministically in the
    compute dtype and cast to the weight's dtype; the bias gradient likewise.
    Everything else as in :func:`token_tpo_loss`.
    """
    return _candidate_loss(CandidateRequest(
        function="fused_linear_token_tpo_loss",
        source=Head(hidden=hidden, weight=weight, bias=bias),
        candidates=candidates,
        scores=scores,
        old_logprobs=old_logprobs,
        options=Options(eta=eta, anchor=anchor, temperature=temperature, logit_scale=logit_scale,
                        logit_softcap=logit_softcap, reduction=reduction, backend=backend, return_aux=return_aux,
                        validate=validate, score_eps=score_eps),
        placement=Placement(process_group=process_group),
    ))


# ----------------------------------------------------------------------------- the run


def _candidate_loss(request: CandidateRequest) -> LossOutput:
    """Token-level TPO: each state's K candidates form a group (states may be split over ranks)."""
    checked = check_call(request)
    plan, failure, data_parallel = checked.plan, checked.failure, checked.data_group
    gather = None
    if data_parallel is not None:
        num_states, num_cand = (0, 0) if plan is None else tuple(plan.rows.candidates.shape)
        local = plans.LocalGroups(count=num_states, any_kept=True, all_kept=True, per_item=num_cand, what="state")
        gather, failure = plans.agree_on_groups(data_parallel, request.function, plan, failure, local,
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


def transformed_candidates(gather: Callable[[float], Tensor], request: RowRequest) -> Tensor:
    """Tempered candidate logits through the logit transform. ``gather(inv_temperature)`` gives
    ``[R, K]`` candidate logits times that factor: the scale folds in without a cap; with one,
    the raw logits are gathered and capped in plain autograd (``[R, K]`` entries only)."""
    factor, transform = request.transform()
    if transform is None:
        return gather(factor)
    return transform.differentiable(gather(1.0)) * factor
