"""Distributed TPO training of a tiny causal LM; runs on CPU (gloo) or GPUs (nccl).

    torchrun --standalone --nproc-per-node 2 -m bench.examples.distributed_training               # DDP
    torchrun --standalone --nproc-per-node 2 -m bench.examples.distributed_training --wrap fsdp2  # FSDP2
    torchrun --standalone --nproc-per-node 2 -m bench.examples.distributed_training --tensor-parallel 2
    torchrun --standalone --nproc-per-node 4 -m bench.examples.distributed_training --tensor-parallel 2
    torchrun --standalone --nproc-per-node 2 -m bench.examples.distributed_training --context-parallel 2
    torchrun --standalone --nproc-per-node 8 -m bench.examples.distributed_training --context-parallel 2 --tensor-parallel 2

Data parallel: the batch's completions are dealt round-robin over the data-parallel ranks, so
every group of K completions is split over ranks; ``fused_linear_tpo_loss(process_group=...)``
gathers only per-completion numbers. Vocabulary parallel (``--tensor-parallel T``): each of T
ranks holds a contiguous slice of the lm_head rows (``vocab_parallel_group=...``); the loss merges
per-token partials. Context parallel (``--context-parallel C``): every sequence is split over C
ranks, which hold the same completions and each its own positions of them
(``context_parallel_group=...``): ``--split head-tail`` (the default) cuts a sequence into 2C
chunks and gives rank r chunks r and 2C-1-r, the load-balanced split of torch's
``context_parallel``; ``--split contiguous`` gives rank r the r-th of C slices. The model's causal
running mean becomes context-parallel (each chunk adds the totals of the chunks before it, through
a differentiable exchange, so gradients cross the shard boundaries); the loss exchanges one row of
sums per completion. The ranks form a (data x context x vocabulary) mesh; DDP (or FSDP2) averages
over data x context, which with the loss's gradient contract (each rank's tokens get D*C times
their gradient) gives every parameter exactly its one-process gradient.

The label shift: the whole sequence is shifted first (``labels[t] = tokens[t + 1]``), then inputs
and labels are cut with the same positions. ``--shift-after-split`` shows the trap of shifting each
rank's shard instead: a position whose next token sits on another rank gets a wrong label (or
none), and training no longer matches one process.

``--check`` (default on) trains the same model on the whole batch in one process alongside, prints
|loss - one process| at every step and the largest difference of the parameters at the end, and
fails above 1e-4.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

import tpo_kernels
from tpo_kernels.distributed import count_collectives

VOCAB, HIDDEN, LENGTH, K, GROUPS = 1000, 64, 16, 4, 4  # 4 prompts x K=4 completions
SPLITS = ("head-tail", "contiguous")


# ----------------------------------------------------------------------------- sequence split


@dataclass(frozen=True)
class SequenceShard:
    """How every sequence is cut over the ranks of a context ``group``, seen from ``rank``.

    ``bounds``: each chunk's ``(start, stop)`` positions, in sequence order; ``owned[r]``: the
    chunks rank ``r`` holds, in the order it concatenates them (every rank holds as many)."""

    group: Optional[dist.ProcessGroup]
    rank: int
    bounds: Tuple[Tuple[int, int], ...]
    owned: Tuple[Tuple[int, ...], ...]

    @property
    def chunks(self) -> Tuple[int, ...]:
        return self.owned[self.rank]

    def positions(self, rank: Optional[int] = None) -> torch.Tensor:
        """The positions a rank holds, in its local order: its index map into every sequence."""
        owned = self.owned[self.rank if rank is None else rank]
        return torch.cat([torch.arange(*self.bounds[c]) for c in owned])


def split_sequence(length: int, ranks: int, rank: int, split: str,
                   group: Optional[dist.ProcessGroup] = None) -> SequenceShard:
    """``head-tail``: 2*ranks equal chunks, rank r gets chunks r and 2*ranks-1-r (head first), which
    balances causal attention's work; ``contiguous``: ranks slices (uneven when length does not
    divide)."""
    if split == "head-tail":
        if length % (2 * ranks) != 0:
            raise ValueError(f"split: head-tail needs the length {length} to be a multiple of 2 x {ranks} ranks")
        size = length // (2 * ranks)
        bounds = tuple((c * size, (c + 1) * size) for c in range(2 * ranks))
        owned = tuple((r, 2 * ranks - 1 - r) for r in range(ranks))
    elif split == "contiguous":
        sizes = [len(part) for part in torch.arange(length).tensor_split(ranks)]
        edges = [sum(sizes[:r]) for r in range(ranks + 1)]
        bounds = tuple(zip(edges[:-1], edges[1:]))
        owned = tuple((r,) for r in range(ranks))
    else:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return SequenceShard(group=group, rank=rank, bounds=bounds, owned=owned)


class _GatherTotals(torch.autograd.Function):
    """``[S, c, N, H]``: every context rank's chunk totals ``[c, N, H]``, in rank order.

    Backward: every rank uses all of the gathered totals, so the gradient of rank r's totals is the
    sum over ranks of their gradients for slice r: an all-reduce, then this rank's slice (what a
    reduce-scatter gives, with collectives every backend has, gloo included)."""

    @staticmethod
    def forward(ctx, totals, group):
        ctx.group = group
        parts = [torch.empty_like(totals) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, totals.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def running_mean(x: torch.Tensor, shard: Optional[SequenceShard]) -> torch.Tensor:
    """``y[:, t] = mean(x[:, :t+1])`` over the whole sequence, for this rank's positions of it.

    Each local chunk's cumulative sum plus the total of every chunk before it (on any rank),
    divided by the global position + 1: the exchange is one ``[S, c, N, H]`` all-gather of chunk
    totals, whatever the length."""
    if shard is None:
        return x.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)[:, None]
    sizes = [shard.bounds[c][1] - shard.bounds[c][0] for c in shard.chunks]
    pieces = x.split(sizes, dim=1)
    totals = torch.stack([p.sum(1) for p in pieces])  # [c, N, H]
    everyone = _GatherTotals.apply(totals, shard.group).flatten(0, 1)  # [S * c, N, H], rank-major
    order = torch.tensor([c for owned in shard.owned for c in owned], device=x.device)
    by_chunk = torch.empty_like(everyone).index_copy(0, order, everyone)  # sequence order
    # The total of the chunks before each (exclusive prefix sum over chunks in sequence order).
    before = torch.cat([torch.zeros_like(by_chunk[:1]), by_chunk[:-1].cumsum(0)])
    summed = torch.cat([p.cumsum(1) + before[c][:, None] for p, c in zip(pieces, shard.chunks)], dim=1)
    positions = shard.positions().to(device=x.device, dtype=x.dtype)
    return summed / (positions + 1)[:, None]


# ----------------------------------------------------------------------------- model


class TinyLM(nn.Module):
    """Embedding, a causal running mean, one MLP block; the lm_head (or its shard) is separate."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())

    def forward(self, input_ids, shard: Optional[SequenceShard] = None):
        x = running_mean(self.embed(input_ids), shard)
        return x + self.block(x)


class Policy(nn.Module):
    """Model plus loss in one forward (under FSDP2 the lm_head weight is unsharded only there)."""

    def __init__(self, lm_head_rows: slice, shard: Optional[SequenceShard] = None, **loss_options) -> None:
        super().__init__()
        torch.manual_seed(0)  # every rank (and the single-process check) starts from the same weights
        self.lm = TinyLM()
        self.lm_head = nn.Parameter(torch.randn(VOCAB, HIDDEN)[lm_head_rows].clone() * 0.02)
        self.shard = shard
        self.loss_options = loss_options

    def forward(self, input_ids, labels, scores, group_ids):
        return tpo_kernels.fused_linear_tpo_loss(self.lm(input_ids, self.shard), self.lm_head, labels, scores,
                                                 group_ids=group_ids, **self.loss_options)


def whole_batch(device):
    """Every rank builds the same batch: prompts' completions with random rewards, some tied.

    The label shift is done here, on whole sequences: ``labels[:, t] = tokens[:, t + 1]``, so that
    any later split of the positions keeps every (input, label) pair together."""
    gen = torch.Generator().manual_seed(1)
    n = GROUPS * K
    tokens = torch.randint(0, VOCAB, (n, LENGTH + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[torch.arange(LENGTH)[None, :] >= torch.randint(LENGTH // 2, LENGTH + 1, (n, 1), generator=gen)] = -100
    scores = torch.randint(0, 2, (n,), generator=gen).float()
    scores[:K] = 1.0  # group 0 ties: zero signal, no gradient
    group_ids = torch.arange(n) // K
    return [t.to(device) for t in (tokens[:, :-1], labels, scores, group_ids)]


def labels_shifted_after_split(input_ids, labels, positions):
    """The trap: each rank shifts its own shard (``labels = local_inputs[:, 1:]``). The last local
    position loses its label, and where the shard jumps (between head-tail chunks) the label is the
    first token of the next local chunk, not the next token of the sequence. (The padding mask is
    kept from the true labels.)"""
    local = input_ids[:, positions]
    shifted = torch.full_like(local, -100)
    shifted[:, :-1] = local[:, 1:]
    return shifted.masked_fill(labels[:, positions] < 0, -100)


# ----------------------------------------------------------------------------- training


def _mesh_groups(device, dp: int, cp: int, tp: int):
    """A (dp, cp, tp) mesh, plus the group DDP averages over: the dp x cp ranks of this rank's tp
    coordinate (one ``new_group`` per coordinate, created by every rank in the same order)."""
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    ranks = torch.arange(dp * cp * tp).view(dp, cp, tp)
    averaged = None
    for t in range(tp):
        group = dist.new_group(ranks[:, :, t].flatten().tolist())
        if t == mesh.get_local_rank("tp"):
            averaged = group
    return mesh, averaged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-parallel", type=int, default=1, help="ranks sharing the lm_head's vocabulary")
    parser.add_argument("--context-parallel", type=int, default=1, help="ranks sharing every sequence's positions")
    parser.add_argument("--split", choices=SPLITS, default="head-tail", help="how a sequence is cut over context ranks")
    parser.add_argument("--shift-after-split", action="store_true",
                        help="shift the labels inside each rank's shard (the trap: diverges from one process)")
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
    tp, cp = args.tensor_parallel, args.context_parallel
    if tp < 1 or cp < 1 or world % (tp * cp) != 0:
        raise SystemExit(f"--tensor-parallel {tp} x --context-parallel {cp} must divide the number of processes "
                         f"{world}")
    dp = world // (tp * cp)
    mesh, averaged_group = _mesh_groups(device, dp, cp, tp)
    dp_group, cp_group, tp_group = mesh.get_group("dp"), mesh.get_group("cp"), mesh.get_group("tp")
    dp_rank, cp_rank, tp_rank = (mesh.get_local_rank(name) for name in ("dp", "cp", "tp"))

    # This rank's lm_head rows: a contiguous vocabulary slice (V need not divide by tp).
    sizes = [len(part) for part in torch.arange(VOCAB).tensor_split(tp)]
    rows = slice(sum(sizes[:tp_rank]), sum(sizes[:tp_rank + 1]))
    # This rank's positions of every sequence (all of them without context parallelism).
    shard = split_sequence(LENGTH, cp, cp_rank, args.split, cp_group) if cp > 1 else None
    options = dict(process_group=dp_group, vocab_parallel_group=tp_group if tp > 1 else None)
    if cp > 1:
        options["context_parallel_group"] = cp_group
    policy = Policy(rows, shard, **options).to(device)
    if args.wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(policy, process_group=averaged_group)
    else:
        from torch.distributed.fsdp import fully_shard

        if tp > 1:
            raise SystemExit("this example wraps FSDP2 for data and context parallelism only (--tensor-parallel 1)")
        # Over (dp, cp): replicated over dp, sharded over cp; gradients averaged over both.
        wrap_mesh = mesh["dp"] if cp == 1 else mesh["dp", "cp"]
        fully_shard(policy.lm.block, mesh=wrap_mesh)
        model = fully_shard(policy, mesh=wrap_mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    input_ids, labels, scores, group_ids = whole_batch(device)
    mine = torch.arange(dp_rank, GROUPS * K, dp, device=device)  # round-robin: every group spans ranks
    positions = (shard.positions() if shard is not None else torch.arange(LENGTH)).to(device)
    local_inputs = input_ids[mine][:, positions]  # one index map for inputs and labels
    if args.shift_after_split:
        local_labels = labels_shifted_after_split(input_ids[mine], labels[mine], positions)
    else:
        local_labels = labels[mine][:, positions]
    if args.check:
        reference = Policy(slice(None)).to(device)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=1.0)

    for step in range(args.steps):
        with count_collectives() as log:
            loss = model(local_inputs, local_labels, scores[mine], group_ids[mine])
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
            check = (f" (one process: {ref_loss.item():.6f}, |loss - one process| "
                     f"{abs(loss.item() - ref_loss.item()):.1e})") if args.check else ""
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
            where = f", {args.split} split" + (", labels shifted after the split" if args.shift_after_split else "")
            print(f"mesh dp={dp} x cp={cp} x tp={tp}, {args.wrap}{where if cp > 1 else ''}: largest parameter "
                  f"difference from one-process training after {args.steps} steps: {worst_t.item():.2e}")
        if worst_t.item() > 1e-4:
            trap = (" (as expected: --shift-after-split gives wrong labels at shard boundaries)"
                    if args.shift_after_split else "")
            raise SystemExit(f"distributed training diverged from one-process training{trap}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
