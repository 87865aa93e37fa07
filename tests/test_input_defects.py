"""Inputs that used to fail with an internal message (or not at all) get a clear error: a zero
hidden size, torch.func transforms, a mistyped instruction set, a candidate count that overflows."""

import pytest
import torch

import tpo_kernels

from _backends import needs_cpu

V, K = 10, 2


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (4, 3), generator=gen), torch.rand(4, generator=gen)


@pytest.mark.parametrize("fn", ["fused_linear_tpo_loss", "fused_linear_logprobs"])
def test_hidden_size_zero_is_refused_naming_hidden(fn):
    labels, scores = _batch()
    hidden, weight = torch.randn(4, 3, 0), torch.randn(V, 0)
    args = (hidden, weight, labels, scores) if fn == "fused_linear_tpo_loss" else (hidden, weight, labels)
    kwargs = dict(group_size=K) if fn == "fused_linear_tpo_loss" else {}
    with pytest.raises(ValueError, match="hidden must have a non-empty hidden dimension"):
        getattr(tpo_kernels, fn)(*args, **kwargs)


def test_fused_linear_token_loss_refuses_hidden_size_zero():
    with pytest.raises(ValueError, match="hidden must have a non-empty hidden dimension"):
        tpo_kernels.fused_linear_token_tpo_loss(torch.randn(5, 0), torch.randn(V, 0),
                                                torch.randint(0, V, (5, 3)), torch.rand(5, 3))


@pytest.mark.parametrize("transform", [torch.func.grad, torch.func.jacrev], ids=["grad", "jacrev"])
def test_function_transforms_say_they_are_not_supported(transform):
    labels, scores = _batch()
    logits = torch.randn(4, 3, V)
    with pytest.raises(NotImplementedError, match="does not support function transforms other than vmap"):
        transform(lambda z: tpo_kernels.tpo_loss(z, labels, scores, group_size=K))(logits)


def test_function_transform_message_for_log_probs_input():
    labels, scores = _batch()
    with pytest.raises(NotImplementedError, match="logprobs comes from a torch.func transform"):
        torch.func.grad(lambda lp: tpo_kernels.tpo_loss_from_logprobs(lp, scores, group_size=K))(-torch.rand(4, 3))


@needs_cpu
@pytest.mark.parametrize("name", ["AVX2", "sse9", "avx-512", "Generic"])
def test_cpu_set_isa_refuses_unknown_names(name):
    from tpo_kernels import _C_cpu

    before = _C_cpu.isa()
    with pytest.raises(ValueError, match="set_isa: name must be 'generic', 'avx2', 'avx512'"):
        _C_cpu.set_isa(name)
    assert _C_cpu.isa() == before  # unchanged
