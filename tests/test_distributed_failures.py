"""A call that fails on one rank fails on every rank, at once, with the same error.

Whatever a rank raises before the ranks exchange their check results (an argument check, the
backend's resolution, a placement or shard check, a cache budget) travels in that exchange, and
every rank raises the same error (type and words) naming the argument and the failing global
rank, with its group rank beside it on a 2-D mesh. Ranks that disagree on a setting raise the
same error too. Spawned gloo ranks (2 and 3 on subgroups of one spawn of 4; the 2-D mesh on all
4) with a short process-group timeout: a rank left waiting for a peer would raise a different
error after ``RANK_TIMEOUT_S``, later than ``RAISE_WITHIN_S``, and fail the test, never hang it.
"""

from __future__ import annotations

import functools

import pytest

from _distributed import run_ranks

RANK_TIMEOUT_S = 20  # the process group's timeout: how long a stranded rank would wait
RAISE_WITHIN_S = 10.0  # every rank raises well before that
DEADLINE_S = 300  # the whole spawn (start-up of 4 processes on a shared 2-core machine included)

CASES = {2: {"failures": ("failures_case", {})}, 3: {"failures": ("failures_case", {})},
         4: {"two_d_failures": ("two_d_failures_case", {})}}

# Scenario -> (error type, what every rank's error says). Each fails on the last rank only (or
# disagrees there), or is inconsistent across ranks; the other ranks must raise the same error.
FAILURES = {
    "label_out_of_range": (ValueError, "process_group: rank {last} failed its input checks; rank {last}: labels must"),
    "nan_score": (ValueError, "rank {last}: scores must be finite"),
    "no_counted_token_anywhere": (ValueError, "no completion on any rank of process_group has a counted token"),
    "compute_dtype": (ValueError, "ranks disagree on compute dtype"),
    "return_entropy": (ValueError, "ranks disagree on return_entropy"),
    "eta": (ValueError, "ranks disagree on eta"),
    "reduction": (ValueError, "ranks disagree on reduction"),
    "score_eps": (ValueError, "ranks disagree on score_eps"),
    "length_normalize": (ValueError, "ranks disagree on length_normalize"),
    "entropy_coef": (ValueError, "ranks disagree on entropy_coef"),
    "old_on_one_rank": (ValueError, "ranks disagree on old_logprobs"),
    "bad_type_on_one_rank": (TypeError, "rank {last}: group_size must be an int"),
    "token_level_nan": (ValueError, "rank {last}: scores must be finite"),
    "backend_unusable": (RuntimeError, "process_group: rank {last} failed its input checks; rank {last}: "
                                       "backend 'cuda' is not usable here"),
    "token_level_backend_unusable": (RuntimeError, "rank {last}: backend 'cuda' is not usable here"),
    "start_without_vocab_group": (ValueError, "process_group: rank {last} failed its input checks; rank {last}: "
                                              "vocab_start_index needs vocab_parallel_group"),
    "cache_budget_too_large": (ValueError, "rank {last}: logits_cache_bytes must be an int in [0, 2**63)"),
    "cache_budget_not_an_int": (TypeError, "rank {last}: logits_cache_bytes must be an int"),
    "chunk_size_beyond_int64": (ValueError, "process_group: rank {last} failed its input checks; rank {last}: "
                                            "chunk_size must be an int in [1, 2**63)"),
    "group_size_beyond_int64": (ValueError, "rank {last}: group_size must be an int in [1, 2**63)"),
    "ignore_index_beyond_int64": (ValueError, "rank {last}: ignore_index must be an int in [-2**63, 2**63)"),
    "eta_beyond_a_float": (ValueError, "rank {last}: eta must be a finite number > 0, got an int of about 10**400"),
    "beta_overflowing_the_loss": (ValueError, "rank {last}: beta must be a finite number >= 0 and at most"),
    "temperature_as_a_tensor": (TypeError, "rank {last}: temperature must be a number"),
    "positive_logprobs": (ValueError, "rank {last}: logprobs must be log-probabilities (<= 0)"),
    "vp_label_out_of_range": (ValueError, "labels must hold ids in [0, 37)"),
    "vp_labels_differ": (ValueError, "vocab_parallel_group: labels differs on rank {last} from rank 0"),
    "vp_tokens_differ": (ValueError, "vocab_parallel_group: ranks disagree on tokens"),
    "vp_dtype": (ValueError, "vocab_parallel_group: ranks disagree on compute dtype"),
    "vp_softcap": (ValueError, "logit_softcap is not supported with a vocabulary-parallel"),
    "overlapping_shards": (ValueError, "must tile"),
    "vp_negative_start": (ValueError, "vocab_parallel_group: rank {last} failed its input checks; rank {last}: "
                                      "vocab_start_index must be an int in [0, 2**63)"),
    "vp_start_beyond_int64": (ValueError, "vocab_parallel_group: rank {last} failed its input checks; rank {last}: "
                                          "vocab_start_index must be an int in [0, 2**63)"),
    "vp_empty_shard": (ValueError, "rank {last}: weight must hold at least one vocabulary entry"),
    "vp_weight_none": (TypeError, "rank {last}: weight must be a torch.Tensor"),
    "vp_backend_unusable": (RuntimeError, "vocab_parallel_group: rank {last} failed its input checks; "
                                          "rank {last}: backend 'cuda' is not usable here"),
    "same_group_for_both": (ValueError, "the vocabulary is sharded over the ranks of process_group"),
    "group_size_total": (ValueError, "group_size must divide the number of completions over all ranks"),
    "start_without_group": (ValueError, "vocab_start_index needs vocab_parallel_group"),
}

# On the 2 x 2 mesh (dp groups {0, 2}, {1, 3}; tp groups {0, 1}, {2, 3}) global rank 3 is rank 1
# of both of its groups.
TWO_D_FAILURES = {
    "backend_unusable": (RuntimeError, "vocab_parallel_group: rank 3 (rank 1 of vocab_parallel_group) failed its "
                                       "input checks; rank 3 (rank 1 of vocab_parallel_group): backend 'cuda' is "
                                       "not usable here"),
    "negative_start": (ValueError, "rank 3 (rank 1 of vocab_parallel_group): vocab_start_index must be an int in "
                                   "[0, 2**63)"),
    "eta": (ValueError, "vocab_parallel_group: ranks disagree on eta (rank 2 (rank 0 of vocab_parallel_group): "
                        "1.0, rank 3 (rank 1 of vocab_parallel_group): 0.5)"),
    "label_out_of_range": (ValueError, "labels must hold ids in [0, 37)"),
}


@functools.lru_cache(maxsize=None)
def _spawn():
    """``(results, None)`` or ``(None, error)``: one spawn for every test, a failed one too (a
    hang costs DEADLINE_S once, not once per test)."""
    from _distributed_cases import run_all

    try:
        return run_ranks(max(CASES), run_all, CASES, deadline_s=DEADLINE_S, rank_timeout_s=RANK_TIMEOUT_S), None
    except AssertionError as error:
        return None, error


def _results():
    results, error = _spawn()
    if error is not None:
        raise error
    return results


def _outcomes(world: int, case: str):
    per_rank = [ranks[world][case] for ranks in _results()[:world]]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank} of {world}, case {case}:\n{result['error']}"
    return [result["outcomes"] for result in per_rank]


def _check_same_error(outcomes, error_type, fragment):
    assert all(o is not None for o in outcomes), outcomes
    assert len({(o[0], o[1]) for o in outcomes}) == 1, f"ranks raised different errors: {outcomes}"
    kind, message, _ = outcomes[0]
    assert kind == error_type.__name__ and fragment in message, outcomes[0]
    assert max(o[2] for o in outcomes) < RAISE_WITHIN_S, outcomes


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scenario", sorted(FAILURES))
def test_failures_raise_the_same_error_on_every_rank(world, scenario):
    """A check failing on one rank (any exception type), or ranks disagreeing on a setting, the
    dtype, the tokens or the labels of a vocabulary shard: every rank raises the same error (type
    and message, naming the argument and the rank) within seconds; none waits for the others."""
    error_type, fragment = FAILURES[scenario]
    outcomes = [o[scenario] for o in _outcomes(world, "failures")]
    _check_same_error(outcomes, error_type, fragment.format(last=world - 1))


@pytest.mark.parametrize("scenario", sorted(TWO_D_FAILURES))
def test_two_d_mesh_failures_name_the_global_rank(scenario):
    """Rank 3 of a 2 x 2 (data x tensor) mesh fails: its tensor group decides, and the decision
    travels verbatim over the data groups, so all four ranks raise the same words, which name
    global rank 3 with its group rank beside it."""
    error_type, fragment = TWO_D_FAILURES[scenario]
    outcomes = [o[scenario] for o in _outcomes(4, "two_d_failures")]
    _check_same_error(outcomes, error_type, fragment)


def test_failure_times_are_reported():
    """The time each failure scenario took to raise on its slowest rank (printed for the record)."""
    runs = [(2, "failures", FAILURES), (3, "failures", FAILURES), (4, "two_d_failures", TWO_D_FAILURES)]
    for world, case, scenarios in runs:
        per_rank = _outcomes(world, case)
        slowest = {name: max(o[name][2] for o in per_rank if o[name] is not None) for name in scenarios}
        print(f"\n{world} ranks ({case}), slowest rank per scenario (s): "
              + ", ".join(f"{name} {seconds:.3f}" for name, seconds in sorted(slowest.items())))
        assert max(slowest.values()) < RAISE_WITHIN_S
