"""Token-level TPO (paper Sec. 3.4): K scored candidate next tokens at each prefix state.

State ``r`` is a group of its K candidates ``y[r, k]`` with scores ``s[r, k]``. With tempered
candidate logits ``c[r, k] = z[r, y[r, k]] / tau``::

    p[r]   = softmax_k c[r]                       the vocabulary logsumexp cancels in the ratio
    u[r]   = standardized s[r] (population std; all 0 when the K scores tie)
    q[r]   = softmax_k(log p_old[r] + u[r] / eta)  anchored;  softmax_k(u[r] / eta) if not
    loss_r = -sum_k q[r, k] log p[r, k]            q is a constant
    dloss_r / dc[r, k] = p[r, k] - q[r, k]

so the logits gradient is ``w (p - q) / tau`` on the K candidate entries of each row and 0
elsewhere (w = 1/R for reduction "mean"). Nothing here reads the rest of the vocabulary, and the
fused-linear path computes ``z[r, y] = h[r] . W[y] (+ b[y])`` directly: O(R*K*H) work, no
``[R, V]`` tensor. The group math is :func:`tpo_kernels.targets.dense_group_targets` on the dense
``[R, K]`` layout, so a tied on-policy state gets exactly zero gradient.

Duplicated candidates. A token id listed twice in a state is two group members with equal
logits: each gets its own share of p and its own score, and its logit receives the sum of both
members' gradients (accumulated in ascending k order). This is what gathering the K candidates
from full-vocab log-probs and applying Eq. 1-3 gives.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ._validate import (
    _check_integer,
    check_flag,
    check_float_tensor,
    check_positive,
    check_reduction,
    check_same_device,
)
from .backends import Backend, compute_dtype, get_backend
from .backends.candidates import pair_runs
from .targets import dense_group_targets



class TokenObjective:
    """The group stage of token-level TPO: ``[R, K]`` tempered candidate logits -> loss, and the
    incoming loss gradient -> dLoss/d(candidate logits)."""

    def __init__(
        self, scores: Tensor, old_logprobs: Optional[Tensor], *, eta: float, anchor: bool, reduction: str
    ):
        self.scores, self.old_logprobs = scores, old_logprobs
        self.eta, self.anchor, self.reduction = eta, anchor, reduction
        self.results: Optional[dict] = None

    def forward(self, cand_logits: Tensor) -> Tensor:
        u, p, q, _, state_loss = dense_group_targets(
            cand_logits, self.scores, self.old_logprobs, None, self.eta, self.anchor
        )
        weight = 1.0 / cand_logits.shape[0] if self.reduction == "mean" else 1.0
        self.results = {
            "candidate_logits": cand_logits,
            "p": p,
            "q": q,
            "u": u,
            "coef": (p - q) * weight,  # dLoss/d candidate logit per unit loss gradient
            "state_loss": state_loss,
        }
        return {"mean": state_loss.mean, "sum": state_loss.sum, "none": lambda: state_loss}[self.reduction]()

    def grad(self, grad_loss: Tensor) -> Tensor:
        """dLoss/d(tempered candidate logit), ``[R, K]`` in the compute dtype."""
        coef = self.results["coef"]
        grad_loss = grad_loss.to(coef.dtype)
        return coef * (grad_loss.unsqueeze(1) if self.reduction == "none" else grad_loss)

    def aux(self) -> dict:
        return {name: value.detach() for name, value in self.results.items()}


class TokenTPOLogitsFunction(torch.autograd.Function):
    """Logits path: candidate gather -> group math -> (backward) candidate scatter."""

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        candidates: Tensor,
        objective: TokenObjective,
        backend: Backend,
        inv_temperature: float,
    ):
        cand_logits = backend.candidate_forward(logits, candidates, inv_temperature)
        loss = objective.forward(cand_logits)
        ctx.save_for_backward(candidates)
        ctx.logits_meta = (logits.shape, logits.dtype, logits.device)
        ctx.objective, ctx.backend, ctx.inv_temperature = objective, backend, inv_temperature
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        (candidates,) = ctx.saved_tensors
        shape, dtype, device = ctx.logits_meta
        out = torch.empty(shape, dtype=dtype, device=device)
        ctx.backend.candidate_backward(ctx.objective.grad(grad_loss), candidates, ctx.inv_temperature, out)
        return out, None, None, None, None


class FusedLinearTokenTPOFunction(torch.autograd.Function):
    """Fused-linear path: candidate dot products -> group math -> (backward) dH, dW rows, db."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        candidates: Tensor,
        objective: TokenObjective,
        backend: Backend,
        inv_temperature: float,
    ):
        cand_logits = backend.candidate_linear_forward(hidden, weight, bias, candidates, inv_temperature)
        loss = objective.forward(cand_logits)
        ctx.save_for_backward(hidden, weight, candidates)
        ctx.has_bias = bias is not None
        ctx.objective, ctx.backend, ctx.inv_temperature = objective, backend, inv_temperature
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        hidden, weight, candidates = ctx.saved_tensors
        with_weight = ctx.needs_input_grad[1]
        with_bias = ctx.has_bias and ctx.needs_input_grad[2]
        # c = z / tau, so dLoss/dz = dLoss/dc / tau.
        grad = ctx.objective.grad(grad_loss) * ctx.inv_temperature
        runs = pair_runs(candidates) if with_weight or with_bias else None
        dhidden, dweight, dbias = ctx.backend.candidate_linear_backward(
            grad, hidden, weight, candidates, runs, ctx.needs_input_grad[0], with_weight, with_bias
        )
        return dhidden, dweight, dbias, None, None, None, None


# ----------------------------------------------------------------------------- validation


def _prepare_candidates(
    num_states: int,
    vocab: int,
    device: torch.device,
    acc: torch.dtype,
    candidates,
    scores,
    old_logprobs,
    reference: str,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Checked ``(candidates int64, scores, old_logprobs)``, the float ones in ``acc``."""
    if num_states == 0:
        raise ValueError(f"{reference} holds no state (R == 0)")
    if not isinstance(candidates, Tensor):
        raise TypeError(f"candidates must be a torch.Tensor, got {type(candidates).__name__}")
    _check_integer("candidates", candidates)
    check_same_device("candidates", candidates, device, reference)
    if candidates.dim() != 2 or candidates.shape[0] != num_states or candidates.shape[1] == 0:
        raise ValueError(
            f"candidates must have shape [R, K] with R={num_states} (the rows of {reference}) and "
            f"K >= 1, got {tuple(candidates.shape)}"
        )
    shape = tuple(candidates.shape)
    out_of_range = (candidates < 0) | (candidates >= vocab)
    if bool(out_of_range.any()):
        bad = candidates[out_of_range][0].item()
        raise ValueError(f"candidates must hold token ids in [0, {vocab}); found {bad}")

    if not isinstance(scores, Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dtype == torch.bool or scores.dtype.is_complex:
        raise TypeError(f"scores must be a real tensor, got {scores.dtype}")
    check_same_device("scores", scores, device, reference)
    if tuple(scores.shape) != shape:
        raise ValueError(f"scores must have the shape of candidates {shape}, got {tuple(scores.shape)}")
    scores = scores.to(acc)
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("scores must be finite (found NaN or inf)")

    if old_logprobs is not None:
        if not isinstance(old_logprobs, Tensor):
            raise TypeError(f"old_logprobs must be a torch.Tensor, got {type(old_logprobs).__name__}")
        if not old_logprobs.dtype.is_floating_point:
            raise TypeError(f"old_logprobs must be a float tensor, got {old_logprobs.dtype}")
        check_same_device("old_logprobs", old_logprobs, device, reference)
        if tuple(old_logprobs.shape) != shape:
            raise ValueError(
                f"old_logprobs must have the shape of candidates {shape}, got {tuple(old_logprobs.shape)}"
            )
        old_logprobs = old_logprobs.to(acc)
        if not bool(torch.isfinite(old_logprobs).all()):
            raise ValueError("old_logprobs must be finite (found NaN or inf)")
    return candidates.to(torch.int64).contiguous(), scores.contiguous(), old_logprobs


# ----------------------------------------------------------------------------- public API


def token_tpo_loss(
    logits: Tensor,
    candidates: Tensor,
    scores: Tensor,
    *,
    old_logprobs: Optional[Tensor] = None,
    eta: float = 1.0,
    anchor: bool = True,
    temperature: float = 1.0,
    reduction: str = "mean",
    backend: str = "auto",
    return_aux: bool = False,
) -> Union[Tensor, Tuple[Tensor, dict]]:
    """Token-level TPO loss: at each state, fit the policy's distribution over K scored candidate
    next tokens to the TPO target by cross-entropy (paper Sec. 3.4).

    Only the K candidate logits of each row are read, since ``p`` is renormalized over the
    candidates; the gradient is nonzero only at those K entries of each row.

    Args:
        logits: ``[R, V]`` vocabulary logits of R states (flatten ``[B, T, V]`` with the caller's
            mask first); bf16/fp16/fp32/fp64. Math runs in fp32 (fp64 for fp64 logits).
        candidates: ``[R, K]`` integer token ids in ``[0, V)``. A repeated id is a separate group
            member with the same logit; its gradients add up (in ascending k order).
        scores: ``[R, K]`` finite scores of the candidates; standardized within each state
            (population std; a state whose K scores tie gets u = 0, hence zero on-policy gradient).
        old_logprobs: ``[R, K]`` candidate log-probs under the rollout policy (anchored target
            ``q ∝ p_old exp(u/eta)``). Only differences within a state matter, so full-vocab
            log-probs and raw logits of the rollout policy both work. They are used as given, not
            divided by ``temperature``: pass the log-probs of the distribution you sampled from.
            None: on-policy, ``p_old = p`` held constant.
        eta: target temperature (> 0). anchor: use p_old in q (False: ``q = softmax(u/eta)``).
        temperature: sampling temperature dividing the logits (> 0).
        reduction: ``"mean"`` over states, ``"sum"``, or ``"none"`` (``[R]``).
        backend: ``"auto"``, ``"triton"``, ``"cuda"``, ``"cpu"`` or ``"torch"`` (the candidate
            gather / scatter ops).
        return_aux: also return a dict of detached ``[R, K]`` ``candidate_logits`` (tempered),
            ``p``, ``q``, ``u``, ``coef`` (dLoss/d candidate logit, ``w (p - q)``) and ``[R]``
            ``state_loss``.
    """
    check_float_tensor("logits", logits, (2,))
    num_states, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    eta = check_positive("eta", eta)
    temperature = check_positive("temperature", temperature)
    reduction = check_reduction(reduction)
    anchor = check_flag("anchor", anchor)
    return_aux = check_flag("return_aux", return_aux)
    chosen = get_backend(backend, logits.device)
    candidates, scores, old_logprobs = _prepare_candidates(
        num_states, vocab, logits.device, compute_dtype(logits.dtype), candidates, scores, old_logprobs,
        "logits",
    )
    objective = TokenObjective(scores, old_logprobs, eta=eta, anchor=anchor, reduction=reduction)
    loss = TokenTPOLogitsFunction.apply(logits.contiguous(), candidates, objective, chosen, 1.0 / temperature)
    if return_aux:
        return loss, objective.aux()
    return loss


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
    reduction: str = "mean",
    backend: str = "auto",
    return_aux: bool = False,
) -> Union[Tensor, Tuple[Tensor, dict]]:
    """:func:`token_tpo_loss` on the logits ``hidden @ weight.T (+ bias)`` without forming them.

    Each candidate logit is the dot product ``hidden[r] . weight[y] (+ bias[y])``, so forward and
    backward cost O(R*K*H) and no ``[R, V]`` tensor exists. Gradients: ``dH[r] = sum_k g[r, k]
    W[y[r, k]]``; the weight gradient is a dense ``[V, H]`` tensor (the only vocab-sized work),
    zero except the candidate rows, which are summed deterministically in the compute dtype
    (fp32, fp64 for fp64) and cast to the weight's dtype; the bias gradient likewise.

    Args:
        hidden: ``[R, H]`` final hidden states of R states; bf16/fp16/fp32/fp64.
        weight: ``[V, H]`` lm_head weight, same dtype and device as ``hidden``.
        bias: optional ``[V]`` lm_head bias, same dtype.
        Everything else as in :func:`token_tpo_loss`. With ``backend="triton"`` the dot products
        and their gradients run as Triton kernels; other backends use PyTorch gathers and batched
        matmuls.
    """
    check_float_tensor("hidden", hidden, (2,))
    check_float_tensor("weight", weight, (2,))
    num_states, hidden_size = hidden.shape
    vocab = weight.shape[0]
    if weight.shape[1] != hidden_size:
        raise ValueError(
            f"weight must have shape [V, H] with H={hidden_size} (as hidden), got {tuple(weight.shape)}"
        )
    if vocab == 0:
        raise ValueError("weight must have a non-empty vocabulary dimension (V >= 1)")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have the dtype of hidden ({hidden.dtype}), got {weight.dtype}")
    check_same_device("weight", weight, hidden.device, "hidden")
    if bias is not None:
        check_float_tensor("bias", bias, (1,))
        if tuple(bias.shape) != (vocab,):
            raise ValueError(f"bias must have shape [V]=({vocab},), got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias must have the dtype of hidden ({hidden.dtype}), got {bias.dtype}")
        check_same_device("bias", bias, hidden.device, "hidden")
    eta = check_positive("eta", eta)
    temperature = check_positive("temperature", temperature)
    reduction = check_reduction(reduction)
    anchor = check_flag("anchor", anchor)
    return_aux = check_flag("return_aux", return_aux)
    chosen = get_backend(backend, hidden.device)
    candidates, scores, old_logprobs = _prepare_candidates(
        num_states, vocab, hidden.device, compute_dtype(hidden.dtype), candidates, scores, old_logprobs,
        "hidden",
    )
    objective = TokenObjective(scores, old_logprobs, eta=eta, anchor=anchor, reduction=reduction)
    loss = FusedLinearTokenTPOFunction.apply(
        hidden, weight, bias, candidates, objective, chosen, 1.0 / temperature
    )
    if return_aux:
        return loss, objective.aux()
    return loss
