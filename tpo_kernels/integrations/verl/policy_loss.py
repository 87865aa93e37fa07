"""The ``tpo`` policy loss: verl's policy-loss signature on top of :func:`tpo_loss_from_logprobs`."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ... import kit, tpo_loss_from_logprobs
from .advantage import SCORE_BITS, decode_advantages, decode_members, response_weights
from .record import ROW_FIELD, MiniBatchRecord, current_rows

# A whole group's standardized scores sum to 0 and their squares to its size (population std),
# exactly up to the 2**-24 resolution of the encoded scores; a near-tied group's centered scores
# (std <= score_eps, the estimator's near-tie rule) sum to 0 and have a mean square <= score_eps**2.
_WHOLE_GROUP_ATOL = 1e-5


def _decoded_score_eps(score_eps: float) -> float:
    """The near-tie threshold for the estimator's decoded scores. The estimator decided on the raw
    rewards: a group with std <= score_eps got its centered scores (std <= score_eps), any other
    group standardized ones (std 1). Rounded to 2**-24, a centered group's std may exceed
    score_eps by up to 2**-25 (rewards 0 and 1.98e-6: std 0.99e-6, decoded 1.013e-6), and
    re-deciding with score_eps alone would divide it by its std. One quantum of tolerance keeps
    every centered group centered; a standardized group's decoded std is 1 to 2**-25, which
    centering or standardizing leaves unchanged either way (for any score_eps)."""
    return score_eps + 2.0**-SCORE_BITS


def _group_size(config) -> int:
    """K, the responses per prompt (verl's ``rollout_n``), from verl's actor config."""
    if config is None:
        raise ValueError("config: the TPO policy loss needs verl's actor config (rollout_n, batching settings)")
    group_size = config.get("rollout_n", None)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"config.rollout_n must be the number of responses per prompt (int >= 1), got {group_size!r}")
    return group_size


def _batching(config) -> Tuple[int, int, Optional[int]]:
    """(K, dp_size, global_batch_size) from verl's actor config, after checking the batching
    settings that would split groups in ways the loss cannot see."""
    group_size = _group_size(config)
    if config.get("use_dynamic_bsz", False):
        raise ValueError(
            "config.use_dynamic_bsz: dynamic batch sizes regroup rows by token count, so a micro-batch step over the "
            "data-parallel ranks no longer holds whole groups; record each mini-batch first "
            "(actor_rollout_ref.model.external_lib=tpo_kernels.integrations.verl.worker) or set "
            "actor.use_dynamic_bsz=False"
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


def _whole(ids: Tensor, scores: Tensor, score_eps: float) -> Tensor:
    """``[G]`` bool per distinct id (sorted): whether the responses given are its whole group
    (scores summing to 0, squares to the count or, near-tied, at most score_eps**2 each)."""
    _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, scores)
    squares = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, scores * scores)
    near_tied = squares <= counts * (score_eps + 2.0**-24) ** 2  # exact ties included
    standardized = (squares - counts).abs() <= _WHOLE_GROUP_ATOL * counts
    return (sums.abs() <= _WHOLE_GROUP_ATOL * counts) & (near_tied | standardized)


def _step_groups(u: Tensor, group_ids: Tensor, member_ids: Tensor, group_size: int, process_group,
                 score_eps: float) -> Tuple[Tensor, Tensor]:
    """The (group id, score) of every counted response of this micro-batch step over the
    data-parallel ranks, on the CPU; raises unless they form whole groups. When every response
    carries its group (:func:`.advantage.decode_members`: counted or not), each group must have
    exactly ``rollout_n`` of them here, which finds a part of a tied group too; otherwise (a row
    without a marker) the counted members' scores must sum to 0 and square to their count (or be
    near-tied), blind to a part of a tied group."""
    local = torch.stack([member_ids.to(u.device, torch.float64), group_ids.to(u.device, torch.float64),
                         u.to(torch.float64)], dim=1)
    rows = kit.gather_rows(local, process_group, purpose="step_groups").rows.cpu()
    members, ids, scores = rows[:, 0].to(torch.int64), rows[:, 1].to(torch.int64), rows[:, 2]
    counted = ids >= 0
    ids, scores = ids[counted], scores[counted]
    whole = bool(_whole(ids, scores, score_eps).all())
    if bool((members >= 0).all()):
        _, sizes = torch.unique(members, return_counts=True)
        if bool((sizes > group_size).any()):
            raise ValueError(f"config.rollout_n: this step holds a group of {int(sizes.max())} responses, more than "
                             f"rollout_n = {group_size}")
        whole = whole and bool((sizes == group_size).all())
    if not whole:
        raise ValueError(
            "advantages: this micro-batch step over the data-parallel ranks holds part of a group (fewer than "
            "rollout_n of its responses, or standardized scores that do not sum to 0), and TPO's group softmax "
            "needs the current log-probs of all its responses. "
            "If verl's gradient accumulation split it, record each mini-batch first "
            "(actor_rollout_ref.model.external_lib=tpo_kernels.integrations.verl.worker: any micro-batching, "
            "use_dynamic_bsz included) or train each rank's share of the mini-batch in one micro-batch "
            "(ppo_micro_batch_size_per_gpu = ppo_mini_batch_size * rollout.n / data-parallel size). Either way a "
            "group must not span mini-batches: verl's sequence balancing spreads groups over the whole batch, so "
            "train one mini-batch per step (ppo_mini_batch_size = data.train_batch_size)"
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
        rollout_is_weights: None, or verl's sequence-level importance weights (``rollout_is=sequence``,
            ``[B, T]``, one value per response on its counted tokens): each response counts in its
            group with its weight ``w`` (see :func:`_log_weights`); ``w = 0`` (IcePop's
            out-of-bounds responses) takes it out of its group. Token-level weights are refused.
        eta, anchor, score_eps, length_normalize, backend: TPO's settings (see
            :func:`tpo_kernels.tpo_loss`). The estimator already applied the near-tie rule to the
            raw rewards; its centered scores (std <= score_eps) stay centered here, its
            standardized ones (std 1) stay standardized (:func:`_decoded_score_eps`), so the two
            agree for the same score_eps.

    Returns ``(loss, metrics)``; metrics are floats named ``actor/...``.
    """
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be [B, T], got shape {tuple(log_prob.shape)}")
    for name, tensor in (("old_log_prob", old_log_prob), ("advantages", advantages), ("response_mask", response_mask)):
        if tensor.shape != log_prob.shape:
            raise ValueError(f"{name} must have log_prob's shape {tuple(log_prob.shape)}, got {tuple(tensor.shape)}")
    mask = response_mask.bool()
    u, group_ids = decode_advantages(advantages.detach(), mask)
    weights = None if rollout_is_weights is None else response_weights(rollout_is_weights, mask)
    settings = dict(eta=eta, anchor=anchor, score_eps=score_eps, length_normalize=length_normalize, backend=backend)
    recorded = current_rows()
    if recorded is not None:  # inside verl's micro-batch loop, with the mini-batch recorded
        return _recorded_loss(*recorded, _group_size(config), u, group_ids, log_prob, old_log_prob, mask, weights,
                              **settings)
    group_size, dp_size, global_batch = _batching(config)
    process_group = _data_parallel_group(dp_size)
    member_ids = decode_members(advantages.detach(), mask)
    step_ids, step_scores = _step_groups(u, group_ids, member_ids, group_size, process_group, score_eps)
    loss_inputs = dict(logprobs=log_prob, mask=mask, group_ids=group_ids,
                       old_logprobs=old_log_prob.detach() if anchor else None, anchor=anchor,
                       seq_log_weights=None if weights is None else _log_weights(weights, log_prob.device))
    kept = group_ids >= 0 if weights is None else (group_ids >= 0) & (weights > 0).to(group_ids.device)
    if not bool(kept.any()) and process_group is None:
        # Every response here has weight 0 (or no counted token): no loss, no gradient.
        return log_prob.sum() * 0.0, _metrics(None, step_ids, step_scores, log_prob, old_log_prob, mask, dp_size)
    loss, aux = tpo_loss_from_logprobs(
        scores=u.to(log_prob.dtype), eta=eta, score_eps=_decoded_score_eps(score_eps),
        length_normalize=length_normalize, reduction="mean" if global_batch is None else "sum", backend=backend,
        return_aux=True, process_group=process_group, **loss_inputs,
    )
    if global_batch is not None:
        # Micro-batch gradients add up and data parallelism averages over the ranks. Without a
        # gather each rank's sum covers its own groups (times dp_size: the average); with one,
        # every rank's loss covers the step's groups and its gradient is dp_size times its share.
        loss = loss * (group_size / global_batch) * (1 if process_group is not None else dp_size)
    metrics = _metrics(aux, step_ids, step_scores, log_prob, old_log_prob, mask, dp_size)
    return loss, metrics


def _log_weights(weights: Tensor, device) -> Tensor:
    """``[B]`` float64 ``log w`` per response for the loss's ``seq_log_weights``: each response counts
    with multiplicity ``w_i`` in its group (as if drawn ``w_i`` times), in both distributions,

        p_i = w_i exp(ell_i) / sum_j w_j exp(ell_j),    q_i = w_i p_old_i exp(u_i / eta) / Z,

    (``p_old_i`` dropped without the anchor), so ``dL/d ell_i = p_i - q_i`` still sums to 0 over the
    group. The target policy (p = q) is the unweighted one; the weights change how much each sample
    counts. ``w = 0`` (``log w = -inf``) takes a response out of its group (no mass, no gradient,
    the rest renormalized), exactly as a rejection mask does; equal weights change nothing."""
    return torch.log(weights).to(device)  # log 0 = -inf: out of its group


def _recorded_others(record: MiniBatchRecord, rows: Tensor, group_ids: Tensor, u: Tensor, group_size: int,
                     score_eps: float) -> Tensor:
    """The record indices of the other members of the micro-batch's groups, after checking that
    the micro-batch's rows are the recorded ones and that the record holds its groups whole."""
    if len(rows) != len(u):
        raise ValueError(f"{ROW_FIELD}: {len(rows)} recorded rows for a micro-batch of {len(u)} responses")
    if not (torch.equal(record.group_ids[rows], group_ids) and torch.equal(record.scores[rows], u)):
        raise ValueError(
            f"{ROW_FIELD}: the micro-batch's responses are not the recorded rows (their groups or scores differ): "
            "the mini-batch changed between tpo_kernels' record and verl's training step"
        )
    own = group_ids >= 0
    wanted = torch.unique(group_ids[own])
    touched = torch.isin(record.group_ids, wanted)
    # Each group's responses in the record, counted or not (a response without a counted token
    # carries its group: advantage.decode_members); sorted by id, as _whole's groups below.
    members = record.group_ids if record.member_ids is None else record.member_ids
    _, recorded_sizes = torch.unique(members[torch.isin(members, wanted)], return_counts=True)
    if bool((recorded_sizes > group_size).any()):
        raise ValueError(f"config.rollout_n: the record holds a group of {int(recorded_sizes.max())} responses, more "
                         f"than rollout_n = {group_size}")
    # Fewer than K responses is part of a group, unless a response of the mini-batch carries no
    # group; then the scores' sums tell (blind to a part of a tied group).
    short = (recorded_sizes < group_size) & ~bool((members < 0).any())
    if not bool((~short & _whole(record.group_ids[touched], record.scores[touched], score_eps)).all()):
        raise ValueError(
            "advantages: a group's responses are in different mini-batches (the recorded mini-batch holds fewer "
            "than rollout_n of them, or their standardized scores do not sum to 0), so they are trained under "
            "different parameters and TPO has no single current policy for the group. verl 0.9.1's trainer "
            "balances sequence lengths over the whole batch, which spreads each group over the ranks' "
            "mini-batches: train one mini-batch per step (actor_rollout_ref.actor.ppo_mini_batch_size = "
            "data.train_batch_size; ppo_epochs may be > 1), or use one data-parallel rank, or the legacy trainer "
            "with trainer.balance_batch=False, shuffle=False and mini-batches of whole groups"
        )
    touched[rows[own]] = False
    return touched.nonzero().squeeze(1)


def _record_weights(record: MiniBatchRecord, rows: Tensor, weights: Optional[Tensor]) -> Optional[Tensor]:
    """The record's importance weights (None without), after checking that the micro-batch's are
    the recorded ones."""
    if (weights is None) != (record.weights is None):
        raise ValueError(
            f"rollout_is_weights: the micro-batch {'has' if weights is not None else 'has no'} importance weights but "
            f"tpo_kernels' mini-batch record {'has none' if weights is not None else 'has them'}: the mini-batch "
            "changed between the record and verl's training step"
        )
    if weights is not None and not torch.equal(record.weights[rows], weights.cpu()):
        raise ValueError("rollout_is_weights: the micro-batch's weights are not the recorded ones: the mini-batch "
                         "changed between tpo_kernels' record and verl's training step")
    return record.weights


def _recorded_loss(record: MiniBatchRecord, rows: Tensor, group_size: int, u: Tensor, group_ids: Tensor,
                   log_prob: Tensor, old_log_prob: Tensor, mask: Tensor, weights: Optional[Tensor], *, eta: float,
                   anchor: bool, score_eps: float, length_normalize: bool,
                   backend: str) -> Tuple[Tensor, Dict[str, Any]]:
    """The micro-batch's exact share of the mini-batch loss: its groups' TPO loss on its own
    responses (differentiable) together with the recorded current log-probs of their other members
    (constants), so each response gets the gradient of the unsplit group. Each group's value
    counts with the fraction of its responses held here (the micro-batches' values add up to the
    mini-batch mean; the gradient is unchanged), times dp_size as data parallelism averages.
    Importance weights as in :func:`_log_weights`: every member's ``log w`` as ``seq_log_weights``,
    weight-0 members left out."""
    rows = rows.to(torch.int64)
    ids_cpu, u_cpu = group_ids.cpu(), u.to(torch.float64).cpu()
    others = _recorded_others(record, rows, ids_cpu, u_cpu, group_size, score_eps)
    recorded_weights = _record_weights(record, rows, weights)
    own = ids_cpu >= 0
    if recorded_weights is not None:  # weight 0: out of its group (counted as a member above)
        own &= recorded_weights[rows] > 0
        others = others[recorded_weights[others] > 0]
    if not bool(own.any()):  # no counted (kept) response here: no loss, no gradient
        return log_prob.sum() * 0.0, _recorded_metrics(None, None, log_prob, old_log_prob, mask)
    device, dtype = log_prob.device, log_prob.dtype
    own_mask = mask[own.to(mask.device)]
    own_lengths = own_mask.sum(1).cpu()
    other_tokens = record.num_tokens[others].to(torch.float64) if length_normalize else 1.0
    own_old = other_old = None
    if anchor:
        own_old = (old_log_prob.detach()[own.to(device)].to(torch.float64) * own_mask).sum(1).cpu()
        if length_normalize:
            own_old = own_old / own_lengths
        other_old = record.old_seq_logprobs[others] / other_tokens
    ids = torch.cat([ids_cpu[own], record.group_ids[others]])
    scores = torch.cat([u_cpu[own], record.scores[others]])
    # Packed rows: this micro-batch's counted responses token by token, then each other member as
    # one constant token carrying its sequence log-prob (its mean over its tokens with
    # length_normalize, which a one-token mean leaves unchanged); old log-probs per response.
    own_log_w = other_log_w = None
    if recorded_weights is not None:
        own_log_w = _log_weights(recorded_weights[rows][own], device)
        other_log_w = _log_weights(recorded_weights[others], device)
    rows_here = kit.LossRows(logprobs=log_prob[own.to(device)][own_mask], scores=u_cpu[own].to(device, dtype),
                             group_ids=ids_cpu[own].to(device), old_logprobs=own_old,
                             cu_seqlens=torch.cat([own_lengths.new_zeros(1), own_lengths.cumsum(0)]).to(device),
                             seq_log_weights=own_log_w)
    other_members = kit.LossRows(logprobs=record.seq_logprobs[others] / other_tokens, scores=record.scores[others],
                                 group_ids=record.group_ids[others], old_logprobs=other_old,
                                 cu_seqlens=torch.arange(len(others) + 1), seq_log_weights=other_log_w)
    joined = kit.add_constant_members(rows_here, other_members)
    old_ell = None if joined.old_logprobs is None else joined.old_logprobs.to(device)  # float64 sums
    per_group, aux = tpo_loss_from_logprobs(
        **dataclasses.replace(joined, old_logprobs=old_ell).loss_inputs(),
        eta=eta, anchor=anchor, score_eps=_decoded_score_eps(score_eps),
        length_normalize=length_normalize, reduction="none", backend=backend, return_aux=True,
    )
    _, inverse, sizes = torch.unique(ids, return_inverse=True, return_counts=True)  # per_group's order
    held = torch.bincount(inverse[: int(own.sum())], minlength=len(sizes))  # own responses come first
    fraction = held.to(torch.float64) / sizes
    weight = fraction.to(per_group.device, per_group.dtype)
    loss = (per_group - (1 - weight) * per_group.detach()).sum() * (record.dp_size / record.num_groups)
    signal = torch.zeros(len(sizes), dtype=torch.bool).index_put_((inverse,), scores != 0, accumulate=True)
    aux["zero_signal"] = ~signal  # no reward signal: every score of the group is 0
    return loss, _recorded_metrics(aux, fraction, log_prob, old_log_prob, mask)


def _recorded_metrics(aux, fraction: Optional[Tensor], log_prob: Tensor, old_log_prob: Tensor,
                      mask: Tensor) -> Dict[str, float]:
    """The micro-batch's groups' KL(q || p), H(p), H(q) and no-signal fraction, each group
    weighted by the fraction of its responses held here; verl's ``ppo_kl`` of this micro-batch."""
    log_ratio = (log_prob.detach() - old_log_prob).float()
    metrics = {"actor/ppo_kl": float(-(log_ratio * mask).sum() / mask.sum().clamp_min(1))}
    names = ("kl_q_p", "entropy_p", "entropy_q", "zero_signal")
    for name in names:
        value = float("nan") if aux is None else float((aux[name].cpu().double() * fraction).sum() / fraction.sum())
        metrics["actor/tpo_frac_zero_signal_groups" if name == "zero_signal" else f"actor/tpo_{name}"] = value
    return metrics


def _metrics(aux, step_ids: Tensor, step_scores: Tensor, log_prob: Tensor, old_log_prob: Tensor, mask: Tensor,
             dp_size: int) -> Dict[str, float]:
    """Per-group means of KL(q || p), H(p), H(q) over the step's groups (sums of per-response
    terms, so a group may span ranks: verl averages each rank's share, hence the ``dp_size``),
    the fraction of groups without reward signal, and verl's ``ppo_kl`` of this rank."""
    _, inverse = torch.unique(step_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if len(inverse) else 0
    signal = torch.zeros(num_groups, dtype=torch.bool).index_put_((inverse,), step_scores != 0, accumulate=True)
    share = dp_size / max(num_groups, 1)
    log_ratio = (log_prob.detach() - old_log_prob).float()
    ppo_kl = (-(log_ratio * mask).sum() / mask.sum().clamp_min(1)).double()
    if aux is None:  # no response kept in this step (all weighted 0): no group terms
        values = [float("nan")] * 3 + [float(ppo_kl)]
    else:
        p, q = aux["p"].double(), aux["q"].double()
        xlogy = torch.special.xlogy
        values = torch.stack([
            (xlogy(q, q) - xlogy(q, p)).sum() * share,
            -xlogy(p, p).sum() * share,
            -xlogy(q, q).sum() * share,
            ppo_kl,
        ]).tolist()  # one read-back for every metric
    names = ("actor/tpo_kl_q_p", "actor/tpo_entropy_p", "actor/tpo_entropy_q", "actor/ppo_kl")
    metrics = dict(zip(names, values))
    metrics["actor/tpo_frac_zero_signal_groups"] = 1.0 - float(signal.double().mean()) if num_groups else float("nan")
    return metrics
