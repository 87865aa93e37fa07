"""selective_logprobs on every backend against reference.py, including the entropy and its gradient."""

import pytest
import torch

import tpo_kernels
from tpo_kernels import reference

from _backends import ALL_BACKENDS, DEVICE, backend_params

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3), torch.float64: dict(atol=1e-10, rtol=1e-10)}


def _inputs(dtype, shape=(3, 4), vocab=41):
    logits = (torch.randn(*shape, vocab, dtype=torch.float64) * 3).to(DEVICE, dtype)
    labels = torch.randint(0, vocab, shape, device=DEVICE)
    labels.view(-1)[1] = -100
    return logits, labels


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_entropy_and_gradients_match_reference(backend, dtype, temperature):
    logits, labels = _inputs(dtype)
    outs, grads = [], []
    for fn, kw in ((tpo_kernels.selective_logprobs, dict(backend=backend)), (reference.selective_logprobs, {})):
        x = logits.detach().clone().requires_grad_(True)
        lp, ent = fn(x, labels, temperature=temperature, return_entropy=True, **kw)
        # Any linear combination of both outputs exercises both backward terms.
        w_lp = torch.linspace(-1, 2, lp.numel(), device=DEVICE).view(lp.shape)
        w_ent = torch.linspace(1, -0.5, ent.numel(), device=DEVICE).view(ent.shape)
        (grad,) = torch.autograd.grad((lp.float() * w_lp).sum() + (ent.float() * w_ent).sum(), x)
        outs.append((lp.detach().float(), ent.detach().float()))
        grads.append(grad.float())
    torch.testing.assert_close(outs[0], outs[1], **TOL[dtype])
    torch.testing.assert_close(grads[0], grads[1], **TOL[dtype])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_ignored_positions_are_zero_and_get_no_gradient(backend):
    logits, labels = _inputs(torch.float32)
    x = logits.clone().requires_grad_(True)
    lp, ent = tpo_kernels.selective_logprobs(x, labels, return_entropy=True, backend=backend)
    assert lp.view(-1)[1] == 0 and ent.view(-1)[1] == 0
    (lp.sum() + ent.sum()).backward()
    assert torch.count_nonzero(x.grad.view(-1, x.shape[-1])[1]) == 0


@pytest.mark.parametrize("backend", backend_params("torch", "triton", "cpu"))
def test_gradcheck_float64(backend):
    logits, labels = _inputs(torch.float64, shape=(2, 3), vocab=6)
    logits.requires_grad_(True)

    def both(x):
        return tpo_kernels.selective_logprobs(x, labels, temperature=0.7, return_entropy=True, backend=backend)

    assert torch.autograd.gradcheck(both, (logits,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_no_grad_pass_returns_float32_logprobs(backend):
    logits, labels = _inputs(torch.bfloat16)
    with torch.no_grad():
        lp = tpo_kernels.selective_logprobs(logits, labels, backend=backend)
    assert lp.dtype == torch.float32 and lp.shape == labels.shape and not lp.requires_grad
