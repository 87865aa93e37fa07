"""Every nn.Module gives exactly what its functional form gives with the same settings."""

import torch

import tpo_kernels

SETTINGS = dict(eta=0.5, anchor=False, temperature=0.8, reduction="sum", backend="torch")


def test_tpo_loss_module():
    logits = torch.randn(4, 3, 11)
    labels = torch.randint(0, 11, (4, 3))
    scores = torch.randn(4)
    module = tpo_kernels.TPOLoss(beta=0.0, **SETTINGS)
    expected = tpo_kernels.tpo_loss(logits, labels, scores, group_size=2, **SETTINGS)
    assert torch.equal(module(logits, labels, scores, group_size=2), expected)
    assert "eta=0.5" in repr(module)


def test_fused_linear_tpo_loss_module():
    hidden, weight = torch.randn(4, 3, 8), torch.randn(11, 8)
    labels = torch.randint(0, 11, (4, 3))
    scores = torch.randn(4)
    module = tpo_kernels.FusedLinearTPOLoss(chunk_size=5, **SETTINGS)
    expected = tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores, group_size=2, chunk_size=5, **SETTINGS)
    assert torch.equal(module(hidden, weight, labels, scores, group_size=2), expected)


def test_token_tpo_loss_module():
    logits = torch.randn(5, 11)
    candidates = torch.randint(0, 11, (5, 3))
    scores = torch.randn(5, 3)
    expected = tpo_kernels.token_tpo_loss(logits, candidates, scores, **SETTINGS)
    assert torch.equal(tpo_kernels.TokenTPOLoss(**SETTINGS)(logits, candidates, scores), expected)


def test_fused_linear_token_tpo_loss_module():
    hidden, weight = torch.randn(5, 8), torch.randn(11, 8)
    candidates = torch.randint(0, 11, (5, 3))
    scores = torch.randn(5, 3)
    expected = tpo_kernels.fused_linear_token_tpo_loss(hidden, weight, candidates, scores, **SETTINGS)
    module = tpo_kernels.FusedLinearTokenTPOLoss(**SETTINGS)
    assert torch.equal(module(hidden, weight, candidates, scores), expected)
