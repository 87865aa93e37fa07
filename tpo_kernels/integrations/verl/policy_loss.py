"""The ``tpo`` policy loss: verl's policy-loss signature on top of :func:`tpo_loss_from_logprobs`."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from ...functional import tpo_loss_from_logprobs

# Relative tolerance of the group-centering check: float32 advantages of a whole group sum to
# zero within ~1e-7 of their absolute sum (the tpo estimator's, and GRPO's / RLOO's).
_CENTERING_RTOL = 1e-4


def _batching(config, num_rows: int) -> Tuple[int, Optional[float]]:
    """(K, scale): the group size from ``config.rollout_n`` after checking the batching contract
    visible in verl's actor config, and the factor turning the sum of this micro-batch's group
    losses into its share of the mean over every group of the global mini-batch (None: no global
    batch information, take the mean over this micro-batch's groups)."""
    if config is None:
        raise ValueError("config: the TPO policy loss needs verl's actor config (rollout_n, batching settings)")
    group_size = config.get("rollout_n", None)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"config.rollout_n must be the number of responses per prompt (int >= 1), got {group_size!r}")
    if config.get("use_dynamic_bsz", False):
        raise ValueError(
            "config.use_dynamic_bsz: dynamic batch sizes regroup rows by token count and split TPO groups; "
            "set actor.use_dynamic_bsz=False and actor.ppo_micro_batch_size_per_gpu to a multiple of rollout.n"
        )
    if config.get("shuffle", False):
        raise ValueError("config.shuffle: shuffling the mini-batch rows splits TPO groups; set actor.shuffle=False")
    micro = config.get("ppo_micro_batch_size_per_gpu", None)
    if micro is not None and micro % group_size != 0:
        raise ValueError(
            f"config.ppo_micro_batch_size_per_gpu ({micro}) must be a multiple of rollout_n ({group_size}): "
            "each micro-batch must hold whole groups"
        )
    if num_rows % group_size != 0:
        raise ValueError(
            f"log_prob: a micro-batch of {num_rows} responses is not a whole number of groups of rollout_n = "
            f"{group_size}: TPO would normalize over split groups"
        )
    info = config.get("global_batch_info", None) or {}
    dp_size = info.get("dp_size") or 1
    global_batch = info.get("global_batch_size")
    if global_batch is None:
        if dp_size > 1:
            raise ValueError("config.global_batch_info: global_batch_size is required when dp_size > 1")
        return group_size, None
    if global_batch % (dp_size * group_size) != 0:
        raise ValueError(
            f"config.global_batch_info: a mini-batch of {global_batch} responses over {dp_size} data-parallel "
            f"ranks is not a whole number of groups of rollout_n = {group_size} per rank"
        )
    # DDP / FSDP average the gradients over dp_size ranks, and micro-batch gradients add up:
    # sum_g L_g * dp_size / (global_batch / K) gives the mean over the mini-batch's groups.
    return group_size, dp_size * group_size / global_batch


def _scores(advantages: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """One score per response: the advantage on its counted tokens (0 for a response without
    one, which tpo_kernels leaves out of its group). Checks that the advantage is constant on each
    response and centered within each block of ``group_size`` rows."""
    first = mask.to(torch.int8).argmax(dim=1, keepdim=True)  # first counted token (0 if none)
    counted = mask.any(dim=1)
    scores = torch.where(counted, advantages.gather(1, first).squeeze(1), 0.0)
    blocks = scores.to(torch.float64).view(-1, group_size)
    whole = counted.view(-1, group_size).all(dim=1)
    off_center = blocks.sum(dim=1).abs() > _CENTERING_RTOL * blocks.abs().sum(dim=1)
    varying, uncentered = torch.stack([((advantages != scores.unsqueeze(1)) & mask).any(),
                                       (off_center & whole).any()]).tolist()  # one read-back
    if varying:
        raise ValueError(
            "advantages: TPO needs one score per response, constant over its tokens (an outcome estimator: "
            "algorithm.adv_estimator=tpo, or grpo / rloo), got advantages that vary along a response"
        )
    if uncentered:
        raise ValueError(
            f"advantages: a block of rollout_n = {group_size} consecutive responses is not centered, so it is "
            "not one group: the micro-batch does not hold whole contiguous groups (a reordered or shuffled batch), "
            "or the advantage estimator is not group-relative (use algorithm.adv_estimator=tpo)"
        )
    return scores


def tpo_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Optional[Tensor] = None,
    *,
    eta: float = 1.0,
    anchor: bool = True,
    score_eps: float = 1e-6,
    length_normalize: bool = False,
    backend: str = "auto",
) -> Tuple[Tensor, Dict[str, Any]]:
    """verl policy loss ``"tpo"`` (the signature of verl 0.9's ``compute_policy_loss_vanilla``).

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[B, T]``; ``log_prob`` carries the
            gradient; ``old_log_prob`` is TPO's anchor ``p_old`` (unused when ``anchor=False``);
            ``advantages`` holds one score per response on its tokens (see the package docstring).
        loss_agg_mode: ignored: TPO's loss is a mean over groups whatever verl's token
            aggregation (which still applies to verl's own KL and entropy terms).
        config: verl's actor config: ``rollout_n`` is the group size K; the batching settings
            are checked; ``global_batch_info`` scales the loss to the mean over the mini-batch.
        rollout_is_weights: must be None (TPO applies no per-token importance weights).
        eta, anchor, score_eps, length_normalize, backend: TPO's settings (see
            :func:`tpo_kernels.tpo_loss`). The estimator already applied the near-tie rule to the
            raw rewards; its centered scores (std <= score_eps) stay centered here, its
            standardized ones (std 1) stay standardized, so the two agree for the same score_eps.

    Returns ``(loss, metrics)``; metrics are floats named ``actor/...``.
    """
    if rollout_is_weights is not None:
        raise ValueError(
            "rollout_is_weights: TPO applies no per-token importance weights; disable "
            "algorithm.rollout_correction's importance sampling (rejection sampling alone is fine)"
        )
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be [B, T], got shape {tuple(log_prob.shape)}")
    for name, tensor in (("old_log_prob", old_log_prob), ("advantages", advantages), ("response_mask", response_mask)):
        if tensor.shape != log_prob.shape:
            raise ValueError(f"{name} must have log_prob's shape {tuple(log_prob.shape)}, got {tuple(tensor.shape)}")
    group_size, scale = _batching(config, log_prob.shape[0])
    mask = response_mask.bool()
    scores = _scores(advantages.detach(), mask, group_size)
    loss, aux = tpo_loss_from_logprobs(
        log_prob, scores, mask=mask, group_size=group_size,
        old_logprobs=old_log_prob.detach() if anchor else None, eta=eta, anchor=anchor, score_eps=score_eps,
        length_normalize=length_normalize, reduction="mean" if scale is None else "sum", backend=backend, return_aux=True,
    )
    if scale is not None:
        loss = loss * scale
    signal = (aux["u"] != 0).view(-1, group_size).any(dim=1)
    log_ratio = (log_prob.detach() - old_log_prob).float()
    values = torch.stack([
        aux["kl_q_p"].double().mean(),
        aux["entropy_p"].double().mean(),
        aux["entropy_q"].double().mean(),
        1.0 - signal.double().mean(),
        (-(log_ratio * mask).sum() / mask.sum().clamp_min(1)).double(),
    ]).tolist()  # one read-back for every metric
    names = ("actor/tpo_kl_q_p", "actor/tpo_entropy_p", "actor/tpo_entropy_q", "actor/tpo_frac_zero_signal_groups",
             "actor/ppo_kl")
    return loss, dict(zip(names, values))
