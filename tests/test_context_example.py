"""The context-parallel training example (bench/examples/distributed_training.py): how it cuts a
sequence over context ranks, why it shifts the labels before the cut, its context-parallel running
mean (gradients summed over the context ranks equal one process's), and the example itself under
torchrun, checked against one-process training step by step."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from _distributed import loopback_env, run_ranks
from bench.examples import distributed_training as example

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("split, length, ranks, expected", [
    ("head-tail", 8, 2, [[0, 1, 6, 7], [2, 3, 4, 5]]),  # torch's context_parallel load balancer
    ("head-tail", 16, 4, [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]),
    ("contiguous", 7, 3, [[0, 1, 2], [3, 4], [5, 6]]),  # uneven, as tensor_split
])
def test_split_gives_each_rank_its_positions(split, length, ranks, expected):
    """Every position sits on exactly one rank; head-tail pairs chunk r with chunk 2S-1-r."""
    got = [example.split_sequence(length, ranks, r, split).positions().tolist() for r in range(ranks)]
    assert got == expected


def test_head_tail_split_needs_a_length_multiple_of_twice_the_ranks():
    with pytest.raises(ValueError, match="head-tail needs the length 12 to be a multiple of 2 x 4 ranks"):
        example.split_sequence(12, 4, 0, "head-tail")


@pytest.mark.parametrize("split", example.SPLITS)
def test_labels_shifted_before_the_split_keep_every_pair(split):
    """Shift the whole sequence, then cut inputs and labels with one index map: every rank's
    (input, label) pairs are the one-process pairs. Shifting each rank's shard instead (the trap)
    drops the label of every shard's last position and, where a head-tail shard jumps between its
    chunks, pairs a position with the wrong next token."""
    input_ids, labels, _, _ = example.whole_batch("cpu")
    length, ranks = input_ids.shape[1], 2
    for rank in range(ranks):
        positions = example.split_sequence(length, ranks, rank, split).positions()
        inner = positions < length - 1  # the recipe: the label of position p is token p + 1
        counted = labels[:, positions][:, inner] >= 0
        assert torch.equal(labels[:, positions][:, inner][counted], input_ids[:, positions[inner] + 1][counted])
        trapped = example.labels_shifted_after_split(input_ids, labels, positions)
        wrong = (trapped != labels[:, positions]).any(0).nonzero().squeeze(1).tolist()
        jumps = [j for j in range(len(positions) - 1) if positions[j + 1] != positions[j] + 1]
        last = len(positions) - 1
        # Wrong wherever the next local position is not the next sequence position, and at the
        # shard's end unless that is the sequence's end (whose label is padding anyway here).
        assert set(jumps) <= set(wrong) and set(wrong) <= set(jumps) | {last}, (rank, wrong, jumps)
        if rank == 0:  # its shard ends mid-sequence, and under head-tail jumps from chunk 0 to 3
            assert last in wrong and bool(jumps) == (split == "head-tail"), (wrong, jumps)


def _running_mean_grads(rank: int, world: int, splits: tuple) -> dict:
    """For each split: one process's outputs and parameter gradients of a weighted sum of the
    model's outputs, and this context rank's (outputs at its positions, gradients of its
    positions' terms summed over the ranks)."""
    return {split: _running_mean_grads_of(rank, world, split) for split in splits}


def _running_mean_grads_of(rank: int, world: int, split: str) -> dict:
    import torch.distributed as dist  # noqa: PLC0415

    torch.manual_seed(0)
    model = example.TinyLM().double()
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, example.VOCAB, (3, 16), generator=gen)
    weights = torch.randn(3, 16, example.HIDDEN, generator=gen, dtype=torch.float64)

    whole = model(input_ids)
    (whole * weights).sum().backward()
    one_process = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    shard = example.split_sequence(16, world, rank, split, dist.group.WORLD)
    positions = shard.positions()
    local = model(input_ids[:, positions], shard)
    (local * weights[:, positions]).sum().backward()
    summed = {}
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)  # over the context ranks: each rank's terms are a part of the one sum
        summed[name] = grad
    return dict(outputs=(local.detach(), whole.detach()[:, positions]),
                grads={name: (summed[name], one_process[name]) for name in summed})


@pytest.mark.parametrize("world, splits", [(2, example.SPLITS), (4, ("head-tail",))],
                         ids=["2 ranks, both splits", "4 ranks, head-tail"])
def test_running_mean_gradients_summed_over_context_ranks_equal_one_process(world, splits):
    """The context-parallel running mean (chunk totals exchanged by an all-gather whose backward
    all-reduces) gives every rank one process's outputs at its positions, and gradients that cross
    the shard boundaries: summed over the ranks they are one process's (float64)."""
    for rank, by_split in enumerate(run_ranks(world, _running_mean_grads, splits, deadline_s=120)):
        for split, result in by_split.items():
            where = f"{split}, rank {rank} of {world}"
            torch.testing.assert_close(*result["outputs"], rtol=1e-12, atol=1e-12, msg=f"outputs, {where}")
            for name, (summed, expected) in result["grads"].items():
                torch.testing.assert_close(summed, expected, rtol=1e-12, atol=1e-12, msg=f"{name}, {where}")


@pytest.mark.parametrize("processes, options", [
    (2, ["--context-parallel", "2"]),
    (2, ["--context-parallel", "2", "--split", "contiguous", "--wrap", "fsdp2"]),
    (4, ["--context-parallel", "2"]),  # data x context: DDP averages over 4 ranks, tokens get 4x
], ids=lambda x: " ".join(x) if isinstance(x, list) else f"{x} processes")
def test_torchrun_example_matches_one_process(processes, options):
    """``torchrun --nproc-per-node 2 -m bench.examples.distributed_training --context-parallel 2``
    (two steps) trains as one process does: |loss - one process| printed per step, parameters
    within 1e-4 at the end."""
    env = dict(os.environ, **loopback_env(), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               "-m", "bench.examples.distributed_training", *options, "--steps", "2"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "cp=2" in done.stdout and "largest parameter difference from one-process training" in done.stdout
    assert done.stdout.count("|loss - one process|") == 2, done.stdout
