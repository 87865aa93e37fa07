"""What ``return_aux`` / ``return_entropy`` report: per-group metrics and token entropies from
the loss's own vocabulary pass, on both sequence-level paths."""

import pytest
import torch

import tpo_kernels
from tpo_kernels import reference

from _backends import ALL_BACKENDS
from _batches import make_batch

H = 8


def _loss(path, backend, logits_or_head, labels, scores, kwargs, **extra):
    if path == "logits":
        return tpo_kernels.tpo_loss(logits_or_head, labels, scores, backend=backend, return_aux=True, **kwargs, **extra)
    hidden, weight = logits_or_head
    return tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores, backend=backend, return_aux=True,
                                             chunk_size=4, **kwargs, **extra)


def _inputs(path, layout="padded"):
    logits, labels, scores, kwargs = make_batch(layout=layout, grouping="ids", tie_groups=1, num_groups=3)
    if path == "logits":
        return logits, logits, labels, scores, kwargs
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(*labels.shape, H, generator=gen).to(logits.device)
    weight = torch.randn(logits.shape[-1], H, generator=gen).to(logits.device)
    return hidden @ weight.T, (hidden, weight), labels, scores, kwargs


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("path", ["logits", "fused_linear"])
def test_group_metrics_match_their_definitions(backend, path):
    logits, inputs, labels, scores, kwargs = _inputs(path)
    _, aux = _loss(path, backend, inputs, labels, scores, kwargs)
    _, ref = reference.tpo_loss(logits.double(), labels, scores.double(), return_aux=True, **kwargs)
    groups = sorted(set(kwargs["group_ids"].tolist()))
    for g, gid in enumerate(groups):
        members = kwargs["group_ids"] == gid
        p, q = ref["p"][members], ref["q"][members]
        torch.testing.assert_close(aux["kl_q_p"][g].double(), (q * (q.log() - p.log())).sum(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(aux["entropy_p"][g].double(), -(p * p.log()).sum(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(aux["entropy_q"][g].double(), -(q * q.log()).sum(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("path", ["logits", "fused_linear"])
def test_zero_signal_marks_exactly_the_tied_groups(backend, path):
    _, inputs, labels, scores, kwargs = _inputs(path)
    _, aux = _loss(path, backend, inputs, labels, scores, kwargs)
    tied_id = sorted(set(kwargs["group_ids"].tolist()))
    # make_batch ties group 0 (id 3): the smallest id is the first group of the result.
    assert aux["zero_signal"].tolist() == [True] + [False] * (len(tied_id) - 1)
    assert float(aux["kl_q_p"][0]) == 0.0


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("path", ["logits", "fused_linear"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_token_entropy_comes_from_the_same_pass(backend, path, layout):
    logits, inputs, labels, scores, kwargs = _inputs(path, layout)
    loss, aux = _loss(path, backend, inputs, labels, scores, kwargs, return_entropy=True, temperature=0.7)
    plain_loss, _ = _loss(path, backend, inputs, labels, scores, kwargs, temperature=0.7)
    _, want = reference.selective_logprobs(logits.double(), labels, temperature=0.7, return_entropy=True)
    assert aux["token_entropy"].shape == labels.shape
    torch.testing.assert_close(aux["token_entropy"].double(), want, atol=1e-5, rtol=1e-4)
    assert torch.equal(loss, plain_loss)
