"""Every nn.Module gives exactly what its functional form gives with the same settings."""

import inspect

import pytest
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


MODULES = [
    (tpo_kernels.TPOLoss, tpo_kernels.tpo_loss),
    (tpo_kernels.FusedLinearTPOLoss, tpo_kernels.fused_linear_tpo_loss),
    (tpo_kernels.TokenTPOLoss, tpo_kernels.token_tpo_loss),
    (tpo_kernels.FusedLinearTokenTPOLoss, tpo_kernels.fused_linear_token_tpo_loss),
]


@pytest.mark.parametrize("module_type, function", MODULES, ids=lambda x: getattr(x, "__name__", ""))
def test_module_takes_every_keyword_of_its_function(module_type, function):
    """Every keyword-only argument of the function is a constructor keyword or a forward keyword
    of its module (validate, return_entropy, process_group, tile_policy, ...), none is lost."""
    keywords = {name for name, p in inspect.signature(function).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    module = module_type()
    assert keywords == set(module.settings) | (set(module_type.batch_keywords) & keywords)
    for name in ("validate", "backend", "eta", "process_group"):
        assert name in module.settings


def test_module_rejects_an_unknown_keyword():
    with pytest.raises(TypeError, match="unexpected keyword"):
        tpo_kernels.TPOLoss(etta=0.5)


def test_module_forwards_validate_and_entropy():
    logits = torch.randn(4, 3, 11)
    labels = torch.randint(0, 11, (4, 3))
    scores = torch.randn(4)
    module = tpo_kernels.TPOLoss(validate=False, return_entropy=True, backend="torch")
    loss, aux = module(logits, labels, scores, group_size=2, return_aux=True)
    expected, expected_aux = tpo_kernels.tpo_loss(logits, labels, scores, group_size=2, validate=False,
                                                  return_entropy=True, return_aux=True, backend="torch")
    assert torch.equal(loss, expected) and torch.equal(aux["token_entropy"], expected_aux["token_entropy"])
