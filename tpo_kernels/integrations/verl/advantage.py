"""The ``tpo`` advantage estimator: one group-standardized score per response, and its group.

verl hands a policy loss the advantages, but no uids, and its trainer reorders the batch (it
balances sequence lengths over data-parallel ranks), so the loss cannot find a response's group
from its position. The estimator therefore writes both into the advantage, as float64:

    advantage = n * 2**-24 + (2 * g + 1) * 2**-45,    n = round(u * 2**24),

``u`` the response's standardized score, to 2**-24 (6e-8), and ``g`` its group's id (uids
numbered in order of first appearance in the batch) in the bits below, marked by the lowest set
bit. The advantage differs from ``u`` by less than 2**-24, so verl's advantage statistics stay
right; the loss reads ``g`` and ``u`` back exactly (:func:`decode_scores`). This needs float64
advantages from the estimator to the loss (verl keeps the estimator's dtype); a cast to a
narrower dtype loses the marker and the loss refuses the batch.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch
from torch import Tensor

from ... import kit

SCORE_BITS = 24  # u to 2**-24
MAX_ABS_SCORE = 2.0**5  # |u| <= sqrt(K - 1): K <= 1025 completions per prompt
GROUP_ID_BITS = 20  # up to 2**20 - 1 groups per batch
_FRACTION_BITS = GROUP_ID_BITS + 1  # the id and its marker bit
_DTYPE = torch.float64  # 5 + 24 + 21 bits fit float64's 53


def group_ids_from_uids(index: Sequence) -> Tensor:
    """``[B]`` int64: the group of each response, uids numbered in order of first appearance."""
    first_seen = {}
    ids = [first_seen.setdefault(uid, len(first_seen)) for uid in index]
    return torch.tensor(ids, dtype=torch.int64)


def encode_scores(u: Tensor, group_ids: Tensor) -> Tensor:
    """Float64 values carrying ``u`` (to 2**-24) and the group id (see the module docstring)."""
    if bool((u.abs() >= MAX_ABS_SCORE).any()):
        raise ValueError(f"a standardized score reached {MAX_ABS_SCORE}: groups of more than 1025 responses")
    if int(group_ids.max()) >= 2**GROUP_ID_BITS - 1:
        raise ValueError(f"index: at most {2**GROUP_ID_BITS - 1} groups per batch, got {int(group_ids.max()) + 1}")
    n = torch.round(u.to(_DTYPE) * 2.0**SCORE_BITS)
    fraction = (2 * group_ids.to(_DTYPE) + 1) * 2.0**-_FRACTION_BITS
    return (n + fraction) * 2.0**-SCORE_BITS


def decode_scores(values: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(u, group_ids, valid)`` from :func:`encode_scores`'s values; ``valid`` is False where a
    value does not carry the marker (not written by the ``tpo`` estimator, or cast below float64)."""
    x = values.to(_DTYPE) * 2.0**SCORE_BITS  # exact: a power of two
    n = torch.floor(x)
    marked = (x - n) * 2.0**_FRACTION_BITS  # 2g + 1, exactly, for a value of encode_scores
    valid = (values.dtype == _DTYPE) & (marked == torch.round(marked)) & (torch.remainder(marked, 2.0) == 1.0)
    group_ids = torch.where(valid, (marked - 1) / 2, -1.0).to(torch.int64)
    return n * 2.0**-SCORE_BITS, group_ids, valid


def decode_members(advantages: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` int64: the group of every response that carries one, counted or not: read on its
    first counted token, or at position 0 for a response without a counted token (the estimator
    writes the marker on its whole row: a response a rejection mask took out still belongs to its
    group's count); -1 where no marker is found (such a row's group is unknown)."""
    first = mask.to(torch.int8).argmax(dim=1, keepdim=True)  # first counted token (0 if none)
    _, group_ids, marked = decode_scores(advantages.gather(1, first).squeeze(1))
    return torch.where(marked, group_ids, -1)


def decode_advantages(advantages: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
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


def response_weights(rollout_is_weights: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` float64: each response's importance weight from verl's ``[B, T]`` weights, which
    must be one finite value >= 0 per response over its counted tokens (``rollout_is=sequence``;
    verl clamps each log ratio to [-20, 20] before exponentiating, but the loss needs no bound: its
    ``seq_log_weights`` take any finite ``log w``); 1 for a response without a counted token (it is
    out of its group anyway)."""
    if tuple(rollout_is_weights.shape) != tuple(mask.shape):
        raise ValueError(f"rollout_is_weights must be [B, T] like response_mask {tuple(mask.shape)}, got "
                         f"{tuple(rollout_is_weights.shape)}")
    weights = rollout_is_weights.detach().to(torch.float64)
    first = mask.to(torch.int8).argmax(dim=1, keepdim=True)
    per_response = weights.gather(1, first).squeeze(1)
    in_range = (weights >= 0) & torch.isfinite(weights)
    bad, varying = torch.stack([(mask & ~in_range).any(),
                                (mask & (weights != per_response.unsqueeze(1))).any()]).tolist()
    if bad:
        raise ValueError("rollout_is_weights must be finite and >= 0 on the counted tokens (an importance weight); "
                         "found a negative, NaN or infinite weight")
    if varying:
        raise ValueError(
            "rollout_is_weights vary along a response (algorithm.rollout_correction.rollout_is=token): TPO weights "
            "whole responses in their group; use rollout_is=sequence, or rollout_is=null"
        )
    return torch.where(mask.any(dim=1), per_response, 1.0)


# verl 0.9's rejection options that mask single tokens (verl.trainer.ppo.rollout_corr_helper).
_TOKEN_LEVEL_RS = ("token_k1", "token_k2", "token_k3")


def check_rollout_correction(config) -> None:
    """Refuse the parts of verl's ``algorithm.rollout_correction`` TPO cannot honour (see the
    package docstring): bypass mode (the sampler's log-probs would be TPO's anchor and the legacy
    trainer swaps the policy loss for its own), token-level rejection (a response with rejected
    tokens keeps a partial sequence log-prob, and nothing downstream can tell its rejected tokens
    from padding) and token-level importance weights (TPO weights whole responses)."""
    correction = None if config is None else config.get("rollout_correction", None)
    if correction is None:
        return
    if correction.get("bypass_mode", False):
        raise ValueError(
            "algorithm.rollout_correction.bypass_mode: bypass mode makes the sampler's log-probs TPO's anchor p_old "
            "(and verl's legacy trainer replaces the policy loss by its own); TPO anchors on the trainer's "
            "recomputed old log-probs: set bypass_mode=False (decoupled mode)"
        )
    options = [option.strip() for option in str(correction.get("rollout_rs", None) or "").split(",") if option.strip()]
    token_level = [option for option in options if option in _TOKEN_LEVEL_RS]
    if token_level:
        raise ValueError(
            f"algorithm.rollout_correction.rollout_rs: {','.join(token_level)} masks single tokens, which leaves a "
            "response with a partial sequence log-prob in its TPO group; use a sequence-level option, which takes "
            "the whole response out of its group: seq_max_k2 / seq_max_k3 reject a response with any token over the "
            "bound (token_k1 with bounds (1/c, c) is seq_max_k2 with threshold 0.5 * log(c)**2), or seq_sum_* / "
            "seq_mean_*"
        )
    if correction.get("rollout_is", None) == "token":
        raise ValueError(
            "algorithm.rollout_correction.rollout_is: token-level importance weights have no meaning for TPO, which "
            "weights whole responses in their group; use rollout_is=sequence (a response's weight is the truncated "
            "product of its token ratios), or rollout_is=null"
        )


def compute_tpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence,
    config=None,
    score_eps: float = 1e-6,
    **unused,
) -> Tuple[Tensor, Tensor]:
    """verl advantage estimator ``"tpo"``: the score of a response is the sum of its token-level
    rewards (an outcome reward), standardized within its group (the responses sharing its uid,
    wherever they are in the batch), ``u = (s - mean) / std`` (population std, over the group's
    responses with a counted token; exactly 0 for every member of a group whose scores tie). The
    advantage, float64, carries ``u`` and the group's id on every counted token (see the module
    docstring): ``advantages[b, t] = encode(u[b], g[b]) * response_mask[b, t]``, and on every
    token of a response without a counted token (u = 0 there: it is out of its group, but counted
    as its member; :func:`decode_members`). Raises for non-finite rewards, and for the parts of
    ``config.rollout_correction`` TPO refuses (:func:`check_rollout_correction`).

    Args:
        token_level_rewards, response_mask: ``[B, T]``, as verl passes them.
        index: ``[B]`` uids (verl's ``non_tensor_batch["uid"]``), in any order.
        config: verl's ``AlgoConfig`` (unused), and ``unused``: any other keyword verl passes.

    Returns ``(advantages, returns)``, the same ``[B, T]`` float64 tensor twice, as verl's GRPO does.
    """
    if token_level_rewards.dim() != 2 or response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            "token_level_rewards and response_mask must both be [B, T], got "
            f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}"
        )
    if len(index) != token_level_rewards.shape[0]:
        raise ValueError(f"index must hold one uid per response ({token_level_rewards.shape[0]}), got {len(index)}")
    if len(index) == 0:
        raise ValueError("index must hold one uid per response, got an empty batch")
    check_rollout_correction(config)
    group_ids = group_ids_from_uids(index)
    counted = (response_mask != 0).any(dim=1).cpu()
    scores = token_level_rewards.sum(dim=-1).to(_DTYPE).cpu()
    finite = torch.isfinite(scores)
    if not bool(finite.all()):
        row = int((~finite).nonzero()[0])
        raise ValueError(
            f"token_level_rewards: the reward of response {row} (uid {index[row]!r}) is {float(scores[row])}; TPO "
            f"standardizes each group's rewards and needs them finite ({int((~finite).sum())} non-finite in the batch)"
        )
    u = kit.standardize_scores(scores, group_ids, valid=counted, score_eps=score_eps)
    encoded = encode_scores(u, group_ids).to(response_mask.device)
    # A response without a counted token (empty, or taken out by a rejection mask) carries u = 0
    # and its group on its whole row: nothing reads its advantages but the loss, which counts it
    # as a member of its group (a micro-batch holding part of a group is then found by counting).
    row_mask = (response_mask != 0) | ~counted.to(response_mask.device).unsqueeze(1)
    advantages = encoded.unsqueeze(1) * row_mask
    return advantages, advantages
