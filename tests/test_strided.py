"""Strided logits are read in place, never copied: the natural ``logits[:, :-1]`` slice of a
``[B, T + 1, V]`` activation (rows that do not flatten into one row stride: one row-op launch per
leading index on ``[T, V]`` views), a column slice ``logits[..., :V']`` (rows that flatten into one
row stride) and a row-padded ``[M, V]`` matrix give the results and gradients of their contiguous
copies, allocate nothing of the logits' size, and take the in-place backward in the original
buffer. Bit for bit where the summation order does not depend on the address (torch, cpu); the GPU
row kernels (cuda, triton) sum a row from its first 16-byte aligned column, so a copy, whose rows
start at other addresses, agrees within the fp32 rounding of another order, and bit for bit only
at the same alignment (the same view of another buffer of the same layout)."""

import pytest
import torch

import tpo_kernels

from _backends import DEVICE, DEVICE_BACKENDS, INTERPRETED_BACKENDS
from _dispatch import OpRecorder

B, T, V = 4, 9, 37
CAPS = [pytest.param(None, id="plain"), pytest.param(30.0, id="softcap30")]


def _slices():
    """name -> (a [B, T + 1, V + 3] buffer -> the strided logits view of it)."""
    return {
        "shifted": lambda full: full[:, :-1, :V],  # logits[:, :-1] (of a row-padded buffer, too)
        "columns": lambda full: full[:, :, :V],  # rows flatten: [B * (T + 1), V], row stride V + 3
        "packed_rows": lambda full: full[0, :, :V],  # [M, V] with row stride V + 3
    }


class LogitsCopies(OpRecorder):
    """The ops that allocate a tensor holding the values of ``logits`` (in any float dtype that
    keeps them): copies, as opposed to views and chunk-sized working buffers."""

    def __init__(self, logits):
        super().__init__()
        self.values = logits.detach().reshape(-1).double()  # (a copy made before recording)
        self.copies = []

    def record(self, func, args, kwargs, out):
        if "empty" in func.__name__:  # uninitialized memory may hold anything: not a copy
            return
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() == self.values.numel()
                    and t.untyped_storage().data_ptr() not in inputs
                    and torch.equal(t.detach().reshape(-1).double(), self.values)):
                self.copies.append(func)


def _batch(view):
    full = torch.randn(B, T + 1, V + 3, device=DEVICE) * 3
    logits = _slices()[view](full)
    labels = torch.randint(0, V, logits.shape[:-1], device=DEVICE)
    labels[..., -2:] = -100
    return full, logits, labels


def _loss(logits, labels, backend, cap, **kwargs):
    scores = torch.linspace(-1, 1, B, device=DEVICE)
    if logits.dim() == 2:  # two packed completions, one group
        cu_seqlens = torch.linspace(0, logits.shape[0], 3, device=DEVICE).to(torch.int32)
        return tpo_kernels.tpo_loss(logits, labels, scores[:2], cu_seqlens=cu_seqlens, group_size=2, backend=backend,
                                    logit_softcap=cap, **kwargs)
    return tpo_kernels.tpo_loss(logits, labels, scores, group_size=2, backend=backend, logit_softcap=cap, **kwargs)


# Backends whose row kernels start the vectorized body at the row's first 16-byte aligned column:
# their summation order follows the row's address (deterministic for one alignment).
ADDRESS_ORDERED = {"triton", "cuda"}


def _assert_same(backend, contiguous_result, strided_result):
    """Bit for bit, except on the address-ordered backends, whose copy's rows sit at other
    addresses than the view's: there, within the rounding of another fp32 summation order."""
    if backend in ADDRESS_ORDERED:
        torch.testing.assert_close(strided_result, contiguous_result, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(contiguous_result, strided_result)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS + INTERPRETED_BACKENDS)
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("view", list(_slices()))
def test_strided_logits_give_the_contiguous_results(backend, cap, view):
    full, logits, labels = _batch(view)
    copy = logits.contiguous().requires_grad_(True)
    source = full.clone().requires_grad_(True)
    strided = _slices()[view](source)
    assert not strided.is_contiguous()
    losses, grads = [], []
    for x in (copy, strided):
        loss = _loss(x, labels, backend, cap, inplace_backward=False)
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, x)[0])
    _assert_same(backend, losses[0], losses[1])
    _assert_same(backend, grads[0], grads[1])
    logprobs = [tpo_kernels.selective_logprobs(x.detach(), labels, backend=backend, logit_softcap=cap,
                                               return_entropy=True) for x in (copy, strided)]
    for contiguous_result, strided_result in zip(*logprobs):
        _assert_same(backend, contiguous_result, strided_result)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("view", list(_slices()))
def test_strided_logits_are_not_copied(backend, view):
    """Forward and in-place backward never copy the logits (a soft cap's chunk buffer is bounded
    by its own budget: tests/test_softcap.py)."""
    cap = None
    full, _, labels = _batch(view)
    activation = full.requires_grad_(True) * 1  # in-place backward may overwrite an activation
    logits = _slices()[view](activation)
    with LogitsCopies(logits) as recorder:
        loss = _loss(logits, labels, backend, cap)
        (grad,) = torch.autograd.grad(loss, logits)
    assert recorder.copies == []
    assert grad.data_ptr() == logits.data_ptr() and grad.stride() == logits.stride()


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("cap", CAPS)
def test_inplace_backward_writes_the_original_buffer(backend, cap):
    full, logits, labels = _batch("shifted")
    leaf = logits.contiguous().requires_grad_(True)
    (expected,) = torch.autograd.grad(_loss(leaf, labels, backend, cap, inplace_backward=False), leaf)
    activation = full.requires_grad_(True) * 1
    before = activation.detach().clone()
    loss = _loss(activation[:, :-1, :V], labels, backend, cap)
    torch.autograd.grad(loss, activation)
    _assert_same(backend, expected, activation.detach()[:, :-1, :V])
    # Only the slice's entries are overwritten: the last position and the row padding stay.
    assert torch.equal(activation.detach()[:, -1], before[:, -1])
    assert torch.equal(activation.detach()[..., V:], before[..., V:])


@pytest.mark.parametrize("backend", DEVICE_BACKENDS + INTERPRETED_BACKENDS)
@pytest.mark.parametrize("view", list(_slices()))
def test_same_alignment_gives_bitwise_identical_results(backend, view):
    """The same view of two buffers of one layout (every row at the same address modulo 16
    bytes): loss, gradient, log-probs and entropies bit for bit, on every backend."""
    full, _, labels = _batch(view)
    results = []
    for source in (full.clone().requires_grad_(True), full.clone().requires_grad_(True)):
        assert source.stride() == full.stride() and source.data_ptr() % 16 == full.data_ptr() % 16
        logits = _slices()[view](source)
        loss = _loss(logits, labels, backend, None, inplace_backward=False)
        (grad,) = torch.autograd.grad(loss, logits)
        logprobs, entropy = tpo_kernels.selective_logprobs(logits.detach(), labels, backend=backend,
                                                           return_entropy=True)
        results.append((loss, grad, logprobs, entropy))
    for first, second in zip(*results):
        assert torch.equal(first, second)


def test_column_strided_logits_are_copied_and_correct():
    """A column stride other than 1 is the one layout the row ops cannot walk: it is copied."""
    full = torch.randn(B, T, 2 * V, device=DEVICE)
    logits, labels = full[..., ::2], torch.randint(0, V, (B, T), device=DEVICE)
    scores = torch.linspace(-1, 1, B, device=DEVICE)
    assert torch.equal(tpo_kernels.tpo_loss(logits, labels, scores, group_size=2),
                       tpo_kernels.tpo_loss(logits.contiguous(), labels, scores, group_size=2))
