"""Inputs that are well-formed but cannot be what the caller meant: log-probs clearly above 0 (a
sign flip, probabilities, logits), whether ``old_logprobs``, ``ref_logprobs`` or the ``logprobs``
of ``tpo_loss_from_logprobs``, are refused with ``validate=True`` by one rule and tolerance;
``group_size=1`` (a loss that is identically 0) is warned about. A group that ends up with one
counted completion through ``group_ids`` or exclusion stays valid and zero-signal, without a
warning."""

import warnings

import pytest
import torch

import tpo_kernels
from tpo_kernels.checks.batches import OLD_LOGPROB_SLACK

N, T, V, H = 4, 5, 13, 8
CALLS = ["tpo_loss", "fused_linear_tpo_loss", "tpo_loss_from_logprobs"]


def _call(function, old_logprobs=None, logprobs=None, **kwargs):
    """``function`` on a batch whose completion 0 counts 3 tokens; ``logprobs`` replaces the
    log-probs of tpo_loss_from_logprobs."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, V, (N, T), generator=gen)
    labels[0, 3:] = -100  # completion 0 counts 3 tokens
    scores = torch.randn(N, generator=gen)
    kwargs = dict(dict(group_size=2, old_logprobs=old_logprobs, backend="torch"), **kwargs)
    if function == "tpo_loss":
        return tpo_kernels.tpo_loss(torch.randn(N, T, V, generator=gen), labels, scores, **kwargs)
    if function == "fused_linear_tpo_loss":
        return tpo_kernels.fused_linear_tpo_loss(torch.randn(N, T, H, generator=gen), torch.randn(V, H, generator=gen),
                                                 labels, scores, **kwargs)
    given = -torch.rand(N, T, generator=gen) if logprobs is None else logprobs
    return tpo_kernels.tpo_loss_from_logprobs(given, scores, mask=labels != -100, **kwargs)


# Each per-token log-prob input, as the keywords that pass ``values`` for it.
TOKEN_INPUTS = {
    "old_logprobs": lambda values: dict(old_logprobs=values),
    "ref_logprobs": lambda values: dict(ref_logprobs=values, beta=0.1),
    "logprobs": lambda values: dict(logprobs=values),
}
TOKEN_CASES = [(function, name) for function in CALLS for name in TOKEN_INPUTS
               if name != "logprobs" or function == "tpo_loss_from_logprobs"]


def _token_old(value_at, value=0.5):
    old = -torch.rand(N, T, generator=torch.Generator().manual_seed(1))
    old[value_at] = value
    return old


@pytest.mark.parametrize("function", CALLS)
def test_positive_per_completion_old_logprobs_are_refused_naming_them(function):
    with pytest.raises(ValueError, match=r"old_logprobs must be log-probabilities \(<= 0\); found 4 for a completion"):
        _call(function, torch.tensor([-1.0, -2.0, 4.0, -0.5]))


@pytest.mark.parametrize("function, name", TOKEN_CASES)
@pytest.mark.parametrize("values, found", [
    (_token_old((2, 1)), "found 0.5 at a counted token"),
    (-_token_old((2, 1), -0.5), "at a counted token"),  # negative log-likelihoods: every entry > 0
    (torch.rand(N, T) * 0.5 + 0.1, "at a counted token"),  # probabilities
    (5 + torch.rand(N, T), "at a counted token"),  # logits, or anything else in [5, 6]
], ids=["token", "nll", "probabilities", "five_to_six"])
def test_positive_token_log_probs_are_refused_naming_them(function, name, values, found):
    """The rule of old_logprobs holds for every per-token log-prob input a call reads."""
    with pytest.raises(ValueError, match=rf"^{name} must be log-probabilities \(<= 0\)") as caught:
        _call(function, **TOKEN_INPUTS[name](values))
    assert found in str(caught.value)


@pytest.mark.parametrize("function, name", TOKEN_CASES)
def test_token_log_probs_rounding_above_zero_are_accepted(function, name):
    """A certain token's log-prob computed in fp32 can come out a few ulps above 0."""
    assert torch.isfinite(_call(function, **TOKEN_INPUTS[name](_token_old((1, 0), 3e-7))))


@pytest.mark.parametrize("function, name", TOKEN_CASES)
def test_token_log_probs_are_not_read_with_validate_false(function, name):
    assert torch.isfinite(_call(function, validate=False, **TOKEN_INPUTS[name](_token_old((2, 1)))))


@pytest.mark.parametrize("function", CALLS)
def test_ref_logprobs_are_not_read_without_a_kl_term(function):
    assert torch.isfinite(_call(function, ref_logprobs=_token_old((2, 1))))  # beta = 0


@pytest.mark.parametrize("function", CALLS)
def test_rounding_above_zero_is_accepted(function):
    """A certain token's log-prob computed in fp32 can come out a few ulps above 0."""
    old = _token_old((1, 0), 3e-7)
    old[2] = 0.0
    per_completion = torch.tensor([-1.0, 1e-6, -3.0, 0.0])
    for given in (old, per_completion):
        assert torch.isfinite(_call(function, given))


def test_per_completion_slack_scales_with_counted_tokens():
    """A sum over n counted tokens carries n roundings: n * slack is accepted, more is not; a mean
    (length_normalize) carries one."""
    just_in = torch.tensor([3 * OLD_LOGPROB_SLACK * 0.99, -1.0, -1.0, -1.0])  # completion 0 counts 3 tokens
    assert torch.isfinite(_call("tpo_loss", just_in))
    with pytest.raises(ValueError, match="old_logprobs must be log-probabilities"):
        _call("tpo_loss", torch.tensor([3 * OLD_LOGPROB_SLACK * 1.01, -1.0, -1.0, -1.0]))
    with pytest.raises(ValueError, match="old_logprobs must be log-probabilities"):
        _call("tpo_loss", just_in, length_normalize=True)


@pytest.mark.parametrize("function, name", TOKEN_CASES)
def test_masked_positions_are_not_checked(function, name):
    values = _token_old((0, 4), 7.0)  # position 4 of completion 0 is ignore_index (masked)
    assert torch.isfinite(_call(function, **TOKEN_INPUTS[name](values)))


@pytest.mark.parametrize("function", CALLS)
def test_group_size_one_warns_naming_it(function):
    with pytest.warns(UserWarning, match=r"group_size=1: .*the loss is 0") as record:
        loss = _call(function, group_size=1)
    assert loss == 0
    assert record[0].filename == __file__  # points at the caller, not inside the package


def test_module_group_size_one_warning_points_at_the_caller():
    gen = torch.Generator().manual_seed(0)
    with pytest.warns(UserWarning, match="group_size=1") as record:
        tpo_kernels.TPOLoss()(torch.randn(N, T, V, generator=gen), torch.randint(0, V, (N, T), generator=gen),
                              torch.randn(N, generator=gen), group_size=1)
    assert record[0].filename == __file__


def test_a_group_left_with_one_completion_is_valid_and_silent():
    """Through group_ids (a singleton group) or exclusion (its other completions have no counted
    token): no warning, the group carries no gradient, the others do."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(N, T, V, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (N, T), generator=gen)
    scores = torch.tensor([1.0, 0.0, 2.0, -1.0])
    excluded = labels.clone()
    excluded[1] = -100  # group {0, 1} keeps completion 0 only
    calls = {"singleton_ids": dict(labels=labels, group_ids=torch.tensor([0, 1, 1, 1])),
             "exclusion": dict(labels=excluded, group_size=2)}
    for name, call in calls.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss = tpo_kernels.tpo_loss(logits, call.pop("labels"), scores, backend="torch", **call)
        (grad,) = torch.autograd.grad(loss, logits)
        assert bool((grad[0] == 0).all()), name
        assert bool((grad[2:] != 0).any()), name
