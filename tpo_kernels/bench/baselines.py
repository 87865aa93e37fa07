"""The implementations a user would pick instead of tpo_kernels, written the way users write them.

Everything here is plain PyTorch (plus optional third-party fused cross-entropy kernels) and is
independent of the rest of tpo_kernels, so that a bug in the package cannot leak into the numbers
it is compared with.

Math (as in tpo_kernels.reference), on-policy and anchored, eta = 1, temperature = 1, reduction "mean":
token log-prob lp = log_softmax(z)[y]; ell = per-completion sum; per group of K:
u = standardized scores (population std, 0 on ties), log p = log_softmax(ell),
q = softmax(log p.detach() + u / eta), loss = mean over groups of -sum q log p.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


# --------------------------------------------------------------------------- group math


def standardize_rows(scores: Tensor) -> Tensor:
    """Per-row (s - mean) / std with the population std; a row whose scores all tie gets 0."""
    mean = scores.mean(dim=-1, keepdim=True)
    centered = scores - mean
    std = (centered * centered).mean(dim=-1, keepdim=True).sqrt()
    tied = scores.amax(dim=-1, keepdim=True) == scores.amin(dim=-1, keepdim=True)
    return torch.where(tied, torch.zeros_like(centered), centered / torch.where(tied, torch.ones_like(std), std))


def group_tpo_loss(group_logits: Tensor, scores: Tensor, eta: float = 1.0) -> Tensor:
    """TPO cross-entropy for rows of a ``[G, K]`` matrix of group-softmax inputs.

    ``group_logits`` are sequence log-probs (sequence-level TPO) or candidate log-probs
    (token-level TPO); on-policy, so p_old = p held constant.
    """
    u = standardize_rows(scores.to(group_logits.dtype))
    log_p = torch.log_softmax(group_logits, dim=-1)
    q = torch.softmax(log_p.detach() + u / eta, dim=-1)
    return -(q * log_p).sum(dim=-1).mean()


def sequence_tpo_from_token_logprobs(token_lp: Tensor, scores: Tensor, group_size: int) -> Tensor:
    """``token_lp`` [N, T] (fully valid tokens) -> sequence sums -> TPO over groups of K."""
    ell = token_lp.sum(dim=-1)
    return group_tpo_loss(ell.view(-1, group_size), scores.view(-1, group_size))


# --------------------------------------------------------------------------- sequence level


def _at_least_fp32(x: Tensor) -> Tensor:
    """fp32 for half-precision inputs, float64 stays float64 (the harness's float64 check)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def naive_token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """Eager: fp32 (float64 for float64 inputs) log_softmax over the full vocabulary, then gather
    the labels."""
    logp = torch.log_softmax(_at_least_fp32(logits), dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def naive_tpo_logits(logits: Tensor, labels: Tensor, scores: Tensor, group_size: int) -> Tensor:
    return sequence_tpo_from_token_logprobs(naive_token_logprobs(logits, labels), scores, group_size)


def naive_tpo_linear(hidden: Tensor, weight: Tensor, labels: Tensor, scores: Tensor, group_size: int) -> Tensor:
    """Materialize hidden @ W.T in the input dtype, then the eager logits path."""
    logits = hidden @ weight.t()
    return naive_tpo_logits(logits, labels, scores, group_size)


def torch_lce_available() -> Optional[str]:
    if not hasattr(F, "linear_cross_entropy"):
        return f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy"
    if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return f"torch {torch.__version__} has no torch.nn.LinearCrossEntropyOptions (chunked path)"
    return None


def torch_lce_tpo(hidden: Tensor, weight: Tensor, labels: Tensor, scores: Tensor, group_size: int) -> Tensor:
    """TPO on torch's chunked ``F.linear_cross_entropy(reduction="none")``: token log-prob = -CE."""
    n, t, h = hidden.shape
    ce = F.linear_cross_entropy(
        hidden.reshape(n * t, h),
        weight,
        labels.reshape(n * t),
        reduction="none",
        options=torch.nn.LinearCrossEntropyOptions(),
    )
    return sequence_tpo_from_token_logprobs(_at_least_fp32(-ce).view(n, t), scores, group_size)


def cce_available() -> Optional[str]:
    try:
        import cut_cross_entropy  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"cut_cross_entropy not importable ({type(exc).__name__}: {exc}); pip install cut-cross-entropy"
    return None


def cce_tpo(hidden: Tensor, weight: Tensor, labels: Tensor, scores: Tensor, group_size: int) -> Tensor:
    """TPO on Cut Cross-Entropy's ``linear_cross_entropy(..., reduction="none")``."""
    from cut_cross_entropy import linear_cross_entropy

    n, t, h = hidden.shape
    kwargs = {"reduction": "none"}
    if "shift" in inspect.signature(linear_cross_entropy).parameters:
        kwargs["shift"] = False  # labels are already aligned with the hidden states
    ce = linear_cross_entropy(hidden.reshape(n * t, h), weight, labels.reshape(n * t), **kwargs)
    return sequence_tpo_from_token_logprobs(_at_least_fp32(-ce).view(n, t), scores, group_size)


def cce_compile_tpo(hidden: Tensor, weight: Tensor, labels: Tensor, scores: Tensor, group_size: int) -> Tensor:
    """TPO on Cut Cross-Entropy's ``impl="torch_compile"`` (its portable path: ``torch.compile`` of
    materialized logits and cross-entropy; the one that runs on a CPU)."""
    from cut_cross_entropy import linear_cross_entropy

    n, t, h = hidden.shape
    ce = linear_cross_entropy(hidden.reshape(n * t, h), weight, labels.reshape(n * t), reduction="none",
                              impl="torch_compile")
    return sequence_tpo_from_token_logprobs(_at_least_fp32(-ce).view(n, t), scores, group_size)


def liger_available() -> Optional[str]:
    try:
        import liger_kernel  # noqa: F401
    except Exception as exc:
        return f"liger_kernel not importable ({type(exc).__name__}: {exc}); pip install liger-kernel"
    return None


def liger_tpo(hidden: Tensor, weight: Tensor, labels: Tensor, scores: Tensor, group_size: int) -> Tensor:
    """TPO on Liger-Kernel's fused linear cross entropy with ``reduction="none"``.

    Liger releases before linkedin/Liger-Kernel PR #1298 (July 2026) scale every row's gradient by
    ``grad_output[0]`` when reduction is "none"; the harness's gradient check flags that.
    """
    n, t, h = hidden.shape
    x, y = hidden.reshape(n * t, h), labels.reshape(n * t)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        ce = liger_fused_linear_cross_entropy(x, weight, y, reduction="none")
    except ImportError:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        ce = LigerFusedLinearCrossEntropyLoss(reduction="none")(weight, x, y)
    if isinstance(ce, tuple):
        ce = ce[0]
    return sequence_tpo_from_token_logprobs(_at_least_fp32(-ce).view(n, t), scores, group_size)


def liger_chunked_available() -> Optional[str]:
    reason = liger_available()
    if reason is not None:
        return reason
    try:
        from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase
    except Exception as exc:
        return f"liger_kernel has no chunked PPO log-probs ({type(exc).__name__}: {exc})"
    if not hasattr(LigerFusedLinearPPOBase, "chunk_forward"):
        return "liger_kernel.chunked_loss.fused_linear_ppo.LigerFusedLinearPPOBase has no chunk_forward"
    return None


def liger_chunked_tpo(hidden: Tensor, weight: Tensor, labels: Tensor, scores: Tensor, group_size: int) -> Tensor:
    """TPO on Liger-Kernel's chunked selective log-probs (the per-token log-probs its GRPO/PPO
    losses use: PyTorch, sequence x vocabulary chunks, logits recomputed in the backward)."""
    from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase

    token_lp = LigerFusedLinearPPOBase.chunk_forward(hidden, weight, labels)
    return sequence_tpo_from_token_logprobs(_at_least_fp32(token_lp), scores, group_size)


# --------------------------------------------------------------------------- token level


def naive_token_tpo_logits(logits: Tensor, candidates: Tensor, scores: Tensor) -> Tensor:
    """Full-vocab reference: fp32 log_softmax over V, gather the K candidates, TPO per state."""
    logp = torch.log_softmax(_at_least_fp32(logits), dim=-1)
    return group_tpo_loss(logp.gather(-1, candidates), scores)


def naive_token_tpo_linear(hidden: Tensor, weight: Tensor, candidates: Tensor, scores: Tensor) -> Tensor:
    return naive_token_tpo_logits(hidden @ weight.t(), candidates, scores)


# --------------------------------------------------------------------------- log-probs


def naive_selective_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    return naive_token_logprobs(logits, labels)
