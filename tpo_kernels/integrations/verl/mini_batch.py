"""Exact TPO under verl's gradient accumulation: a record of the mini-batch at the current parameters.

verl trains a mini-batch (one optimizer step) in micro-batches, each forward and backward on its
own; a group's responses may sit in different micro-batches and on different ranks. Over one
mini-batch the parameters do not change, and the TPO gradient is a sum over responses,
``dL/dtheta = sum_i coef_i * d ell_i/dtheta`` with ``coef_i`` a function of the whole group's
current sequence log-probs ``ell``. So a micro-batch's loss is exact when it knows, detached, the
current ``ell`` of its groups' other members. Before verl trains a mini-batch,
:func:`train_batch_with_record` runs one no-grad forward over it (``engine.infer_batch``, the
micro-batching verl uses for the step), gathers every response's ``(group, u, ell, ell_old,
tokens, member group, importance weight)`` over the data-parallel ranks into a
:class:`MiniBatchRecord`, and tags each row with its place in the record (the tensor field
``tpo_row``, which verl's micro-batching carries along); while verl computes each micro-batch's
loss it makes the record and that micro-batch's rows visible to the ``tpo`` policy loss
(:func:`recorded_rows`). Costs: one extra forward per
mini-batch (without entropy), and ``[N, 7]`` float64 values all-gathered once per mini-batch.

Exact in exact arithmetic; in floating point the other members' ``ell`` come from the record's
forward, the micro-batch's own from the training forward, which agree to the forward's own
run-to-run differences (bitwise for a deterministic forward over the same micro-batches; a
model with active dropout has no single current policy either).

What stays required: every group's responses in one mini-batch (over the ranks). A group whose
responses are trained under different parameters has no single current policy; the policy loss
raises when it sees one.
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch

from .advantage import decode_advantages, decode_members, response_weights
from .policy_loss import tpo_policy_loss
from .record import ROW_FIELD, MiniBatchRecord, current_rows, gather_record, recorded_rows

__all__ = ["ROW_FIELD", "MiniBatchRecord", "current_rows", "gather_record", "recorded_rows", "record_mini_batch",
           "train_batch_for_tpo", "train_batch_with_record"]


def record_mini_batch(engine, data) -> Tuple[MiniBatchRecord, int]:
    """Run verl's engine forward-only over the mini-batch ``data`` (a TensorDict as verl's
    ``engine.train_batch`` receives it) and gather its :class:`MiniBatchRecord`."""
    from verl.utils import tensordict_utils as tu  # verl's: imported when verl trains, not with tpo_kernels
    from verl.workers.utils.padding import no_padding_2_padding

    probe = data.copy()  # the same rows (shallow); the record needs no entropy
    tu.assign_non_tensor(probe, calculate_entropy=False)
    with torch.no_grad():
        output = engine.infer_batch(probe, loss_function=None)
    log_prob = no_padding_2_padding(output["model_output"]["log_probs"], data)
    weighted = "rollout_is_weights" in data.keys()
    names = ("response_mask", "old_log_probs", "advantages") + (("rollout_is_weights",) if weighted else ())
    fields = data.select(*names).to_padded_tensor()
    mask = fields["response_mask"].bool()
    scores, group_ids = decode_advantages(fields["advantages"], mask)
    weights = response_weights(fields["rollout_is_weights"], mask) if weighted else None
    return gather_record(group_ids, scores, log_prob, fields["old_log_probs"], mask,
                         engine.get_data_parallel_group(), member_ids=decode_members(fields["advantages"], mask),
                         weights=weights)


def train_batch_with_record(engine, train_batch: Callable, data, loss_function: Callable):
    """``train_batch(data, loss_function)`` (verl's ``engine.train_batch``) with the mini-batch
    recorded first, so that the ``tpo`` policy loss is exact in every micro-batch."""
    record, offset = record_mini_batch(engine, data)
    data[ROW_FIELD] = offset + torch.arange(len(data))

    def loss_with_record(model_output, data, dp_group=None):
        with recorded_rows(record, data[ROW_FIELD]):
            return loss_function(model_output=model_output, data=data, dp_group=dp_group)

    return train_batch(data, loss_function=loss_with_record)


def _is_tpo_loss(loss_function) -> bool:
    """Whether verl's actor loss (``partial(ppo_loss, config=actor_config)``) calls a TPO policy loss."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    config = getattr(loss_function, "keywords", {}).get("config")
    if config is None or config.get("policy_loss") is None:
        return False
    policy_loss = get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
    return getattr(policy_loss, "func", policy_loss) is tpo_policy_loss


def train_batch_for_tpo(engine, train_batch: Callable, data, loss_function: Callable):
    """verl's ``engine.train_batch(data, loss_function)``, through :func:`train_batch_with_record`
    when the loss is TPO's and a rank's mini-batch spans several micro-batches (dynamic batch
    sizes, or more rows than ``micro_batch_size_per_gpu``); one micro-batch per rank needs no
    record (the policy loss gathers the step's groups over the ranks itself)."""
    from verl.utils import tensordict_utils as tu

    dynamic = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True)
    micro_batch_size = tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=None)
    several = dynamic or micro_batch_size is None or len(data) > micro_batch_size
    if several and _is_tpo_loss(loss_function):
        return train_batch_with_record(engine, train_batch, data, loss_function)
    return train_batch(data, loss_function=loss_function)

