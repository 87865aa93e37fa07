"""tpo_loss_from_logprobs: the group stage alone, on per-token log-probs a trainer computed
(verl-shaped inputs: log_prob [B, T], response_mask [B, T], per-sequence scores)."""

import pytest
import torch

import tpo_kernels
from tpo_kernels import reference

from _batches import make_batch


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("grouping", ["size", "ids"])
@pytest.mark.parametrize("old", [None, "token", "seq"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_matches_tpo_loss_on_the_same_batch(layout, grouping, old, reduction):
    logits, labels, scores, kwargs = make_batch(layout=layout, grouping=grouping, old=old, with_ref=True,
                                                dtype=torch.float64)
    logits.requires_grad_()
    want = reference.tpo_loss(logits, labels, scores, reduction=reduction, **kwargs)
    want_grad = torch.autograd.grad(want.sum(), logits)[0]

    logprobs = reference.token_logprobs(logits, labels)  # differentiable in logits
    mask = (labels != -100).to(torch.float32)  # a 0/1 float response mask, as verl passes it
    got = tpo_kernels.tpo_loss_from_logprobs(logprobs, scores, mask=mask, reduction=reduction, **kwargs)
    got_grad = torch.autograd.grad(got.sum(), logits)[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)


def test_gradcheck_float64():
    _, labels, scores, kwargs = make_batch(old="token", dtype=torch.float64)
    logprobs = (-torch.rand(labels.shape, dtype=torch.float64)).requires_grad_()
    mask = labels != -100
    assert torch.autograd.gradcheck(
        lambda lp: tpo_kernels.tpo_loss_from_logprobs(lp, scores, mask=mask, reduction="none", **kwargs),
        (logprobs,),
    )


def test_tied_on_policy_groups_get_exactly_zero_gradient():
    logprobs = (-torch.rand(4, 3)).requires_grad_()
    loss = tpo_kernels.tpo_loss_from_logprobs(logprobs, torch.ones(4), group_size=2)
    assert torch.equal(torch.autograd.grad(loss, logprobs)[0], torch.zeros(4, 3))
