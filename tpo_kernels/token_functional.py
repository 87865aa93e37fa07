"""Token-level TPO in the public functional API (:mod:`tpo_kernels.functional`; paper Sec. 3.4):
K scored candidate next tokens per state, from logits or from hidden states and an lm_head.
Shared keywords as documented in :mod:`tpo_kernels.functional`."""

from __future__ import annotations

from typing import Optional, Tuple, Union

from torch import Tensor

from . import _validate as check
from ._dtypes import compute_dtype
from .backends import Backend, backend_key, get_backend
from .ops import candidate_logits, linear_candidate_logits, pipeline

BackendArg = Union[str, Backend]
LossOutput = Union[Tensor, Tuple[Tensor, dict]]


def token_tpo_loss(
    logits: Tensor,
    candidates: Tensor,
    scores: Tensor,
    *,
    old_logprobs: Optional[Tensor] = None,
    eta: float = 1.0,
    anchor: bool = True,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    reduction: str = "mean",
    backend: BackendArg = "auto",
    return_aux: bool = False,
    validate: bool = True,
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
            (population std; a state whose K scores tie gets u = 0, hence zero on-policy gradient).
        old_logprobs: ``[R, K]`` candidate log-probs under the rollout policy (anchored target
            ``q ∝ p_old exp(u/eta)``). Only differences within a state matter, so full-vocab
            log-probs and raw logits of the rollout policy both work; they are used as given,
            not divided by ``temperature``. None: on-policy, ``p_old = p`` held constant.
        return_aux: also return a dict of detached ``[R, K]`` ``candidate_logits`` (tempered),
            ``p``, ``q``, ``u``, ``coef`` (dLoss/d candidate logit, ``w (p - q)``) and ``[R]``
            ``state_loss``.
        eta, anchor, temperature, logit_scale, logit_softcap, reduction, backend, validate: see the
            module docstring.
    """
    check.check_logits(logits, (2,))
    settings = check.check_settings(eta=eta, anchor=anchor, temperature=temperature, reduction=reduction,
                                    return_aux=return_aux, validate=validate, logit_scale=logit_scale,
                                    logit_softcap=logit_softcap)
    chosen = get_backend(backend, logits.device)
    candidates, scores, old_logprobs = check.prepare_candidates(
        logits.shape[0], logits.shape[1], logits.device, compute_dtype(logits.dtype), candidates, scores,
        old_logprobs, "logits", validate,
    )
    key = backend_key(chosen)
    matrix, _ = pipeline.rows(logits)
    cand = pipeline.transformed_candidates(
        lambda inv_t: candidate_logits(matrix, candidates, inv_temperature=inv_t, backend=key), settings)
    return pipeline.candidate_loss(cand, scores, old_logprobs, settings, key)


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
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    reduction: str = "mean",
    backend: BackendArg = "auto",
    return_aux: bool = False,
    validate: bool = True,
) -> LossOutput:
    """:func:`token_tpo_loss` on the logits ``hidden [R, H] @ weight.T (+ bias)`` without forming
    them: each candidate logit is the dot product ``hidden[r] . weight[y] (+ bias[y])``, so forward
    and backward cost O(R*K*H) and no ``[R, V]`` tensor exists. The weight gradient is a dense
    ``[V, H]`` tensor, zero except the candidate rows, which are summed deterministically in the
    compute dtype and cast to the weight's dtype; the bias gradient likewise.
    Everything else as in :func:`token_tpo_loss`.
    """
    check.check_head(hidden, weight, bias, hidden_ndims=(2,), same_dtype=True)
    settings = check.check_settings(eta=eta, anchor=anchor, temperature=temperature, reduction=reduction,
                                    return_aux=return_aux, validate=validate, logit_scale=logit_scale,
                                    logit_softcap=logit_softcap)
    chosen = get_backend(backend, hidden.device)
    candidates, scores, old_logprobs = check.prepare_candidates(
        hidden.shape[0], weight.shape[0], hidden.device, compute_dtype(hidden.dtype), candidates, scores,
        old_logprobs, "hidden", validate,
    )
    key = backend_key(chosen)
    cand = pipeline.transformed_candidates(
        lambda inv_t: linear_candidate_logits(hidden, weight, bias, candidates, inv_temperature=inv_t, backend=key),
        settings)
    return pipeline.candidate_loss(cand, scores, old_logprobs, settings, key)
