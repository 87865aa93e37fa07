"""Length-normalized sequence log-probs (``length_normalize``, the author's TRL port default): a
completion's sequence log-prob, and its old log-prob from per-token old log-probs, is the mean
over its counted tokens instead of the sum. The group stage applies per-token weights ``1/n_i``
(:func:`tpo_kernels.group_math.length_weights`) to the token log-probs before the group op, so the
gradients are autograd's, exact. Per-completion ``[N]`` old log-probs are sequence log-probs in
the loss's convention, taken as given (already means).

Checked on every backend's group op against ``reference.tpo_loss(length_normalize=True)`` and
against the port's formula. Tolerances: float64 1e-12; float32 token log-probs 2e-6 (the
weights and the weighted log-probs round to fp32; the reference runs in float64).
"""

import pytest
import torch

from tpo_kernels import reference
from tpo_kernels.group_math import build_layout, length_weights, segment_sum

from _backends import DEVICE, DEVICE_BACKENDS, INTERPRETED_BACKENDS
from _batches import make_batch
from _group_stage import assert_matches_reference, group_stage_loss

BACKENDS = DEVICE_BACKENDS + INTERPRETED_BACKENDS
DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: 2e-6, torch.float64: 1e-12}


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_weighted_sequence_sum_is_the_mean_over_counted_tokens(layout):
    torch.manual_seed(0)
    _, labels, _, kwargs = make_batch(layout=layout, num_groups=3, group_size=2, dtype=torch.float64)
    valid = (labels != -100).reshape(-1)
    values = torch.randn(valid.numel(), dtype=torch.float64, device=DEVICE)
    padded_shape = tuple(labels.shape) if layout == "padded" else None
    batch_layout = build_layout(valid.numel(), DEVICE, padded_shape=padded_shape,
                                cu_seqlens=kwargs.get("cu_seqlens"), group_size=2)
    got = segment_sum(torch.where(valid, values, 0.0) * length_weights(valid, batch_layout, torch.float64),
                      batch_layout)
    bounds = ([(i * labels.shape[1], (i + 1) * labels.shape[1]) for i in range(labels.shape[0])] if padded_shape
              else list(zip(kwargs["cu_seqlens"][:-1].tolist(), kwargs["cu_seqlens"][1:].tolist())))
    expected = torch.stack([values[a:b][valid[a:b]].mean() for a, b in bounds])
    torch.testing.assert_close(got, expected, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("old", [None, "token", "seq"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_group_op_matches_reference(backend, dtype, old, layout):
    torch.manual_seed(1)
    grouping = "size" if layout == "padded" else "ids"
    logits, labels, scores, kwargs = make_batch(layout=layout, grouping=grouping, num_groups=2, group_size=3,
                                                max_len=6, dtype=dtype, old=old)
    scores = scores.double()
    settings = dict(eta=0.7, length_normalize=True, **kwargs)

    tol = TOL[dtype]
    result, aux = assert_matches_reference(logits, labels, scores, backend=backend, tol=tol, **settings)
    for name in ("seq_logprobs", "p", "q"):
        torch.testing.assert_close(getattr(result, name).double(), aux[name], rtol=tol, atol=tol)


def _port_loss(token_logprobs, mask, scores, old_token_logprobs, group_size, eta):
    """The port's formula: per-token means of the masked log-probs, then TPO on them (float64,
    padded [N, T], contiguous groups)."""
    counted = mask.to(token_logprobs.dtype)
    lengths = counted.sum(-1).clamp(min=1.0)
    seq = (token_logprobs * counted).sum(-1) / lengths
    old_seq = (old_token_logprobs * counted).sum(-1) / lengths
    g = seq.view(-1, group_size)
    advantages = torch.stack([reference.standardize(row) for row in scores.view(-1, group_size)])
    target = torch.softmax(torch.log_softmax(old_seq.view(-1, group_size), -1) + advantages / eta, -1)
    return -(target * torch.log_softmax(g, -1)).sum(-1).mean()


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_the_port_formula(backend):
    """Loss and gradient equal the port's length-normalized loss (float64, off-policy), and
    differ from the summed loss (the option matters)."""
    torch.manual_seed(2)
    logits, labels, scores, kwargs = make_batch(num_groups=3, group_size=4, max_len=7, dtype=torch.float64,
                                                old="token")
    mask = labels != -100
    old_tokens = kwargs["old_logprobs"]

    logits = logits.detach().requires_grad_(True)
    loss, _ = group_stage_loss(logits, labels, scores, backend=backend, eta=0.5, length_normalize=True, **kwargs)
    (grad,) = torch.autograd.grad(loss, logits)
    port_logits = logits.detach().requires_grad_(True)
    port = _port_loss(reference.token_logprobs(port_logits, labels), mask, scores, old_tokens, 4, 0.5)
    (port_grad,) = torch.autograd.grad(port, port_logits)

    torch.testing.assert_close(loss, port, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(grad, port_grad, rtol=1e-12, atol=1e-13)
    summed, _ = group_stage_loss(logits.detach(), labels, scores, backend=backend, eta=0.5, **kwargs)
    assert (summed - loss).abs() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_completion_old_logprobs_are_means_as_given(backend, dtype):
    """``[N]`` old log-probs are taken as the sequence log-probs of the loss's convention: the
    means a length-normalized call reports (``seq_logprobs``) fed back as ``old_logprobs`` give
    the on-policy loss, and the means of per-token old log-probs give the per-token result."""
    torch.manual_seed(3)
    logits, labels, scores, kwargs = make_batch(num_groups=2, group_size=3, dtype=dtype, old="token")
    scores = scores.double()
    old_tokens = kwargs.pop("old_logprobs")
    on_policy, result = group_stage_loss(logits, labels, scores, backend=backend, length_normalize=True, **kwargs)
    fed_back, _ = group_stage_loss(logits, labels, scores, backend=backend, length_normalize=True,
                                   old_logprobs=result.seq_logprobs, **kwargs)
    torch.testing.assert_close(fed_back, on_policy, rtol=TOL[dtype], atol=TOL[dtype])

    mask = labels != -100
    means = torch.where(mask, old_tokens.double(), 0.0).sum(-1) / mask.sum(-1)
    per_token, _ = group_stage_loss(logits, labels, scores, backend=backend, length_normalize=True,
                                    old_logprobs=old_tokens, **kwargs)
    per_seq, _ = group_stage_loss(logits, labels, scores, backend=backend, length_normalize=True,
                                  old_logprobs=means, **kwargs)
    torch.testing.assert_close(per_seq, per_token, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_group_keeps_an_exactly_zero_gradient(backend, dtype):
    torch.manual_seed(4)
    logits, labels, scores, kwargs = make_batch(num_groups=2, group_size=3, dtype=dtype, tie_groups=1)
    logits = logits.detach().requires_grad_(True)
    loss, result = group_stage_loss(logits, labels, scores.double(), backend=backend, length_normalize=True,
                                    **kwargs)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.equal(result.p[:3], result.q[:3])
    assert torch.equal(grad[:3], torch.zeros_like(grad[:3]))
    assert grad[3:].abs().max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_gradcheck_float64(backend, layout):
    """Off-policy (per-completion old log-probs, so q does not depend on the input)."""
    torch.manual_seed(5)
    logits, labels, scores, kwargs = make_batch(layout=layout, num_groups=2, group_size=2, max_len=3, vocab=3,
                                                dtype=torch.float64, old="seq")

    def loss(x):
        return group_stage_loss(x, labels, scores, backend=backend, eta=0.7, length_normalize=True, **kwargs)[0]

    assert torch.autograd.gradcheck(loss, (logits.detach().requires_grad_(True),), eps=1e-6, atol=1e-8)
