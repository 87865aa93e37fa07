"""Multi-process tests of tpo_kernels.distributed on CPU: gloo, 2, 3 and 4 spawned local ranks.

Every case compares a distributed run with the single-process result on the whole batch / whole
vocabulary (computed on each rank, see tests/_distributed_cases.py): the loss and every gradient
(hidden or logits rows, weight and bias or their shards) within fp32 tolerance, for groups split
over data-parallel ranks (a group spread over every rank, ranks with different N, contiguous
``group_size`` groups straddling ranks, packed and padded, old log-probs, the KL term, each
reduction), a vocabulary split over ranks (V % P != 0, shards in rank order or placed by
``vocab_start_index``, logits or fused head, with entropy), DTensor shards, the 2-D (data x
tensor) mesh, DDP and FSDP2 training of a tiny causal LM. Zero-signal groups stay exactly zero.
A byte-counting case checks what each collective moves. Failures on one rank:
tests/test_distributed_failures.py.

One spawn of 4 ranks runs every case (process start-up dominates the time): the 2- and 3-rank
cases run on subgroups of it.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from _distributed import loopback_env, run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]

FP32_TOL = dict(atol=5e-5, rtol=2e-4)
TRAIN_TOL = dict(atol=1e-4, rtol=1e-3)


def _dp(path, sizes, grouping, **kw):
    return ("dp_case", dict(path=path, sizes=sizes, grouping=grouping, **kw))


CASES = {
    2: {
        "dp_logits_ids_torch": _dp("logits", [5, 7], "ids"),
        "dp_logits_size_packed_cpu_old": _dp("logits", [5, 7], "size", backend="cpu", packed=True, old="token"),
        "dp_logits_sum_kl": _dp("logits", [6, 4], "ids", reduction="sum", kl=True),
        "dp_fused_ids_cpu": _dp("fused", [4, 7], "ids", backend="cpu"),
        "dp_fused_size_torch": _dp("fused", [5, 7], "size"),
        "dp_fused_size_old_kl": _dp("fused", [7, 5], "size", old="token", kl=True, backend="cpu"),
        "dp_fused_none_seqold_kl": _dp("fused", [5, 6], "ids", reduction="none", old="seq", kl=True),
        "dp_fused_packed_ids": _dp("fused", [6, 3], "ids", packed=True, backend="cpu"),
        "vp_logprobs_logits": ("vp_logprobs_case", dict(path="logits")),
        "vp_logprobs_logits_packed_cpu": ("vp_logprobs_case", dict(path="logits", packed=True, backend="cpu")),
        "vp_logprobs_fused_cpu": ("vp_logprobs_case", dict(path="fused", backend="cpu")),
        "vp_logprobs_fused_start_index": ("vp_logprobs_case", dict(path="fused", rotate=True)),
        "vp_loss_logits_cpu_old_kl": ("vp_loss_case", dict(path="logits", backend="cpu", old="token", kl=True)),
        "vp_loss_logits_zero": ("vp_loss_case", dict(path="logits")),
        "vp_loss_fused_zero": ("vp_loss_case", dict(path="fused", backend="cpu")),
        "vp_loss_fused_old_kl": ("vp_loss_case", dict(path="fused", old="seq", kl=True, grouping="size")),
        "dtensor_fused": ("dtensor_case", dict(path="fused")),
        "dtensor_logits": ("dtensor_case", dict(path="logits", backend="cpu")),
        "bytes": ("bytes_case", {}),
        "train_ddp": ("train_case", dict(wrapper="ddp")),
        "train_fsdp2": ("train_case", dict(wrapper="fsdp2")),
        "dp_fused_entropy_aux": _dp("fused", [5, 7], "size", entropy=True, backend="cpu"),
        "dp_logits_entropy_ids": _dp("logits", [4, 6], "ids", entropy=True, kl=True),
        "dp_fused_empty_rank": _dp("fused", [0, 8], "size"),
        "dp_logits_masked_rank": _dp("logits", [4, 4], "size", masked_rank=0),
        "dp_numpy_group_size": ("dp_numpy_group_size_case", {}),
        "dp_fused_near_tie_length_normalized": _dp("fused", [5, 7], "size", old="token", backend="cpu",
                                                   options=dict(score_eps=1.5, length_normalize=True)),
        "token_dp_logits": ("token_dp_case", dict(states=[3, 5])),
        "token_dp_fused_old_sum": ("token_dp_case", dict(states=[4, 2], fused=True, reduction="sum", old=True)),
        "token_dp_empty_rank": ("token_dp_case", dict(states=[0, 4], backend="cpu")),
    },
    3: {
        "dp_logits_ids_cpu": _dp("logits", [3, 5, 4], "ids", backend="cpu"),
        "dp_fused_ids_old_kl": _dp("fused", [4, 2, 5], "ids", old="token", kl=True),
        "dp_fused_size_straddling": _dp("fused", [3, 6, 3], "size", backend="cpu"),
        "dp_fused_size_one_group": _dp("fused", [2, 3, 1], "size", group_size=6, tie=False),
        "dp_logits_ids_near_tie_length_normalized": _dp("logits", [3, 5, 4], "ids",
                                                        options=dict(score_eps=1.5, length_normalize=True)),
        "vp_logprobs_logits_start_index": ("vp_logprobs_case", dict(path="logits", rotate=True, backend="cpu")),
        "vp_logprobs_fused": ("vp_logprobs_case", dict(path="fused")),
        "vp_loss_fused_cpu_old_kl": ("vp_loss_case", dict(path="fused", backend="cpu", old="token", kl=True)),
        "vp_loss_logits_zero": ("vp_loss_case", dict(path="logits", rotate=True)),
        "dtensor_fused": ("dtensor_case", dict(path="fused", backend="cpu")),
        "bytes": ("bytes_case", {}),
        "dp_fused_empty_middle_rank": _dp("fused", [4, 0, 4], "size", entropy=True),
        "token_dp_fused": ("token_dp_case", dict(states=[2, 3, 1], fused=True)),
    },
    4: {
        "two_d": ("two_d_case", {}),
        "two_d_dtensor_cpu": ("two_d_case", dict(dtensor=True, backend="cpu")),
    },
}


@functools.lru_cache(maxsize=None)
def _results():
    """Every case of every world size, from one spawn of max(CASES) ranks."""
    from _distributed_cases import run_all

    return run_ranks(max(CASES), run_all, CASES)


def _case(world: int, name: str):
    per_rank = [ranks[world][name] for ranks in _results()[:world]]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank} of {world}, case {name}:\n{result['error']}"
    return per_rank


def _check_pairs(per_rank, tol=FP32_TOL):
    for rank, result in enumerate(per_rank):
        for what, (got, want) in result["pairs"].items():
            torch.testing.assert_close(got, want, **tol, msg=lambda m, r=rank, w=what: f"rank {r}, {w}: {m}")
        for what, ok in result["zeros"].items():
            assert ok, f"rank {rank}: {what}"
    # The loss (every rank's is the whole batch's) and per-token results are bitwise the same
    # on every rank: they come from the same gathered data through the same computation.
    for what in ("loss", "logprobs", "entropy"):
        if what in per_rank[0]["pairs"]:
            values = [r["pairs"][what][0] for r in per_rank]
            assert all(torch.equal(v, values[0]) for v in values), f"{what} differs between ranks"


CORRECTNESS = [(w, n) for w, cases in CASES.items() for n in cases
               if n != "bytes" and not n.startswith("train")]


@pytest.mark.parametrize("world,name", CORRECTNESS, ids=[f"{w}ranks-{n}" for w, n in CORRECTNESS])
def test_matches_single_process(world, name):
    per_rank = _case(world, name)
    _check_pairs(per_rank)
    if any(k.startswith("tied_") for r in per_rank for k in r["zeros"]):  # the zero checks saw tied tokens
        assert sum(r.get("tied_tokens", 0) for r in per_rank) > 0


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_training_matches_single_process(wrapper):
    """A tiny causal LM under DDP / FSDP2 (fully_shard), 2 gloo ranks, two SGD steps with
    fused_linear_tpo_loss(process_group=...): losses, first-step gradients of every parameter
    (after the wrapper's averaging) and the final parameters equal single-process training on
    the whole batch."""
    per_rank = _case(2, f"train_{wrapper}")
    _check_pairs(per_rank, TRAIN_TOL)
    names = per_rank[0]["pairs"]
    assert {"grad_lm.lm_head.weight", "grad_lm.embed.weight", "grad_lm.block.0.weight"} <= set(names)


@pytest.mark.parametrize("world", [2, 3])
def test_collective_bytes(world):
    """Groups split over ranks move O(N): the call's agreement record, [max N_r, C] float64 rows,
    max N_r int64 group ids, the same for any T, V, H, and nothing in the backward. A vocabulary
    split over ranks moves O(M): the agreement record, [4, M] fp32 partials (row max, log-sum,
    label log-prob, owner flag; 5 rows with entropy) and, in the backward, the [M, H] dH
    all-reduce; nothing depends on V."""
    for rank, result in enumerate(_case(world, "bytes")):
        stats = result["bytes"]
        dp_small, dp_large = stats["dp_small"], stats["dp_large"]
        n = dp_small["max_n"]
        columns = 6  # ell, score, kept, old sequence log-prob, k3 sum, counted tokens
        record = dp_small["forward"][0][2]
        expected = [("all_gather", "agreement", record, world * record),
                    ("all_gather", "rows", n * columns * 8, world * n * columns * 8),
                    ("all_gather", "group_ids", n * 8, world * n * 8)]
        assert record <= 1024, record
        assert dp_small["forward"] == expected, (rank, dp_small["forward"])
        assert dp_large["forward"] == expected, "item 1 must not depend on T, V or H"
        assert dp_small["backward"] == [] and dp_large["backward"] == []
        for name in ("vp_small", "vp_large"):
            vp = stats[name]
            m, h = vp["tokens"], vp["hidden"]
            record = vp["forward"][0][2]
            assert record <= 1024, record
            assert vp["forward"] == [("all_gather", "agreement", record, world * record),
                                     ("all_gather", "partials", 4 * m * 4, world * 4 * m * 4)], vp["forward"]
            assert vp["backward"] == [("all_reduce", "hidden_grad", m * h * 4)], vp["backward"]
            assert vp["entropy"] == [("all_gather", "agreement", record), ("all_gather", "partials", 5 * m * 4)]
        if rank == 0:
            print(f"\n{world} ranks, bytes per rank: " + "; ".join(
                f"{k}: fwd {[r[1:3] for r in v['forward']]} bwd {[r[1:] for r in v['backward']]}"
                for k, v in stats.items()))


def _example_commands():
    """The ``torchrun ... -m bench.examples.distributed_training`` lines of the README's
    bash blocks."""
    commands = []
    for name in ("README.md",):
        path = ROOT / name
        if path.exists():
            for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
                commands += [line.split() for line in block.splitlines()
                             if "bench.examples.distributed_training" in line]
    return commands or [["torchrun", "(no example command found in the docs)"]]


@pytest.mark.parametrize("command", _example_commands(), ids=lambda c: " ".join(c[6:]) or "default")
def test_torchrun_example(command):
    """The documented example commands run as written under torchrun (2 CPU processes, two
    steps instead of three) and match one-process training."""
    assert command[0] == "torchrun" and "bench.examples.distributed_training" in command, command
    env = dict(os.environ, **loopback_env(), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", *command[1:], "--steps", "2"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "largest parameter difference from one-process training" in done.stdout, done.stdout


def test_keywords_without_an_initialized_group():
    """In one process: the distributed keywords name what is missing."""
    hidden, weight = torch.randn(4, 3, 8), torch.randn(11, 8)
    labels, scores = torch.randint(0, 11, (4, 3)), torch.randn(4)
    import tpo_kernels

    not_initialized = "torch.distributed is not initialized: init_process_group"
    with pytest.raises(TypeError, match=f"process_group must be a torch.distributed ProcessGroup.*{not_initialized}"):
        tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores, group_size=2, process_group=object())
    with pytest.raises(TypeError, match=f"vocab_parallel_group must be a .*ProcessGroup.*{not_initialized}"):
        tpo_kernels.fused_linear_logprobs(hidden, weight, labels, vocab_parallel_group=object())
    with pytest.raises(ValueError, match="vocab_start_index needs vocab_parallel_group"):
        tpo_kernels.selective_logprobs(torch.randn(4, 3, 11), labels, vocab_start_index=0)
