"""Distributed TPO training of a tiny causal LM; runs on CPU (gloo) or GPUs (nccl).

    torchrun --standalone --nproc-per-node 2 -m bench.examples.distributed_training               # DDP
    torchrun --standalone --nproc-per-node 2 -m bench.examples.distributed_training --wrap fsdp2  # FSDP2
    torchrun --standalone --nproc-per-node 2 -m bench.examples.distributed_training --tensor-parallel 2
    torchrun --standalone --nproc-per-node 4 -m bench.examples.distributed_training --tensor-parallel 2

Data parallel: the batch's completions are dealt round-robin over the data-parallel ranks, so
every group of K completions is split over ranks; ``fused_linear_tpo_loss(process_group=...)``
gathers only per-completion numbers. Vocabulary parallel (``--tensor-parallel T``): each of T
ranks holds a contiguous slice of the lm_head rows (``vocab_parallel_group=...``); the loss merges
per-token partials. With both, ranks form a (data x tensor) mesh. ``--check`` (default on)
trains the same model on the whole batch in one process alongside and prints the largest
difference of the parameters.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import tpo_kernels
from tpo_kernels.distributed import count_collectives

VOCAB, HIDDEN, LENGTH, K, GROUPS = 1000, 64, 16, 4, 4  # 4 prompts x K=4 completions


class TinyLM(nn.Module):
    """Embedding, a causal running mean, one MLP block; the lm_head (or its shard) is separate."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())

    def forward(self, input_ids):
        x = self.embed(input_ids)
        x = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)[:, None]
        return x + self.block(x)


class Policy(nn.Module):
    """Model plus loss in one forward (under FSDP2 the lm_head weight is unsharded only there)."""

    def __init__(self, lm_head_rows: slice, **loss_options) -> None:
        super().__init__()
        torch.manual_seed(0)  # every rank (and the single-process check) starts from the same weights
        self.lm = TinyLM()
        self.lm_head = nn.Parameter(torch.randn(VOCAB, HIDDEN)[lm_head_rows].clone() * 0.02)
        self.loss_options = loss_options

    def forward(self, input_ids, labels, scores, group_ids):
        return tpo_kernels.fused_linear_tpo_loss(self.lm(input_ids), self.lm_head, labels, scores,
                                                 group_ids=group_ids, **self.loss_options)


def whole_batch(device):
    """Every rank builds the same batch: prompts' completions with random rewards, some tied."""
    gen = torch.Generator().manual_seed(1)
    n = GROUPS * K
    tokens = torch.randint(0, VOCAB, (n, LENGTH + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[torch.arange(LENGTH)[None, :] >= torch.randint(LENGTH // 2, LENGTH + 1, (n, 1), generator=gen)] = -100
    scores = torch.randint(0, 2, (n,), generator=gen).float()
    scores[:K] = 1.0  # group 0 ties: zero signal, no gradient
    group_ids = torch.arange(n) // K
    return [t.to(device) for t in (tokens[:, :-1], labels, scores, group_ids)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-parallel", type=int, default=1, help="ranks sharing the lm_head's vocabulary")
    parser.add_argument("--wrap", choices=("ddp", "fsdp2"), default="ddp", help="data-parallel wrapper")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-check", dest="check", action="store_false")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda" if use_cuda else "cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = args.tensor_parallel
    if world % tp != 0:
        raise SystemExit(f"--tensor-parallel {tp} must divide the number of processes {world}")
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world // tp, tp),
                                                          mesh_dim_names=("dp", "tp"))
    dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
    dp, dp_rank, tp_rank = world // tp, mesh.get_local_rank("dp"), mesh.get_local_rank("tp")

    # This rank's lm_head rows: a contiguous vocabulary slice (V need not divide by tp).
    sizes = [len(part) for part in torch.arange(VOCAB).tensor_split(tp)]
    rows = slice(sum(sizes[:tp_rank]), sum(sizes[:tp_rank + 1]))
    options = dict(process_group=dp_group, vocab_parallel_group=tp_group if tp > 1 else None)
    policy = Policy(rows, **options).to(device)
    if args.wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(policy, process_group=dp_group)
    else:
        from torch.distributed.fsdp import fully_shard

        if tp > 1:
            raise SystemExit("this example wraps FSDP2 for data parallelism only (--tensor-parallel 1)")
        fully_shard(policy.lm.block, mesh=mesh["dp"])
        model = fully_shard(policy, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    input_ids, labels, scores, group_ids = whole_batch(device)
    mine = torch.arange(dp_rank, GROUPS * K, dp, device=device)  # round-robin: every group spans ranks
    if args.check:
        reference = Policy(slice(None)).to(device)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=1.0)

    for step in range(args.steps):
        with count_collectives() as log:
            loss = model(input_ids[mine], labels[mine], scores[mine], group_ids[mine])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if args.check:
            ref_loss = reference(input_ids, labels, scores, group_ids)
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        if rank == 0:
            sent = ", ".join(f"{r.purpose} {r.payload_bytes} B" for r in log)
            check = f" (one process: {ref_loss.item():.6f})" if args.check else ""
            print(f"step {step}: loss {loss.item():.6f}{check}; tpo_kernels collectives per rank: {sent}")

    if args.check:
        worst = 0.0
        for (name, p), (_, q) in zip(policy.named_parameters(), reference.named_parameters()):
            local = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 shards are DTensors
            full = q[rows] if name == "lm_head" else q
            worst = max(worst, (local.detach() - full.detach()).abs().max().item())
        worst_t = torch.tensor(worst, device=device)
        dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"mesh dp={dp} x tp={tp}, {args.wrap}: largest parameter difference from one-process "
                  f"training after {args.steps} steps: {worst_t.item():.2e}")
        if worst_t.item() > 1e-4:
            raise SystemExit("distributed training diverged from one-process training")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
