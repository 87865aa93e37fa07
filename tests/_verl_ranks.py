"""What each rank of tests/test_verl_split_ranks.py runs: its share of a verl batch through the
``tpo`` policy loss, with verl's global batch information for ``dp_size`` ranks."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from _verl_batches import actor_config, policy_inputs

from tpo_kernels.integrations.verl import tpo_policy_loss


def policy_loss_on_share(rank: int, world: int, cases: List[Tuple[Dict, torch.Tensor, int]]) -> List[Dict]:
    """For each case ``(batch, advantages, micro_batches)``: this rank's rows (its contiguous
    share, as verl dispatches a batch) in that many micro-batches, and per micro-batch the loss,
    metrics and the gradient of this rank's logits, or the error the loss raised."""
    return [_share_in_micro_batches(rank, world, *case) for case in cases]


def _share_in_micro_batches(rank: int, world: int, batch: Dict, advantages: torch.Tensor,
                            micro_batches: int) -> Dict:
    rows = len(batch["uids"]) // world
    mine = slice(rank * rows, (rank + 1) * rows)
    share = {name: value[mine] for name, value in batch.items()}
    logits, _, kwargs = policy_inputs(share, advantages=advantages[mine])
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
