"""The quick subset's core (``pytest -m quick``): every public function on every backend that runs
here, forward and backward, against tpo_kernels.reference in float64 on tiny fp32 inputs. The
full suite checks each in depth; this is the first look a newcomer gets in a few minutes."""

import pytest
import torch

import tpo_kernels
from tpo_kernels import reference

from _backends import DEVICE, DEVICE_BACKENDS, INTERPRETED_BACKENDS

pytestmark = pytest.mark.quick

N, K, T, V, H = 4, 2, 5, 24, 8
BACKENDS = DEVICE_BACKENDS + INTERPRETED_BACKENDS
TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / H**0.5
    labels = torch.randint(0, V, (N, T), generator=gen)
    labels[1, 3:] = -100
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])  # the second group ties
    candidates = torch.randint(0, V, (N * T, 3), generator=gen)
    cand_scores = torch.randn(N * T, 3, generator=gen)
    return [x.to(DEVICE) for x in (hidden, weight, labels, scores, candidates, cand_scores)]


def _compare(fn, ref_fn, tensors):
    """fn on fp32 leaves against ref_fn on float64 leaves: outputs and every gradient."""
    ours = [t.clone().requires_grad_() for t in tensors]
    refs = [t.double().requires_grad_() for t in tensors]
    out, ref = fn(*ours), ref_fn(*refs)
    out = out if isinstance(out, tuple) else (out,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.double(), r, **TOL)
    sum(o.double().sum() * (i + 1) for i, o in enumerate(out)).backward()
    sum(r.sum() * (i + 1) for i, r in enumerate(ref)).backward()
    for a, b in zip(ours, refs):
        torch.testing.assert_close(a.grad.double(), b.grad, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tpo_loss(backend):
    hidden, weight, labels, scores, *_ = _inputs()
    _compare(lambda z: tpo_kernels.tpo_loss(z, labels, scores, group_size=K, temperature=0.7, backend=backend),
             lambda z: reference.tpo_loss(z, labels, scores.double(), group_size=K, temperature=0.7),
             [hidden @ weight.T])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_tpo_loss(backend):
    hidden, weight, labels, scores, *_ = _inputs()
    _compare(lambda h, w: tpo_kernels.fused_linear_tpo_loss(h, w, labels, scores, group_size=K, backend=backend),
             lambda h, w: reference.tpo_loss(h @ w.T, labels, scores.double(), group_size=K),
             [hidden, weight])


@pytest.mark.parametrize("backend", BACKENDS)
def test_tpo_loss_from_logprobs(backend):
    _, _, labels, scores, *_ = _inputs()
    logprobs = -torch.rand(N, T, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = labels != -100
    _compare(lambda lp: tpo_kernels.tpo_loss_from_logprobs(lp, scores, mask=mask, group_size=K, backend=backend),
             lambda lp: reference.tpo_loss_from_logprobs(lp, scores.double(), mask=mask, group_size=K),
             [logprobs])


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_tpo_loss(backend):
    hidden, weight, _, _, candidates, cand_scores = _inputs()
    _compare(lambda z: tpo_kernels.token_tpo_loss(z, candidates, cand_scores, backend=backend),
             lambda z: reference.token_tpo_loss(z, candidates, cand_scores.double()),
             [(hidden @ weight.T).reshape(N * T, V)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_token_tpo_loss(backend):
    hidden, weight, _, _, candidates, cand_scores = _inputs()
    _compare(lambda h, w: tpo_kernels.fused_linear_token_tpo_loss(h, w, candidates, cand_scores, backend=backend),
             lambda h, w: reference.token_tpo_loss(h @ w.T, candidates, cand_scores.double()),
             [hidden.reshape(N * T, H), weight])


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_logprobs(backend):
    hidden, weight, labels, *_ = _inputs()
    _compare(lambda z: tpo_kernels.selective_logprobs(z, labels, return_entropy=True, logit_softcap=5.0,
                                                      backend=backend),
             lambda z: reference.selective_logprobs(z, labels, return_entropy=True, logit_softcap=5.0),
             [hidden @ weight.T])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_logprobs(backend):
    hidden, weight, labels, *_ = _inputs()
    _compare(lambda h, w: tpo_kernels.fused_linear_logprobs(h, w, labels, return_entropy=True, logit_scale=0.5,
                                                            backend=backend),
             lambda h, w: reference.selective_logprobs(h @ w.T, labels, return_entropy=True, logit_scale=0.5),
             [hidden, weight])


def test_every_backend_is_in_the_quick_subset():
    expected = {"torch", "triton", "cuda"} if DEVICE.type == "cuda" else {"torch", "cpu", "triton"}
    assert {p.id for p in BACKENDS} == expected
