"""The ``tpo`` policy loss: verl's policy-loss signature on top of :func:`tpo_loss_from_logprobs`."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ...functional import tpo_loss_from_logprobs
from .advantage import decode_scores

# A whole group's standardized scores sum to 0 and their squares to its size (population std),
# exactly up to the 2**-24 resolution of the encoded scores; a near-tied group's centered scores
# (std <= score_eps, the estimator's near-tie rule) sum to 0 and have a mean square <= score_eps**2.
_WHOLE_GROUP_ATOL = 1e-5


def _batching(config) -> Tuple[int, int, Optional[int]]:
    """(K, dp_size, global_batch_size) from verl's actor config, after checking the batching
    settings that would split groups in ways the loss cannot see."""
    if config is None:
        raise ValueError("config: the TPO policy loss needs verl's actor config (rollout_n, batching settings)")
    group_size = config.get("rollout_n", None)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"config.rollout_n must be the number of responses per prompt (int >= 1), got {group_size!r}")
    if config.get("use_dynamic_bsz", False):
        raise ValueError(
            "config.use_dynamic_bsz: dynamic batch sizes regroup rows by token count, so a micro-batch step over the "
            "data-parallel ranks no longer holds whole groups; set actor.use_dynamic_bsz=False"
        )
    if config.get("shuffle", False):
        raise ValueError("config.shuffle: shuffling the mini-batch rows splits TPO groups; set actor.shuffle=False")
    info = config.get("global_batch_info", None) or {}
    dp_size = info.get("dp_size") or 1
    global_batch = info.get("global_batch_size")
    if global_batch is None and dp_size > 1:
        raise ValueError("config.global_batch_info: global_batch_size is required when dp_size > 1")
    if global_batch is not None and global_batch % group_size != 0:
        raise ValueError(
            f"config.global_batch_info: a mini-batch of {global_batch} responses is not a whole number of groups of "
            f"rollout_n = {group_size}"
        )
    return group_size, dp_size, global_batch


def _data_parallel_group(dp_size: int):
    """The actor's data-parallel group, over which groups are gathered (None for one rank)."""
    if dp_size == 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"config.global_batch_info: dp_size is {dp_size} but torch.distributed is not initialized")
    world = dist.get_world_size()
    if world != dp_size:
        raise ValueError(
            f"config.global_batch_info: dp_size is {dp_size} but the default process group has {world} ranks: with "
            "sequence / tensor / pipeline parallelism the actor's data-parallel group is not the world group, and "
            "verl does not pass it to a policy loss; the TPO policy loss supports pure data parallelism (FSDP)"
        )
    return dist.group.WORLD


def _scores(advantages: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    """(score u, group id) per response from the tpo estimator's advantages on its counted
    tokens; a response without a counted token gets u = 0 and group -1 (tpo_kernels leaves it
    out). Checks that the advantage is one encoded value per response."""
    first = mask.to(torch.int8).argmax(dim=1, keepdim=True)  # first counted token (0 if none)
    counted = mask.any(dim=1)
    values = advantages.gather(1, first).squeeze(1)
    u, group_ids, marked = decode_scores(values)
    varying, unmarked = torch.stack([((advantages != values.unsqueeze(1)) & mask).any(),
                                     (counted & ~marked).any()]).tolist()  # one read-back
    if unmarked:
        raise ValueError(
            "advantages: the TPO policy loss needs the advantages of algorithm.adv_estimator=tpo, which carry each "
            "response's score and group in float64; got values it did not write (another estimator, or advantages "
            f"cast to {advantages.dtype} on the way)"
        )
    if varying:
        raise ValueError(
            "advantages: TPO needs one score per response, constant over its tokens (algorithm.adv_estimator=tpo), "
            "got advantages that vary along a response"
        )
    return torch.where(counted, u, 0.0), torch.where(counted, group_ids, -1)


def _step_groups(u: Tensor, group_ids: Tensor, process_group, score_eps: float) -> Tuple[Tensor, Tensor]:
    """The (group id, score) of every counted response of this micro-batch step over the
    data-parallel ranks, on the CPU; raises unless they form whole groups."""
    local = torch.stack([group_ids.to(torch.float64), u.to(torch.float64)], dim=1).cpu()
    local = local[local[:, 0] >= 0]
    if process_group is None:
        rows = local
    else:
        shares = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(shares, local, group=process_group)
        rows = torch.cat(shares)
    ids, scores = rows[:, 0].to(torch.int64), rows[:, 1]
    _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, scores)
    squares = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, scores * scores)
    near_tied = squares <= counts * (score_eps + 2.0**-24) ** 2  # exact ties included
    standardized = (squares - counts).abs() <= _WHOLE_GROUP_ATOL * counts
    whole = (sums.abs() <= _WHOLE_GROUP_ATOL * counts) & (near_tied | standardized)
    if not bool(whole.all()):
        raise ValueError(
            "advantages: this micro-batch step over the data-parallel ranks holds part of a group (its standardized "
            "scores do not sum to 0): every group's responses must be trained in the same micro-batch step on some "
            "rank. verl's sequence balancing spreads groups over the ranks' whole share of the batch, so use one "
            "mini-batch per step (ppo_mini_batch_size = data.train_batch_size) and one micro-batch per rank "
            "(ppo_micro_batch_size_per_gpu = its share), or the legacy trainer with trainer.balance_batch=False and "
            "micro-batches of whole groups (see tpo_kernels.integrations.verl)"
        )
    return ids, scores


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
            ``advantages`` are the ``tpo`` estimator's (each response's score and group).
        loss_agg_mode: ignored: TPO's loss is a mean over groups whatever verl's token
            aggregation (which still applies to verl's own KL and entropy terms).
        config: verl's actor config: ``rollout_n`` is the group size K; the batching settings
            are checked; ``global_batch_info`` gives the data-parallel size (groups are gathered
            over the ranks when it is > 1) and scales the loss to the mean over the mini-batch.
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
    group_size, dp_size, global_batch = _batching(config)
    process_group = _data_parallel_group(dp_size)
    mask = response_mask.bool()
    u, group_ids = _scores(advantages.detach(), mask)
    step_ids, step_scores = _step_groups(u, group_ids, process_group, score_eps)
    loss, aux = tpo_loss_from_logprobs(
        log_prob, u.to(log_prob.dtype), mask=mask, group_ids=group_ids,
        old_logprobs=old_log_prob.detach() if anchor else None, eta=eta, anchor=anchor, score_eps=score_eps,
        length_normalize=length_normalize, reduction="mean" if global_batch is None else "sum", backend=backend,
        return_aux=True, process_group=process_group,
    )
    if global_batch is not None:
        # Micro-batch gradients add up and data parallelism averages over the ranks. Without a
        # gather each rank's sum covers its own groups (times dp_size: the average); with one,
        # every rank's loss covers the step's groups and its gradient is dp_size times its share.
        loss = loss * (group_size / global_batch) * (1 if process_group is not None else dp_size)
    metrics = _metrics(aux, step_ids, step_scores, log_prob, old_log_prob, mask, dp_size)
    return loss, metrics


def _metrics(aux, step_ids: Tensor, step_scores: Tensor, log_prob: Tensor, old_log_prob: Tensor, mask: Tensor,
             dp_size: int) -> Dict[str, float]:
    """Per-group means of KL(q || p), H(p), H(q) over the step's groups (sums of per-response
    terms, so a group may span ranks: verl averages each rank's share, hence the ``dp_size``),
    the fraction of groups without reward signal, and verl's ``ppo_kl`` of this rank."""
    p, q = aux["p"].double(), aux["q"].double()
    xlogy = torch.special.xlogy
    _, inverse = torch.unique(step_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if len(inverse) else 0
    signal = torch.zeros(num_groups, dtype=torch.bool).index_put_((inverse,), step_scores != 0, accumulate=True)
    share = dp_size / max(num_groups, 1)
    log_ratio = (log_prob.detach() - old_log_prob).float()
    values = torch.stack([
        (xlogy(q, q) - xlogy(q, p)).sum() * share,
        -xlogy(p, p).sum() * share,
        -xlogy(q, q).sum() * share,
        (-(log_ratio * mask).sum() / mask.sum().clamp_min(1)).double(),
    ]).tolist()  # one read-back for every metric
    names = ("actor/tpo_kl_q_p", "actor/tpo_entropy_p", "actor/tpo_entropy_q", "actor/ppo_kl")
    metrics = dict(zip(names, values))
    metrics["actor/tpo_frac_zero_signal_groups"] = 1.0 - float(signal.double().mean()) if num_groups else float("nan")
    return metrics
