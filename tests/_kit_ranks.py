"""What each rank of tests/test_integration_kit.py runs: the kit's row gather and token mean over a
gloo group, with the collectives they issue, and verl's mini-batch record gathered through them."""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from tpo_kernels import kit
from tpo_kernels.integrations.verl.mini_batch import gather_record

# Rank r holds ROWS[r] rows (ranks hold different numbers) of a [sum ROWS, WIDTH] table.
ROWS, WIDTH, TOKENS = (2, 3, 1), 4, 5


def table(world: int) -> torch.Tensor:
    total = sum(ROWS[:world])
    return torch.arange(total * WIDTH, dtype=torch.float64).view(total, WIDTH) / 7


def entropies(world: int):
    """``(values, mask)`` of every rank's rows, ``[sum ROWS, TOKENS]``."""
    gen = torch.Generator().manual_seed(4)
    total = sum(ROWS[:world])
    return torch.rand(total, TOKENS, generator=gen, dtype=torch.float64), torch.rand(total, TOKENS, generator=gen) > 0.4


def _mine(rank: int) -> slice:
    start = sum(ROWS[:rank])
    return slice(start, start + ROWS[rank])


def kit_on_share(rank: int, world: int) -> Dict:
    group, mine = dist.group.WORLD, _mine(rank)
    with kit.count_collectives() as gathered_log:
        gathered = kit.gather_rows(table(world)[mine], group)
    values, mask = entropies(world)
    own = values[mine].clone().requires_grad_()
    # The last row of this rank's share enters detached: a constant member.
    joined = torch.cat([own[:-1], own[-1:].detach()])
    with kit.count_collectives() as mean_log:
        mean = kit.token_mean(joined, mask[mine], group)
    mean.backward()
    with kit.count_collectives() as record_log:
        record, offset = gather_record(torch.full((ROWS[rank],), rank), torch.zeros(ROWS[rank], dtype=torch.float64),
                                       -values[mine], -values[mine] * 2, mask[mine], process_group=group)
    return dict(rows=gathered.rows, sizes=gathered.sizes, mine=gathered.mine, mean=mean.detach(), grad=own.grad,
                record_ids=record.group_ids, record_ell=record.seq_logprobs, record_offset=offset,
                dp_size=record.dp_size,
                logs={name: [(r.op, r.purpose, r.payload_bytes, r.output_bytes) for r in log]
                      for name, log in (("gather", gathered_log), ("mean", mean_log), ("record", record_log))})
