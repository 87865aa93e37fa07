"""tpo_loss on every backend against reference.py: values, gradients, exact zeros, in-place
safety and determinism."""

import pytest
import torch

import tpo_kernels
from tpo_kernels import reference

from _backends import ALL_BACKENDS, backend_params
from _batches import make_batch

# fp32: both sides accumulate in fp32, so only summation order differs.
FP32_TOL = dict(atol=2e-5, rtol=1e-4)
# bf16 / fp16: the same fp32 math on the same rounded inputs, but the logits gradient is
# rounded to the input dtype (8 / 11 mantissa bits).
LOW_PRECISION_TOL = {torch.bfloat16: dict(atol=1e-2, rtol=1e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _loss_and_grad(fn, logits, *args, **kwargs):
    logits = logits.detach().clone().requires_grad_(True)
    loss = fn(logits, *args, **kwargs)
    weight = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype, device=loss.device).view(loss.shape)
    (grad,) = torch.autograd.grad((loss * weight).sum(), logits)
    return loss.detach(), grad


def _against_reference(backend, logits, labels, scores, kwargs, tol):
    loss, grad = _loss_and_grad(tpo_kernels.tpo_loss, logits, labels, scores, backend=backend, **kwargs)
    ref_loss, ref_grad = _loss_and_grad(reference.tpo_loss, logits, labels, scores, **kwargs)
    torch.testing.assert_close(loss, ref_loss.to(loss.dtype), **tol)
    torch.testing.assert_close(grad.float(), ref_grad.float(), **tol)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("grouping", ["size", "ids"])
@pytest.mark.parametrize("anchor", [True, False])
@pytest.mark.parametrize("old", [None, "token", "seq"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fp32_matches_reference(backend, layout, grouping, anchor, old, reduction):
    logits, labels, scores, kwargs = make_batch(layout=layout, grouping=grouping, old=old, tie_groups=1)
    kwargs.update(anchor=anchor, reduction=reduction)
    _against_reference(backend, logits, labels, scores, kwargs, FP32_TOL)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_kl_penalty_temperature_and_eta_match_reference(backend, reduction, layout):
    logits, labels, scores, kwargs = make_batch(layout=layout, grouping="ids", old="token", with_ref=True)
    kwargs.update(reduction=reduction, temperature=0.7, eta=0.5)
    _against_reference(backend, logits, labels, scores, kwargs, FP32_TOL)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_low_precision_matches_reference_on_the_same_inputs(backend, dtype, layout):
    logits, labels, scores, kwargs = make_batch(layout=layout, dtype=dtype, old="token", vocab=300)
    _against_reference(backend, logits, labels, scores, kwargs, LOW_PRECISION_TOL[dtype])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_mask_argument_matches_ignore_index(backend):
    logits, labels, scores, kwargs = make_batch()
    mask = (labels != -100).to(torch.int64)
    filled = torch.where(labels == -100, 0, labels)  # padding holds a real id, masked out
    by_mask, grad_mask = _loss_and_grad(tpo_kernels.tpo_loss, logits, filled, scores, mask=mask, backend=backend, **kwargs)
    by_ignore, grad_ignore = _loss_and_grad(tpo_kernels.tpo_loss, logits, labels, scores, backend=backend, **kwargs)
    torch.testing.assert_close(by_mask, by_ignore, atol=0, rtol=0)
    torch.testing.assert_close(grad_mask, grad_ignore, atol=0, rtol=0)


@pytest.mark.parametrize("backend", backend_params("torch", "triton", "cpu"))
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_gradcheck_float64(backend, layout):
    logits, labels, scores, kwargs = make_batch(layout=layout, grouping="ids", old="seq", with_ref=True,
                                                num_groups=2, group_size=2, max_len=3, vocab=5,
                                                dtype=torch.float64)
    logits.requires_grad_(True)

    def loss_of(x):  # gradcheck runs backward repeatedly on one graph: keep the logits intact
        return tpo_kernels.tpo_loss(x * 1.0, labels, scores, backend=backend, temperature=0.8,
                                    inplace_backward=False, **kwargs)

    assert torch.autograd.gradcheck(loss_of, (logits,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_tied_on_policy_groups_give_exactly_zero_gradient(backend, layout):
    logits, labels, scores, kwargs = make_batch(layout=layout, num_groups=3, tie_groups=3)
    loss, grad = _loss_and_grad(tpo_kernels.tpo_loss, logits, labels, scores, backend=backend, **kwargs)
    assert torch.count_nonzero(grad) == 0
    _, aux = tpo_kernels.tpo_loss(logits, labels, scores, backend=backend, return_aux=True, **kwargs)
    assert torch.count_nonzero(aux["coef"]) == 0
    assert torch.equal(aux["p"], aux["q"])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_only_tied_groups_rows_are_zero_when_others_carry_signal(backend):
    logits, labels, scores, kwargs = make_batch(num_groups=2, tie_groups=1)  # group 0 tied
    _, grad = _loss_and_grad(tpo_kernels.tpo_loss, logits, labels, scores, backend=backend, **kwargs)
    k = kwargs["group_size"]
    assert torch.count_nonzero(grad[:k]) == 0
    assert torch.count_nonzero(grad[k:]) > 0


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_inplace_backward_equals_out_of_place(backend):
    logits, labels, scores, kwargs = make_batch()
    results = []
    for inplace in (True, False):
        base = logits.detach().clone().requires_grad_(True)
        activation = base * 1.0  # a non-leaf, like the output of an lm_head
        loss = tpo_kernels.tpo_loss(activation, labels, scores, backend=backend, inplace_backward=inplace, **kwargs)
        loss.backward()
        results.append(base.grad)
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_inplace_backward_makes_another_consumer_of_the_logits_fail_loudly(backend):
    logits, labels, scores, kwargs = make_batch()
    base = logits.detach().clone().requires_grad_(True)
    activation = base * 1.0
    other = (activation**2).sum()  # saves `activation` for its backward, and runs after ours
    loss = tpo_kernels.tpo_loss(activation, labels, scores, backend=backend, **kwargs)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_leaf_logits_are_never_overwritten(backend):
    logits, labels, scores, kwargs = make_batch()
    leaf = logits.clone().requires_grad_(True)
    tpo_kernels.tpo_loss(leaf, labels, scores, backend=backend, **kwargs).backward()
    assert torch.equal(leaf.detach(), logits)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_non_contiguous_logits_give_the_same_result(backend):
    logits, labels, scores, kwargs = make_batch()
    strided = logits.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert not strided.is_contiguous()
    a = _loss_and_grad(tpo_kernels.tpo_loss, logits, labels, scores, backend=backend, **kwargs)
    b = _loss_and_grad(tpo_kernels.tpo_loss, strided, labels, scores, backend=backend, **kwargs)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_two_runs_are_bitwise_identical(backend, layout):
    logits, labels, scores, kwargs = make_batch(layout=layout, grouping="ids", old="token", with_ref=True)
    first = _loss_and_grad(tpo_kernels.tpo_loss, logits, labels, scores, backend=backend, **kwargs)
    second = _loss_and_grad(tpo_kernels.tpo_loss, logits, labels, scores, backend=backend, **kwargs)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_aux_reports_the_group_quantities(backend):
    logits, labels, scores, kwargs = make_batch(old="seq")
    loss, aux = tpo_kernels.tpo_loss(logits, labels, scores, backend=backend, return_aux=True, **kwargs)
    _, ref_aux = reference.tpo_loss(logits, labels, scores, return_aux=True, **kwargs)
    for key in ("token_logprobs", "seq_logprobs", "p", "q", "u"):
        torch.testing.assert_close(aux[key], ref_aux[key].to(aux[key].dtype), **FP32_TOL)
        assert not aux[key].requires_grad
    torch.testing.assert_close(aux["coef"], (aux["p"] - aux["q"]) / 2)  # mean over G = 2 groups


def test_module_matches_functional():
    logits, labels, scores, kwargs = make_batch()
    module = tpo_kernels.TPOLoss(eta=0.5, temperature=0.9, backend="torch")
    expected = tpo_kernels.tpo_loss(logits, labels, scores, eta=0.5, temperature=0.9, backend="torch", **kwargs)
    assert torch.equal(module(logits, labels, scores, **kwargs), expected)


def test_auto_backend_is_usable_and_reported():
    status = tpo_kernels.backend_status()
    assert set(status) == {"torch", "triton", "cpu", "cuda"}
    assert status["torch"] == "available"
    assert all(isinstance(v, str) and v for v in status.values())
    logits, labels, scores, kwargs = make_batch()
    torch.testing.assert_close(
        tpo_kernels.tpo_loss(logits, labels, scores, **kwargs),
        tpo_kernels.tpo_loss(logits, labels, scores, backend="torch", **kwargs),
        **FP32_TOL,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("backend", backend_params("triton", "cuda"))
def test_more_than_65536_rows_on_gpu(backend):
    n, t, v = 70_000, 1, 64
    logits = torch.randn(n, t, v, device="cuda")
    labels = torch.randint(0, v, (n, t), device="cuda")
    scores = torch.randn(n, device="cuda")
    kwargs = dict(group_size=7)
    _against_reference(backend, logits, labels, scores, kwargs, FP32_TOL)
