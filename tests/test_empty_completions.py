"""Completions with no counted token (all masked or ignore_index, as TRL's
mask_truncated_completions makes them) are left out of their group: no probability mass, no
gradient, and the loss equals the loss of the batch without them."""

import pytest
import torch

import tpo_kernels
from tpo_kernels import reference

from _backends import ALL_BACKENDS
from _batches import make_batch


def _drop(kwargs, keep):
    """kwargs of the batch restricted to the completions ``keep`` (group_ids keep the groups)."""
    out = {k: v for k, v in kwargs.items() if k not in ("group_size", "group_ids", "old_logprobs", "ref_logprobs")}
    ids = kwargs.get("group_ids")
    if ids is None:
        ids = torch.arange(len(keep), device=keep.device) // kwargs["group_size"]
    out["group_ids"] = ids[keep]
    for name in ("old_logprobs", "ref_logprobs"):
        if name in kwargs:
            out[name] = kwargs[name][keep]
    return out


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("grouping", ["size", "ids"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_empty_completions_are_left_out_of_their_group(backend, grouping, reduction):
    logits, labels, scores, kwargs = make_batch(grouping=grouping, num_groups=3, old="token", with_ref=True,
                                                dtype=torch.float64)
    labels[1] = -100
    labels[4] = -100
    keep = torch.ones(labels.shape[0], dtype=torch.bool, device=labels.device)
    keep[[1, 4]] = False
    logits.requires_grad_()
    loss, aux = tpo_kernels.tpo_loss(logits, labels, scores, backend=backend, reduction=reduction,
                                     return_aux=True, inplace_backward=False, **kwargs)
    grad = torch.autograd.grad(loss, logits)[0]
    want = reference.tpo_loss(logits[keep], labels[keep], scores[keep], reduction=reduction, **_drop(kwargs, keep))
    want_grad = torch.autograd.grad(want, logits)[0]
    torch.testing.assert_close(loss, want, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-10)
    assert torch.equal(grad[~keep], torch.zeros_like(grad[~keep]))
    assert torch.equal(aux["p"][~keep], torch.zeros(2, dtype=aux["p"].dtype, device=labels.device))
    assert torch.equal(aux["q"][~keep], torch.zeros(2, dtype=aux["q"].dtype, device=labels.device))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_group_with_no_counted_completion_is_dropped(backend):
    logits, labels, scores, kwargs = make_batch(num_groups=3, group_size=2, dtype=torch.float64)
    labels[2:4] = -100  # all of group 1
    loss = tpo_kernels.tpo_loss(logits, labels, scores, backend=backend, reduction="none", **kwargs)
    assert loss.shape == (2,)


def test_fused_linear_leaves_out_empty_completions_too():
    _, labels, scores, kwargs = make_batch(num_groups=2, dtype=torch.float64)
    labels[0] = -100
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(*labels.shape, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 8, generator=gen, dtype=torch.float64)
    loss = tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores, **kwargs)
    keep = torch.arange(labels.shape[0]) != 0
    want = reference.tpo_loss((hidden @ weight.T)[keep], labels[keep], scores[keep], **_drop(kwargs, keep))
    torch.testing.assert_close(loss, want, rtol=1e-9, atol=1e-10)
    assert torch.equal(torch.autograd.grad(loss, hidden)[0][0], torch.zeros_like(hidden[0]))
