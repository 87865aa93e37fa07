"""Public functional API, in the style of ``torch.nn.functional``."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ._validate import (
    check_flag,
    check_float_tensor,
    check_labels,
    check_positive,
    check_reduction,
    prepare_batch,
)
from .autograd import SelectiveLogprobsFunction, TPOLogitsFunction, TPOObjective
from .backends import compute_dtype, get_backend


def _rows(logits: Tensor) -> Tuple[Tensor, bool]:
    """``[..., V]`` logits as a contiguous ``[M, V]`` matrix; True when that needed a copy."""
    matrix = logits.reshape(-1, logits.shape[-1])
    if matrix.is_contiguous():
        return matrix, False
    return matrix.contiguous(), True


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
    beta: float = 0.0,
    eta: float = 1.0,
    anchor: bool = True,
    temperature: float = 1.0,
    reduction: str = "mean",
    backend: str = "auto",
    inplace_backward: bool = True,
    return_aux: bool = False,
) -> Union[Tensor, Tuple[Tensor, dict]]:
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
            ``[N]``; None = on-policy (p_old = p, held constant).
        ref_logprobs, beta: per-token reference log-probs and the weight of the k3 KL penalty
            (token mean over counted tokens; per group for ``reduction="none"``).
        eta: target temperature (> 0). anchor: use p_old in q (False: ``q = softmax(u/eta)``).
        temperature: sampling temperature dividing the logits (> 0).
        reduction: ``"mean"`` over groups, ``"sum"``, or ``"none"`` (``[G]``, groups in order of
            first completion for group_size, of sorted id for group_ids).
        backend: ``"auto"``, ``"triton"``, ``"cuda"``, ``"cpu"`` or ``"torch"``.
        inplace_backward: write the logits gradient into the logits buffer (saves a ``[M, V]``
            tensor). The logits' autograd version counter is bumped, so any other graph node that
            saved the same logits raises PyTorch's in-place error instead of reading overwritten
            values. Leaf tensors (e.g. created with ``requires_grad=True``) are never overwritten.
        return_aux: also return a dict of detached ``token_logprobs``, ``seq_logprobs``, ``p``,
            ``q``, ``u``, ``coef`` (dL/d ell) and ``group_loss``.
    """
    check_float_tensor("logits", logits, (2, 3))
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    eta = check_positive("eta", eta)
    temperature = check_positive("temperature", temperature)
    reduction = check_reduction(reduction)
    anchor = check_flag("anchor", anchor)
    inplace_backward = check_flag("inplace_backward", inplace_backward)
    return_aux = check_flag("return_aux", return_aux)
    chosen = get_backend(backend, logits.device)

    batch = prepare_batch(
        logits.shape[:-1],
        logits.shape[-1],
        logits.device,
        compute_dtype(logits.dtype),
        labels,
        scores,
        group_size=group_size,
        group_ids=group_ids,
        cu_seqlens=cu_seqlens,
        mask=mask,
        ignore_index=ignore_index,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        beta=beta,
    )
    matrix, copied = _rows(logits)
    # Overwrite the buffer only when it is ours or an intermediate activation, never a leaf.
    inplace = copied or (inplace_backward and logits.grad_fn is not None)
    objective = TPOObjective(batch, eta=eta, anchor=anchor, reduction=reduction, beta=float(beta))
    loss = TPOLogitsFunction.apply(matrix, objective, chosen, 1.0 / temperature, inplace)
    if return_aux:
        return loss, objective.aux()
    return loss


def selective_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    backend: str = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Per-token ``log softmax(logits / temperature)[labels]`` without materializing full-vocab
    log-probs; differentiable (its backward is the fused row backward).

    Returns float32 log-probs of the labels' shape (float64 for float64 logits), 0 where
    ``labels == ignore_index``; with ``return_entropy`` also the per-token entropy of the tempered
    distribution (0 at ignored positions), which is differentiable too. Under ``torch.no_grad()``
    this is the cheap way to get old / reference log-probs.
    """
    check_float_tensor("logits", logits, (2, 3))
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    temperature = check_positive("temperature", temperature)
    return_entropy = check_flag("return_entropy", return_entropy)
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.device != logits.device:
        raise ValueError(f"labels is on {labels.device} but the logits are on {logits.device}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels must have shape {tuple(logits.shape[:-1])}, got {tuple(labels.shape)}")
    chosen = get_backend(backend, logits.device)
    flat = labels.reshape(-1)
    counted = flat != ignore_index
    check_labels("labels", flat, counted, logits.shape[-1])
    flat = torch.where(counted, flat.to(torch.int64), -1).contiguous()
    matrix, _ = _rows(logits)
    out = SelectiveLogprobsFunction.apply(matrix, flat, chosen, 1.0 / temperature, return_entropy)
    if return_entropy:
        token_logprobs, entropy = out
        return token_logprobs.view(labels.shape), entropy.view(labels.shape)
    return out.view(labels.shape)
