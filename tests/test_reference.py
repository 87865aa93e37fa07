"""reference.py against an independent re-derivation of the paper's Eq. 1-3 and Appendix A."""

import math

import pytest
import torch

from tpo_kernels import reference


def test_one_hot_scores_over_ten_standardize_to_three_and_minus_a_third():
    # Appendix A's worked example: a single success among K = 10 samples.
    scores = torch.zeros(10, dtype=torch.float64)
    scores[0] = 1.0
    u = reference.standardize(scores)
    assert u[0].item() == pytest.approx(3.0, abs=1e-12)
    assert torch.allclose(u[1:], torch.full((9,), -1.0 / 3.0, dtype=torch.float64), atol=1e-12)


def test_tied_scores_standardize_to_zero_even_when_the_float_mean_is_inexact():
    scores = torch.full((3,), 0.1, dtype=torch.float64)  # 0.1*3/3 != 0.1 in floating point
    assert torch.equal(reference.standardize(scores), torch.zeros(3, dtype=torch.float64))


def test_standardize_uses_the_population_std():
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    mean = sum(scores.tolist()) / 4
    std = math.sqrt(sum((s - mean) ** 2 for s in scores.tolist()) / 4)  # divide by K, not K-1
    expected = torch.tensor([(s - mean) / std for s in scores.tolist()], dtype=torch.float64)
    assert torch.allclose(reference.standardize(scores), expected, atol=1e-14)


def _by_hand(seq_logprobs, old_seq_logprobs, scores, eta, anchor):
    """Eq. 1-3 written out with Python floats for one group."""
    k = len(scores)
    mean = sum(scores) / k
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / k)
    u = [0.0] * k if max(scores) == min(scores) else [(s - mean) / std for s in scores]
    z = sum(math.exp(x) for x in seq_logprobs)
    p = [math.exp(x) / z for x in seq_logprobs]  # Eq. 1
    z_old = sum(math.exp(x) for x in old_seq_logprobs)
    p_old = [math.exp(x) / z_old for x in old_seq_logprobs]
    weights = [(p_old[i] if anchor else 1.0) * math.exp(u[i] / eta) for i in range(k)]  # Eq. 2
    q = [w / sum(weights) for w in weights]
    loss = -sum(q[i] * math.log(p[i]) for i in range(k))  # Eq. 3
    return loss, p, q


@pytest.mark.parametrize("anchor", [True, False])
@pytest.mark.parametrize("eta", [1.0, 0.3])
def test_loss_and_sequence_gradient_match_equations_1_to_3(anchor, eta):
    # One token per completion with vocab 1 + the target, so ell is a free parameter.
    k, vocab = 4, 5
    logits = torch.randn(k, 1, vocab, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (k, 1))
    old = -torch.rand(k, dtype=torch.float64) * 3
    scores = torch.tensor([0.0, 1.0, 0.5, 1.0], dtype=torch.float64)

    loss, aux = reference.tpo_loss(
        logits, labels, scores, group_size=k, old_logprobs=old, eta=eta, anchor=anchor, return_aux=True
    )
    ell = aux["seq_logprobs"].tolist()
    expected_loss, p, q = _by_hand(ell, old.tolist(), scores.tolist(), eta, anchor)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    # dL/d ell = p - q, so dL/d logit_target = (p - q) * (1 - softmax_target).
    (grad,) = torch.autograd.grad(loss, logits)
    soft = torch.softmax(logits.detach(), -1)
    for i in range(k):
        y = labels[i, 0]
        expected = (p[i] - q[i]) * (1 - soft[i, 0, y].item())
        assert grad[i, 0, y].item() == pytest.approx(expected, abs=1e-12)


def test_on_policy_tied_group_has_zero_gradient():
    logits = torch.randn(3, 4, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (3, 4))
    loss = reference.tpo_loss(logits, labels, torch.ones(3, dtype=torch.float64), group_size=3)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.count_nonzero(grad) == 0


def test_temperature_divides_the_logits():
    logits = torch.randn(2, 3, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (2, 3))
    lp = reference.token_logprobs(logits, labels, temperature=0.5)
    expected = torch.log_softmax(logits * 2.0, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lp, expected)


def test_k3_penalty_is_a_token_mean_over_counted_tokens():
    logits = torch.randn(2, 3, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (2, 3))
    labels[1, 2] = -100
    ref = -torch.rand(2, 3, dtype=torch.float64)
    scores = torch.tensor([1.0, 1.0], dtype=torch.float64)  # tied: the TPO term is log(2)
    loss = reference.tpo_loss(logits, labels, scores, group_size=2, ref_logprobs=ref, beta=0.5)
    lp = reference.token_logprobs(logits, labels)
    counted = labels != -100
    diff = (ref - lp)[counted]
    k3 = (diff.exp() - diff - 1).mean()
    ell = lp.sum(1)
    tpo = -(torch.softmax(ell, 0) * torch.log_softmax(ell, 0)).sum()
    assert loss.item() == pytest.approx((tpo + 0.5 * k3).item(), abs=1e-12)
