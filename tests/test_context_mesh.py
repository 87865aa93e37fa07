"""Context parallelism on a mesh with the other two seams, gloo on CPU: 2 x 2 (data x context) and
2 x 2 (context x vocabulary) on one spawn of 4 ranks, 2 x 2 x 2 (data x context x vocabulary) on a
spawn of 8 at a tiny shape (N=4, T=8, V=37, H=16), bounded in time (its cases within seconds,
the spawn within DEADLINE_S).

Each case checks the loss, every aux entry and every gradient against one process on the whole
batch (tests/_context_cases.py: token rows divided by ``D * S``, weight and bias shards averaged
over data x context), float64 within ``1e-12``. The data x context call moves, in order, the
context agreement, the data agreement, the ``[N, C]`` partials, the gathered rows and group ids,
and nothing in the backward. A failure on the last global rank is raised by every rank, naming it
with its rank in the failing group beside it (the agreements run vocabulary -> context -> data,
each carrying the previous verdict).
"""

from __future__ import annotations

import functools
import time

import pytest

from _distributed import run_ranks
from test_context_parallel import F64_TOL, RAISE_WITHIN_S, RANK_TIMEOUT_S, check_failures, check_pairs

# The 8-process spawn: its cases within seconds; the spawn as a whole (8 interpreters importing
# torch, which dominates: 57-64 s measured on 2 cores at a load average of 15) within DEADLINE_S.
CASES_WITHIN_S = 10.0
DEADLINE_S = {4: 240, 8: 180}


def _cp(path, **kw):
    return ("context_case", dict(path=path, **kw))


LN_KL = dict(length_normalize=True)
CASES_4 = {4: {
    "dp2_cp2_fused": _cp("fused", dp=2, split="head_tail", kl=True, grouping="ids", options=LN_KL),
    "dp2_cp2_logits_one_rank_and_none": _cp("logits", dp=2, special="one_rank_and_none", old="token"),
    "cp2_vp2_fused": _cp("fused", tp=2, packed=True, kl=True, options=dict(LN_KL, entropy_coef=0.01)),
    "cp2_vp2_logits": _cp("logits", tp=2, split="head_tail", old="seq", options=LN_KL),
    "dp2_cp2_bytes": ("mesh_bytes_case", {}),
    "dp2_cp2_failures": ("mesh_failures_case", dict(dp=2, cp=2, tp=1)),
    "cp2_vp2_failures": ("mesh_failures_case", dict(dp=1, cp=2, tp=2)),
}}
CASES_8 = {8: {
    "mesh_2x2x2": _cp("fused", dp=2, tp=2, kl=True, grouping="ids", n_per_rank=2, options=LN_KL),
    "mesh_2x2x2_failures": ("mesh_failures_case", dict(dp=2, cp=2, tp=2)),
}}


@functools.lru_cache(maxsize=None)
def _results(world: int):
    from _context_cases import run_all

    cases = CASES_4 if world == 4 else CASES_8
    begin = time.monotonic()
    results = run_ranks(world, run_all, cases, deadline_s=DEADLINE_S[world], rank_timeout_s=RANK_TIMEOUT_S)
    return results, time.monotonic() - begin


def _case(world: int, name: str):
    per_rank = [ranks[world][name] for ranks in _results(world)[0]]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank} of {world}, case {name}:\n{result['error']}"
    return per_rank


EXACT_4 = [name for name, (fn, _) in CASES_4[4].items() if fn == "context_case"]


@pytest.mark.parametrize("name", EXACT_4)
def test_a_2x2_mesh_matches_one_process(name):
    per_rank = _case(4, name)
    check_pairs(per_rank, F64_TOL)
    if CASES_4[4][name][1].get("special"):
        assert any(r["zeros"] for r in per_rank)


def test_data_x_context_collectives():
    """Forward: context agreement, data agreement, the ``[4, 2]`` float64 partials (log-prob,
    count), the gathered ``[4, 4]`` rows (log-prob, score, kept, count) and the 4 group ids;
    backward: nothing."""
    for rank, result in enumerate(_case(4, "dp2_cp2_bytes")):
        purposes = [r[:2] for r in result["forward"]]
        assert purposes == [("all_gather", "agreement"), ("all_gather", "agreement"),
                            ("all_reduce", "context_partials"), ("all_gather", "rows"),
                            ("all_gather", "group_ids")], (rank, result["forward"])
        sizes = [r[2] for r in result["forward"][2:]]
        assert sizes == [4 * 2 * 8, 4 * 4 * 8, 4 * 8], (rank, sizes)
        assert result["backward"] == []


# Global rank 3 is rank 1 of both of its groups on a 2 x 2 mesh; rank 7 on the 2 x 2 x 2 one.
DP_CP_FAILURES = {
    "backend_unusable": (RuntimeError, "context_parallel_group: rank 3 (rank 1 of context_parallel_group) failed "
                                       "its input checks; rank 3 (rank 1 of context_parallel_group): backend 'cuda'"),
    "eta": (ValueError, "context_parallel_group: ranks disagree on eta"),
}
CP_VP_FAILURES = {
    "backend_unusable": (RuntimeError, "vocab_parallel_group: rank 3 (rank 1 of vocab_parallel_group) failed "
                                       "its input checks; rank 3 (rank 1 of vocab_parallel_group): backend 'cuda'"),
    "eta": (ValueError, "vocab_parallel_group: ranks disagree on eta"),
}
MESH_8_FAILURES = {
    "backend_unusable": (RuntimeError, "vocab_parallel_group: rank 7 (rank 1 of vocab_parallel_group) failed "
                                       "its input checks; rank 7 (rank 1 of vocab_parallel_group): backend 'cuda'"),
    "eta": (ValueError, "vocab_parallel_group: ranks disagree on eta"),
}


@pytest.mark.parametrize("name,expected", [("dp2_cp2_failures", DP_CP_FAILURES), ("cp2_vp2_failures", CP_VP_FAILURES)],
                         ids=["data_x_context", "context_x_vocabulary"])
def test_a_failure_on_the_last_rank_of_a_2x2_mesh_is_raised_by_every_rank(name, expected):
    per_rank = _case(4, name)
    check_failures(per_rank, expected, last=3)
    assert all(r["outcomes"]["none_fails"] is None for r in per_rank)  # the same call without the fault runs


def test_a_2x2x2_mesh_matches_one_process_in_bounded_time():
    per_rank = _case(8, "mesh_2x2x2")
    check_pairs(per_rank, F64_TOL)
    slowest = max(r["seconds"] for r in per_rank)
    assert slowest < CASES_WITHIN_S, f"the 2 x 2 x 2 case took {slowest:.1f} s on a rank"
    print(f"\n8-process spawn: {_results(8)[1]:.0f} s, the case {slowest:.2f} s")


def test_a_failure_on_rank_7_of_a_2x2x2_mesh_is_raised_by_all_8():
    per_rank = _case(8, "mesh_2x2x2_failures")
    check_failures(per_rank, MESH_8_FAILURES, last=7)
    assert all(r["outcomes"]["none_fails"] is None for r in per_rank)
    assert RAISE_WITHIN_S < RANK_TIMEOUT_S  # a stranded rank would show as a slow, different error
