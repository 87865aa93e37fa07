"""Completions split over context-parallel ranks (``context_parallel_group=``), gloo on CPU: 2 and
4 spawned local ranks (the 2-rank cases on a subgroup of one spawn of 4).

Every case compares a context-parallel run with one process on the whole completions (computed on
each rank, see tests/_context_cases.py): the loss, every aux entry (per-completion and per-group
ones of the whole batch, per-token ones at this rank's positions) and every gradient (this rank's
rows of logits, hidden states or log-probs, divided by ``S``; weight and bias averaged over the
ranks), for contiguous, head-tail and random position splits, padded and packed (per-rank
``cu_seqlens``), with the KL term, the entropy bonus, length normalization, per-token and
per-completion old log-probs, each reduction, a completion whose counted tokens all sit on one
rank and one with none. Tolerances: float64 ``1e-12``; float32 the data-parallel tests' ``FP32_TOL``
(the group stage runs in float64 either way; fp32 rounds the row op and the returned values).
The loss is bitwise the same on every rank. A byte-counting case checks that the context group
moves its agreement record and ``[N, C]`` float64 partials, whatever T and V; a failure on one
rank is raised by every rank, fast. Meshes: tests/test_context_mesh.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from _distributed import run_ranks

F64_TOL = dict(atol=1e-12, rtol=1e-12)
FP32_TOL = dict(atol=5e-5, rtol=2e-4)
RANK_TIMEOUT_S = 30  # the process group's timeout: how long a stranded rank would wait
RAISE_WITHIN_S = 10.0  # every rank of a failing call raises well before that
DEADLINE_S = 300


def _cp(path, **kw):
    return ("context_case", dict(path=path, **kw))


KL_ENTROPY_LN = dict(entropy_coef=0.01, length_normalize=True, return_entropy=True)
CASES = {
    2: {
        "cp2_logits_head_tail_f64": _cp("logits", split="head_tail", kl=True, old="token", options=KL_ENTROPY_LN),
        "cp2_fused_contiguous_packed": _cp("fused", packed=True, backend="cpu", dtype="float32", old="token"),
        "cp2_logprobs_random_packed": _cp("logprobs", split="random", packed=True, old="seq", grouping="ids",
                                          options=dict(reduction="none")),
        "cp2_one_rank_and_none": _cp("logits", kl=True, special="one_rank_and_none",
                                     options=dict(length_normalize=True)),
        "cp2_zero_signal": _cp("fused", split="head_tail", special="zero_signal"),
        "cp2_sum_kl_entropy": _cp("fused", kl=True, options=dict(reduction="sum", entropy_coef=0.02)),
        # Per-completion log-weights (one -inf) replicated over the context ranks, never summed.
        "cp2_seq_log_weights": _cp("logits", split="random", old="token", weights=True,
                                   options=dict(length_normalize=True)),
        "cp2_seq_log_weights_fused_unchecked": _cp("fused", packed=True, weights=True, grouping="ids",
                                                   options=dict(validate=False)),
        # Kept sets (sampling_mask), per token like the labels: each rank passes its positions' sets.
        "cp2_sampling_mask": _cp("logits", split="head_tail", kl=True, old="token", kept=True, options=KL_ENTROPY_LN),
        "cp2_sampling_mask_fused_packed": _cp("fused", packed=True, backend="cpu", dtype="float32", kept=True,
                                              options=dict(entropy_coef=0.02)),
        "cp2_none_kl_entropy": _cp("logits", split="random", kl=True, grouping="ids",
                                   options=dict(reduction="none", entropy_coef=0.02)),
        "bytes": ("bytes_case", {}),
        "failures": ("failures_case", {}),
    },
    4: {
        "cp4_head_tail_packed": _cp("fused", split="head_tail", packed=True, dtype="float32", kl=True,
                                    options=dict(length_normalize=True)),
        "cp4_contiguous_f64": _cp("logits", old="seq", kl=True, options=dict(entropy_coef=0.01)),
        "bytes": ("bytes_case", {}),
        "failures": ("failures_case", {}),
    },
}


@functools.lru_cache(maxsize=None)
def _results():
    from _context_cases import run_all

    return run_ranks(max(CASES), run_all, CASES, deadline_s=DEADLINE_S, rank_timeout_s=RANK_TIMEOUT_S)


def _case(world: int, name: str):
    per_rank = [ranks[world][name] for ranks in _results()[:world]]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank} of {world}, case {name}:\n{result['error']}"
    return per_rank


def check_pairs(per_rank, tol):
    for rank, result in enumerate(per_rank):
        for what, (got, want) in result["pairs"].items():
            torch.testing.assert_close(got, want, **tol, msg=lambda m, r=rank, w=what: f"rank {r}, {w}: {m}")
        for what, ok in result["zeros"].items():
            assert ok, f"rank {rank}: {what}"
    losses = [r["pairs"]["loss"][0] for r in per_rank]  # the same reduced sums on every rank
    assert all(torch.equal(loss, losses[0]) for loss in losses), losses


def tolerance(kwargs: dict) -> dict:
    return FP32_TOL if kwargs.get("dtype") == "float32" else F64_TOL


EXACTNESS = [(w, n) for w, cases in CASES.items() for n, (fn, _) in cases.items() if fn == "context_case"]


@pytest.mark.parametrize("world,name", EXACTNESS, ids=[f"{w}ranks-{n}" for w, n in EXACTNESS])
def test_matches_one_process(world, name):
    per_rank = _case(world, name)
    check_pairs(per_rank, tolerance(CASES[world][name][1]))
    if CASES[world][name][1].get("special"):  # the special checks ran
        assert any(r["zeros"] for r in per_rank)


@pytest.mark.parametrize("world", [2, 4])
def test_the_context_group_moves_the_partials_and_the_record(world):
    """Per call: the agreement record (all-gathered) and one all-reduce of ``[N, C]`` float64
    partials, N = 4: C = 2 (log-prob, count), 3 with per-token old log-probs, 5 with the KL term
    and the entropy bonus; the same for T = 64 and 4096, V = 37 and 101; nothing in the
    backward."""
    n = 4
    for rank, stats in enumerate(_case(world, "bytes")):
        record = stats["T64_V37_plain"]["forward"][0][2]
        assert record <= 1024, record
        for name, columns in (("plain", 2), ("old", 3), ("old_kl_entropy", 5)):
            want = [("all_gather", "agreement", record, world * record),
                    ("all_reduce", "context_partials", 8 * n * columns, 8 * n * columns)]
            assert stats[f"T64_V37_{name}"]["forward"] == want, (rank, name, stats[f"T64_V37_{name}"])
            assert stats[f"T64_V37_{name}"]["backward"] == []
        for shape in ("T4096_V37", "T64_V101"):
            assert stats[f"{shape}_old_kl_entropy"] == stats["T64_V37_old_kl_entropy"], shape


# Scenario -> (error type, what every rank's error says); the last context rank fails or differs.
FAILURES = {
    "label_out_of_range": (ValueError, "context_parallel_group: rank {last} failed its input checks; "
                                       "rank {last}: labels must"),
    "nan_score": (ValueError, "rank {last}: scores must be finite"),
    "scores_differ": (ValueError, "context_parallel_group: scores differs on rank {last} from rank 0"),
    "group_ids_differ": (ValueError, "context_parallel_group: group_ids differs on rank {last} from rank 0"),
    "completions_differ": (ValueError, "context_parallel_group: ranks disagree on completions"),
    "old_per_token_vs_per_completion": (ValueError, "context_parallel_group: ranks disagree on old_logprobs"),
    "seq_log_weights_differ": (ValueError, "context_parallel_group: seq_log_weights differs on rank {last} from rank 0"),
    "seq_log_weights_on_one_rank": (ValueError, "context_parallel_group: ranks disagree on seq_log_weights"),
    "sampling_mask_on_one_rank": (ValueError, "context_parallel_group: ranks disagree on sampling_mask"),
    "all_masked_everywhere": (ValueError, "no completion has a counted token on any rank of context_parallel_group"),
    "backend_unusable": (RuntimeError, "context_parallel_group: rank {last} failed its input checks; rank {last}: "
                                       "backend 'cuda' is not usable here"),
    "same_group_as_process_group": (ValueError, "context_parallel_group and process_group hold the same ranks"),
    "same_group_as_vocab_group": (ValueError, "context_parallel_group and vocab_parallel_group hold the same ranks"),
}


def check_failures(per_rank, expected: dict, last: int):
    for name, (kind, words) in expected.items():
        outcomes = [r["outcomes"][name] for r in per_rank]
        assert all(o is not None for o in outcomes), (name, outcomes)
        assert len({o[:2] for o in outcomes}) == 1, (name, outcomes)  # the same type and words everywhere
        got_kind, message, _ = outcomes[0]
        assert got_kind == kind.__name__ and words.format(last=last) in message, (name, outcomes[0])
        slowest = max(o[2] for o in outcomes)
        assert slowest < RAISE_WITHIN_S, f"{name}: a rank raised after {slowest:.1f} s"


@pytest.mark.parametrize("world", [2, 4])
def test_a_failure_on_one_rank_is_raised_by_every_rank(world):
    check_failures(_case(world, "failures"), FAILURES, last=world - 1)
