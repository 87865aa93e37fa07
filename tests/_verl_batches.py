"""verl-shaped batches for the verl integration tests (one rank and split over ranks)."""

from __future__ import annotations

import numpy as np
import torch

from tpo_kernels import reference
from tpo_kernels.integrations.verl import compute_tpo_outcome_advantage

K, T, V = 4, 6, 11


def rollout(groups: int = 3, dtype=torch.float64, seed: int = 0):
    """A verl-shaped batch of ``groups`` groups of K responses: logits (the policy's), responses,
    right-padded response mask, old log-probs of a nearby policy, token-level rewards on the last
    response token, uids. Group 1 ties (no reward signal)."""
    rows = K * groups
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, T, V, generator=gen, dtype=torch.float64)
    responses = torch.randint(0, V, (rows, T), generator=gen)
    lengths = torch.randint(1, T + 1, (rows,), generator=gen)
    mask = torch.arange(T) < lengths.unsqueeze(1)
    rewards = torch.randint(0, 3, (rows,), generator=gen).to(torch.float64)
    rewards[K : 2 * K] = 1.0
    token_rewards = torch.zeros(rows, T, dtype=dtype)
    token_rewards[torch.arange(rows), lengths - 1] = rewards.to(dtype)
    old_logits = logits + 0.1 * torch.randn(rows, T, V, generator=gen, dtype=torch.float64)
    old_log_prob = reference.token_logprobs(old_logits, responses).masked_fill(~mask, 0.0).to(dtype)
    uids = np.array([f"prompt-{b // K}" for b in range(rows)], dtype=object)
    return dict(logits=logits, responses=responses, mask=mask, rewards=rewards, token_rewards=token_rewards,
                old_log_prob=old_log_prob, uids=uids)


def reorder(batch, order: torch.Tensor):
    """The batch's rows in ``order`` (as verl's ``DataProto.reorder``)."""
    rows = len(batch["uids"])
    out = {name: value[order] if isinstance(value, torch.Tensor) and value.shape[:1] == (rows,) else value
           for name, value in batch.items()}
    out["uids"] = batch["uids"][order.numpy()]
    return out


def actor_config(**overrides):
    """The fields of verl's ActorConfig the loss reads (a dict has the same ``.get``)."""
    config = dict(rollout_n=K, use_dynamic_bsz=False, shuffle=False, global_batch_info={})
    config.update(overrides)
    return config


def policy_inputs(batch, dtype=torch.float64, advantages=None):
    """(logits leaf, log_prob, the loss's keyword arguments) with advantages from the tpo
    estimator on the whole ``batch`` unless given (rows of a batch the estimator saw whole)."""
    logits = batch["logits"].clone().requires_grad_()
    log_prob = reference.token_logprobs(logits, batch["responses"]).to(dtype)
    if advantages is None:
        advantages, _ = compute_tpo_outcome_advantage(batch["token_rewards"], batch["mask"].to(dtype), batch["uids"])
    kwargs = dict(old_log_prob=batch["old_log_prob"], log_prob=log_prob, advantages=advantages,
                  response_mask=batch["mask"])
    return logits, log_prob, kwargs
