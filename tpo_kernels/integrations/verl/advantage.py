"""The ``tpo`` advantage estimator: one group-standardized score per response, from verl's uids."""

from __future__ import annotations

from typing import Sequence, Tuple

import torch
from torch import Tensor

from ...group_math import standardize_dense


def contiguous_group_size(index: Sequence) -> int:
    """K, when ``index`` (one uid per response, verl's ``non_tensor_batch["uid"]``) lists the
    responses of each prompt as one run of K consecutive entries; otherwise ``ValueError``.

    The policy loss sees no uids, only the row order: this is where the order it relies on is
    checked, on the batch in the order the actor will receive it."""
    ids = list(index)
    if not ids:
        raise ValueError("index must hold one uid per response, got an empty index")
    starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]]
    sizes = {end - start for start, end in zip(starts, starts[1:] + [len(ids)])}
    if len(sizes) != 1 or len({ids[start] for start in starts}) != len(starts):
        raise ValueError(
            "index: the TPO policy loss needs the responses of each prompt as one run of rollout.n consecutive "
            f"rows, got runs of sizes {sorted(sizes)} over {len(set(ids))} uids in {len(ids)} rows. Something "
            "reordered the batch before the advantage step (verl balances sequence lengths over data-parallel "
            "ranks, which splits groups: see tpo_kernels.integrations.verl)."
        )
    return sizes.pop()


def compute_tpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence,
    config=None,
    score_eps: float = 1e-6,
    **unused,
) -> Tuple[Tensor, Tensor]:
    """verl advantage estimator ``"tpo"``: the score of a response is the sum of its token-level
    rewards (an outcome reward); the advantage is that score standardized within its group,
    ``u = (s - mean) / std`` (population std; exactly 0 for every member of a group whose scores
    tie; ``u = s - mean``, undivided, when the std is at most ``score_eps``: the loss's near-tie
    rule, applied here to the raw rewards), written on every counted token: ``advantages[b, t] = u[b] * response_mask[b, t]``.

    Args:
        token_level_rewards, response_mask: ``[B, T]``, as verl passes them.
        index: ``[B]`` uids; each group must be one run of K consecutive rows (checked).
        config: verl's ``AlgoConfig`` (unused), and ``unused``: any other keyword verl passes.

    Returns ``(advantages, returns)``, the same ``[B, T]`` tensor twice, as verl's GRPO does.
    """
    if token_level_rewards.dim() != 2 or response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            "token_level_rewards and response_mask must both be [B, T], got "
            f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}"
        )
    if len(index) != token_level_rewards.shape[0]:
        raise ValueError(f"index must hold one uid per response ({token_level_rewards.shape[0]}), got {len(index)}")
    group_size = contiguous_group_size(index)
    scores = token_level_rewards.sum(dim=-1).to(torch.float64).view(-1, group_size)
    u = standardize_dense(scores, torch.ones_like(scores, dtype=torch.bool), score_eps).reshape(-1, 1)
    advantages = (u * response_mask).to(token_level_rewards.dtype)
    return advantages, advantages
