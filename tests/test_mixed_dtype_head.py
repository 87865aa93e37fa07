"""Hidden states and an lm_head of different float dtypes: the fused-linear path computes the
logits in the wider dtype, tile by tile, and returns each gradient in its input's dtype."""

import pytest
import torch

import tpo_kernels
from tpo_kernels import reference

from _backends import ALL_BACKENDS
from _batches import make_batch

H = 16


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("hidden_dtype, weight_dtype", [(torch.bfloat16, torch.float32),
                                                        (torch.float32, torch.float64)])
def test_mixed_dtypes_match_reference_on_the_wider_dtype(backend, hidden_dtype, weight_dtype):
    _, labels, scores, kwargs = make_batch(layout="packed", old="token")
    gen = torch.Generator().manual_seed(5)
    vocab = 37
    hidden = torch.randn(labels.shape[0], H, generator=gen).to(labels.device, hidden_dtype).requires_grad_()
    weight = torch.randn(vocab, H, generator=gen).to(labels.device, weight_dtype).requires_grad_()
    bias = torch.randn(vocab, generator=gen).to(labels.device, weight_dtype).requires_grad_()
    loss = tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores, bias=bias, backend=backend,
                                             chunk_size=3, **kwargs)
    grads = torch.autograd.grad(loss, (hidden, weight, bias))
    assert [g.dtype for g in grads] == [hidden_dtype, weight_dtype, weight_dtype]

    leaves = [t.detach().to(weight_dtype).requires_grad_() for t in (hidden, weight, bias)]
    want = reference.tpo_loss(leaves[0] @ leaves[1].T + leaves[2], labels, scores.to(weight_dtype), **kwargs)
    want_grads = torch.autograd.grad(want, leaves)
    tol = dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(loss.double(), want.double(), **tol)
    hidden_tol = dict(atol=1e-2, rtol=1e-2) if hidden_dtype == torch.bfloat16 else tol  # dH rounded to bf16
    torch.testing.assert_close(grads[0].double(), want_grads[0].double(), **hidden_tol)
    for got, ref in zip(grads[1:], want_grads[1:]):
        torch.testing.assert_close(got.double(), ref.double(), **tol)
