"""TRL's generation batch as the TPO loss reads it: plain functions of TRL's batch dict and rewards.

:class:`~.trainer.TargetPOTrainer` calls them while it generates and batches: the batch dict
shuffled by whole groups (:func:`shuffle_groups`) or cut to some of its rows (:func:`take_rows`),
each completion's TPO score from TRL's raw rewards (:func:`tpo_scores_from_rewards`), and which
completions the sampler-trainer mismatch check keeps (:func:`sampler_kept`). None of them needs a
trainer: each works on tensors alone.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import Tensor

from ... import kit


def shuffle_groups(
    batch: Dict[str, Any], group_size: int, generator: Optional[torch.Generator] = None
) -> Dict[str, Any]:
    """Shuffle the rows of a TRL batch dict by whole groups of ``group_size`` consecutive rows.

    Tensors with a leading row dimension and lists are permuted in unison; 0-dim tensors and None
    are kept. Rows within a group keep their order.
    """
    sized = [v for v in batch.values() if v is not None and not (isinstance(v, Tensor) and v.ndim == 0)]
    if not sized:
        return dict(batch)
    rows = len(sized[0])
    if rows % group_size != 0:
        raise ValueError(f"cannot shuffle {rows} rows by whole groups of {group_size}")
    order = torch.randperm(rows // group_size, generator=generator)
    perm = (order.unsqueeze(1) * group_size + torch.arange(group_size)).reshape(-1)
    index = perm.tolist()

    def permute(value):
        if value is None or (isinstance(value, Tensor) and value.ndim == 0):
            return value
        if isinstance(value, Tensor):
            return value[perm.to(value.device)]
        return [value[i] for i in index]

    return {key: permute(value) for key, value in batch.items()}


def take_rows(batch: Dict[str, Any], index: Tensor) -> Dict[str, Any]:
    """The rows ``index`` of every ``[rows, ...]`` tensor of a batch dict; 0-dim tensors and None kept."""
    return {key: value[index.to(value.device)] if isinstance(value, Tensor) and value.ndim > 0 else value
            for key, value in batch.items()}


def padded_to_width(rows: Tensor, width: int, pad_value, left: bool = False) -> Tensor:
    """``[N, T, ...]`` rows padded with ``pad_value`` to ``[N, width, ...]``, on the right (on the
    left with ``left``, as TRL pads prompts)."""
    if rows.shape[1] == width:
        return rows
    out = rows.new_full((rows.shape[0], width, *rows.shape[2:]), pad_value)
    if left:
        out[:, width - rows.shape[1]:] = rows
    else:
        out[:, : rows.shape[1]] = rows
    return out


def tpo_scores_from_rewards(rewards_per_func: Tensor, weights: Tensor, group_size: int, aggregation: str,
                            score_eps: float) -> Tensor:
    """Each completion's TPO score (float64) from TRL's ``[rows, reward functions]`` rewards
    (NaN where a function returned None; rows in groups of ``group_size`` consecutive rows).

    ``"sum_then_normalize"`` (TRL's default): the weighted sum ``sum_k w_k r_k`` of the raw rewards,
    which the loss standardizes within the group under the tie rule. ``"normalize_then_sum"``: each
    reward is first standardized within the group by the losses' own rule
    (:func:`tpo_kernels.kit.standardize_scores`: population std; centered, undivided, when the std is
    at most ``score_eps``; 0 when the group ties exactly), then weighted and summed. A completion
    no function scored gets its group's mean score (TRL's advantage 0: no signal of its own); a
    group with no scored completion ties at 0.
    """
    rewards = rewards_per_func.double()
    weights = weights.to(rewards).view(1, 1, -1)
    if aggregation == "normalize_then_sum":
        # Each reward function's column standardized within the groups by the losses' own rule.
        group_ids = torch.arange(rewards.shape[0], device=rewards.device) // group_size
        scored = ~torch.isnan(rewards)
        rewards = torch.stack([
            kit.standardize_scores(column, group_ids, valid=valid, score_eps=score_eps).masked_fill(~valid, float("nan"))
            for column, valid in zip(rewards.unbind(1), scored.unbind(1))], dim=1)
    elif aggregation != "sum_then_normalize":
        raise ValueError(f"unknown multi_objective_aggregation {aggregation!r}")
    grouped = rewards.view(-1, group_size, rewards.shape[1])
    scored = ~torch.isnan(grouped)
    scores = (grouped * weights).nansum(dim=2)
    unscored = ~scored.any(dim=2)
    scores = scores.masked_fill(unscored, float("nan"))
    fill = torch.nan_to_num(scores.nanmean(dim=1, keepdim=True), nan=0.0).expand_as(scores)
    return torch.where(unscored, fill, scores).reshape(-1)


def sampler_kept(importance_sampling_ratio: Tensor, token_mask: Tensor) -> Tensor:
    """Which completions ([rows] bool) the sampler-trainer mismatch check keeps, from TRL's
    ``importance_sampling_ratio`` of the masking modes: ``[rows, 1]`` (``sequence_mask``:
    ``exp(sum_t (old_t - sampler_t))`` over the counted tokens) or ``[rows, T]`` (``token_mask``:
    ``exp(old_t - sampler_t)`` per token), which TRL sets to 0 where it lies outside
    ``[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max]`` (0 also when it
    underflows: TRL's weight is then 0 as well). A completion is left out when its sequence ratio is
    0, or (``token_mask``) when the ratio of any of its counted tokens is: TPO's group softmax is over
    whole completions, so a completion the sampler drew with an untrustworthy token is left out whole
    rather than scored on a subset of its tokens."""
    if importance_sampling_ratio.dim() != 2 or importance_sampling_ratio.shape[0] != token_mask.shape[0]:
        raise ValueError(f"importance_sampling_ratio must be [rows, 1] or [rows, T] for {tuple(token_mask.shape)} "
                         f"completion tokens, got {tuple(importance_sampling_ratio.shape)}")
    masked = importance_sampling_ratio == 0
    if importance_sampling_ratio.shape[1] == 1:
        return ~masked[:, 0]
    if importance_sampling_ratio.shape != token_mask.shape:
        raise ValueError(f"a per-token importance_sampling_ratio must have the completions' shape "
                         f"{tuple(token_mask.shape)}, got {tuple(importance_sampling_ratio.shape)}")
    return ~(masked & token_mask.to(masked.device)).any(dim=1)
