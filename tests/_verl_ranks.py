"""What each rank of tests/test_verl_split_ranks.py runs: its share of a verl batch through the
``tpo`` policy loss, with verl's global batch information for ``dp_size`` ranks, without or with
the mini-batch record of tpo_kernels' verl worker."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from _verl_batches import actor_config, policy_inputs

from tpo_kernels import reference
from tpo_kernels.integrations.verl import tpo_policy_loss
from tpo_kernels.integrations.verl.advantage import decode_advantages
from tpo_kernels.integrations.verl.mini_batch import gather_record, recorded_rows


def policy_loss_on_share(rank: int, world: int, cases: List[Tuple[Dict, torch.Tensor, int]]) -> List[Dict]:
    """For each case ``(batch, advantages, micro_batches)``: this rank's rows (its contiguous
    share, as verl dispatches a batch; with the batch's ``rollout_is_weights`` if it has them) in
    that many micro-batches, and per micro-batch the loss,
    metrics and the gradient of this rank's logits, or the error the loss raised."""
    return [_share_in_micro_batches(rank, world, *case) for case in cases]


def _share_in_micro_batches(rank: int, world: int, batch: Dict, advantages: torch.Tensor,
                            micro_batches: int) -> Dict:
    rows = len(batch["uids"]) // world
    mine = slice(rank * rows, (rank + 1) * rows)
    share = {name: value[mine] for name, value in batch.items()}
    logits, _, kwargs = policy_inputs(share, advantages=advantages[mine])
    if "rollout_is_weights" in share:  # verl's sequence-level importance weights, [B, T]
        kwargs["rollout_is_weights"] = share["rollout_is_weights"]
    info = dict(dp_size=world, batch_num_tokens=None, global_batch_size=len(batch["uids"]))
    out = []
    for part in torch.arange(rows).chunk(micro_batches):
        try:
            loss, metrics = tpo_policy_loss(**{name: value[part] for name, value in kwargs.items()},
                                            config=actor_config(global_batch_info=info))
        except ValueError as error:
            out.append(dict(error=str(error)))
            continue
        grad = torch.autograd.grad(loss, logits)[0][part]
        out.append(dict(loss=loss.detach(), metrics=metrics, grad=grad))
    return dict(rows=mine, micro_batches=out)


def recorded_share_in_micro_batches(rank: int, world: int, batch: Dict, advantages: torch.Tensor,
                                    micro_batch_size: int) -> Dict:
    """This rank's share as tpo_kernels' worker trains it: the mini-batch record gathered over the
    ranks, then micro-batches of ``micro_batch_size`` consecutive rows, each with its own forward
    and the record of its rows; the summed loss and the accumulated gradient of this rank's logits."""
    rows = len(batch["uids"]) // world
    mine = slice(rank * rows, (rank + 1) * rows)
    share = {name: value[mine] for name, value in batch.items()}
    logits, log_prob, kwargs = policy_inputs(share, advantages=advantages[mine])
    u, group_ids = decode_advantages(kwargs["advantages"], kwargs["response_mask"])
    record, offset = gather_record(group_ids, u, log_prob, kwargs["old_log_prob"], kwargs["response_mask"],
                                   process_group=dist.group.WORLD)
    loss, grad = 0.0, torch.zeros_like(logits)
    info = dict(dp_size=world, batch_num_tokens=None, global_batch_size=len(batch["uids"]))
    for part in torch.arange(rows).split(micro_batch_size):
        part_logits = logits.detach()[part].requires_grad_()
        part_kwargs = {name: value[part] for name, value in kwargs.items()}
        part_kwargs["log_prob"] = reference.token_logprobs(part_logits, share["responses"][part])
        with recorded_rows(record, offset + part):
            part_loss, _ = tpo_policy_loss(**part_kwargs, config=actor_config(global_batch_info=info))
        grad[part] += torch.autograd.grad(part_loss, part_logits)[0]
        loss = loss + part_loss.detach()
    return dict(rows=mine, loss=loss, grad=grad)
