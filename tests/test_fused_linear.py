"""Fused hidden x lm_head path (fused_linear_tpo_loss, fused_linear_logprobs) against reference.py
on materialized logits ``hidden @ weight.T + bias`` with autograd: values, gradients of hidden,
weight and bias, chunk-size invariance, zero-signal skipping (no backward matmul) and memory (no
``[M, V]`` tensor)."""

import dataclasses

import pytest
import torch

from tpo_kernels import TilePolicy, fused_linear_logprobs, fused_linear_tpo_loss, reference

from _backends import DEVICE, DEVICE_BACKENDS, INTERPRETED_BACKENDS
from _batches import make_batch
from _dispatch import OpRecorder, OutputSizes

HIDDEN, VOCAB = 16, 37
# fp32: the fused path computes the same fp32 logits chunk by chunk (only the matmul blocking and
# the summation order differ from the float64 reference).
FP32_TOL = dict(atol=5e-5, rtol=2e-4)
# bf16: logits and every matmul product are rounded to 8 mantissa bits on both sides; the
# reference sums dW inside one matmul, the fused path over chunks in fp32.
BF16_TOL = dict(atol=3e-2, rtol=3e-2)


def _head(token_shape, dtype=torch.float32, bias=True, hidden=HIDDEN, vocab=VOCAB):
    h = torch.randn(*token_shape, hidden, dtype=torch.float64)
    w = torch.randn(vocab, hidden, dtype=torch.float64) * 0.5
    b = torch.randn(vocab, dtype=torch.float64) if bias else None
    return h.to(DEVICE, dtype), w.to(DEVICE, dtype), None if b is None else b.to(DEVICE, dtype)


def _batch(**kwargs):
    """(hidden, weight, bias, labels, scores, loss kwargs) of a random make_batch batch."""
    bias = kwargs.pop("bias", True)
    dtype = kwargs.pop("dtype", torch.float32)
    _, labels, scores, loss_kwargs = make_batch(vocab=VOCAB, dtype=torch.float32, **kwargs)
    h, w, b = _head(labels.shape, dtype, bias)
    return h, w, b, labels, scores, loss_kwargs


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def _loss_and_grads(loss_fn, h, w, b, reference_dtype=None, retain_graph=False):
    """Loss and gradients of (hidden, weight, bias); ``reference_dtype`` evaluates the logits in
    that dtype (the reference path), None calls the fused loss_fn(h, w, b); ``retain_graph``: the
    backward keeps the graph."""
    h, w, b = _leaves(h, w, b)
    if reference_dtype is None:
        loss = loss_fn(h, w, b)
    else:
        hr, wr = h.to(reference_dtype), w.to(reference_dtype)
        logits = hr @ wr.T + (0 if b is None else b.to(reference_dtype))
        loss = loss_fn(logits)
    # A non-uniform weighting so that reduction="none" checks every group's gradient.
    weighting = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype, device=loss.device).view(loss.shape)
    inputs = [t for t in (h, w, b) if t is not None]
    grads = torch.autograd.grad((loss * weighting).sum(), inputs, retain_graph=retain_graph)
    return loss.detach(), grads


def _policy(**budgets) -> TilePolicy:
    """The device's tile policy with some budgets replaced."""
    return dataclasses.replace(TilePolicy.for_device(DEVICE), **budgets)


def _uncached(**budgets) -> TilePolicy:
    """The device's policy without a logits cache at any vocabulary size (by default a head of at
    most ``small_vocab`` entries, as every head here, keeps every counted token's logits)."""
    return _policy(small_vocab=0, **budgets)


def _check_tpo(backend, h, w, b, labels, scores, kwargs, tol, reference_dtype=torch.float64, **fused_kwargs):
    loss, grads = _loss_and_grads(
        lambda h_, w_, b_: fused_linear_tpo_loss(
            h_, w_, labels, scores, bias=b_, backend=backend, **kwargs, **fused_kwargs
        ),
        h, w, b,
    )
    ref_loss, ref_grads = _loss_and_grads(
        lambda logits: reference.tpo_loss(logits, labels, scores.to(reference_dtype), **kwargs),
        h, w, b, reference_dtype,
    )
    torch.testing.assert_close(loss, ref_loss.to(loss.dtype), **tol)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad.float(), ref_grad.float(), **tol)


_MATMULS = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default,
    torch.ops.aten.matmul.default, torch.ops.aten.bmm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.out,
    torch.ops.aten.mm.dtype, torch.ops.aten.addmm.dtype_out,  # products into a wider accumulator (CUDA)
}


class MatmulRecorder(OpRecorder):
    """Records the operand shapes of every matrix multiply dispatched while active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def record(self, func, args, kwargs, out):
        if func in _MATMULS:
            operands = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
            self.shapes.append([tuple(a.shape) for a in operands[-2:]])

    def multiply_adds(self):
        """m * k * n of each recorded [m, k] @ [k, n] product."""
        return [m * k * n for (m, k), (_, n) in self.shapes]


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("grouping", ["size", "ids"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fp32_matches_reference(backend, layout, grouping, bias, reduction):
    h, w, b, labels, scores, kwargs = _batch(layout=layout, grouping=grouping, bias=bias, tie_groups=1)
    kwargs.update(reduction=reduction)
    _check_tpo(backend, h, w, b, labels, scores, kwargs, FP32_TOL, chunk_size=4)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("old", ["token", "seq"])
@pytest.mark.parametrize("anchor", [True, False])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_old_logprobs_and_anchor_match_reference(backend, old, anchor, layout):
    h, w, b, labels, scores, kwargs = _batch(layout=layout, grouping="ids", old=old)
    kwargs.update(anchor=anchor)
    _check_tpo(backend, h, w, b, labels, scores, kwargs, FP32_TOL, chunk_size=5)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_kl_penalty_temperature_and_eta_match_reference(backend, reduction, layout):
    h, w, b, labels, scores, kwargs = _batch(layout=layout, old="token", with_ref=True)
    kwargs.update(reduction=reduction, temperature=0.7, eta=0.5)
    _check_tpo(backend, h, w, b, labels, scores, kwargs, FP32_TOL, chunk_size=3)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_bf16_matches_reference_on_the_same_rounded_logits(backend, layout):
    h, w, b, labels, scores, kwargs = _batch(layout=layout, old="token", dtype=torch.bfloat16)
    _check_tpo(backend, h, w, b, labels, scores, kwargs, BF16_TOL, reference_dtype=torch.bfloat16, chunk_size=4)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype, accum", [(torch.float32, torch.float64), (torch.bfloat16, torch.float32)])
def test_vocab_blocked_accumulation_matches_reference(backend, dtype, accum):
    # A wider accumulator than the weight dtype is kept per vocabulary block; a budget of 10
    # vocabulary rows splits V=37 into 4 blocks.
    # (A chunk larger than the batch, so that only this cap cuts the vocabulary.)
    policy = _uncached(accum_bytes=10 * HIDDEN * (torch.finfo(accum).bits // 8))
    h, w, b, labels, scores, kwargs = _batch(layout="packed", grouping="ids", old="token", with_ref=True, dtype=dtype)
    tol, reference_dtype = (FP32_TOL, torch.float64) if dtype == torch.float32 else (BF16_TOL, torch.bfloat16)
    with MatmulRecorder() as recorder:
        _check_tpo(backend, h, w, b, labels, scores, kwargs, tol, reference_dtype=reference_dtype,
                   chunk_size=labels.numel(), grad_accum_dtype=accum, tile_policy=policy)
    assert any(operands[1] == (HIDDEN, 10) for operands in recorder.shapes)  # a block's recompute ran


@pytest.mark.parametrize("backend", INTERPRETED_BACKENDS)
def test_interpreted_triton_matches_reference(backend):
    h, w, b, labels, scores, kwargs = _batch(num_groups=1, group_size=2, max_len=3, with_ref=True)
    kwargs.update(temperature=0.8)
    _check_tpo(backend, h, w, b, labels, scores, kwargs, FP32_TOL, chunk_size=4)


def test_return_aux_matches_reference():
    h, w, b, labels, scores, kwargs = _batch(layout="packed", grouping="ids", old="seq")
    loss, aux = fused_linear_tpo_loss(h, w, labels, scores, bias=b, return_aux=True, chunk_size=3, **kwargs)
    ref_loss, ref_aux = reference.tpo_loss(h @ w.T + b, labels, scores, return_aux=True, **kwargs)
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)
    for key in ("token_logprobs", "seq_logprobs", "p", "q", "u", "group_loss"):
        torch.testing.assert_close(aux[key], ref_aux[key].to(aux[key].dtype), **FP32_TOL)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck_float64(backend, bias):
    # Old log-probs given: q is then a constant, so the loss value is what the gradient differentiates
    # (on-policy, q depends on the held-constant ell and finite differences would move it).
    _, labels, scores, kwargs = make_batch(num_groups=2, group_size=2, max_len=2, vocab=5, dtype=torch.float64,
                                           old="token", with_ref=True)
    h, w, b = _leaves(*_head(labels.shape, torch.float64, bias, hidden=2, vocab=5))
    kwargs.update(reduction="none", temperature=0.8, eta=0.7)

    def loss_fn(*params):
        return fused_linear_tpo_loss(params[0], params[1], labels, scores, bias=params[2] if bias else None,
                                     backend=backend, chunk_size=2, **kwargs)

    assert torch.autograd.gradcheck(loss_fn, tuple(t for t in (h, w, b) if t is not None))


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_logprobs_gradcheck_float64(backend):
    h, w, b = _leaves(*_head((2, 2), torch.float64, hidden=2, vocab=5))
    labels = torch.randint(0, 5, (2, 2), device=DEVICE)
    labels[0, 1] = -100

    def fn(h_, w_, b_):
        return fused_linear_logprobs(h_, w_, labels, bias=b_, temperature=1.3, return_entropy=True,
                                     backend=backend, chunk_size=4)

    assert torch.autograd.gradcheck(fn, (h, w, b))


@pytest.mark.parametrize("backend", DEVICE_BACKENDS + INTERPRETED_BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("vocab_blocks", [False, True])
def test_logprobs_and_entropy_match_reference(backend, temperature, vocab_blocks):
    accum = torch.float64 if vocab_blocks else torch.float32
    # With vocab_blocks, the entropy term of dz runs block by block: 8 vocabulary rows of fp64.
    policy = _policy(accum_bytes=8 * HIDDEN * 8) if vocab_blocks else None
    h, w, b = _head((3, 4))
    labels = torch.randint(0, VOCAB, (3, 4), device=DEVICE)
    labels[1, 2] = -100
    results = []
    for fused in (True, False):
        hh, ww, bb = _leaves(h, w, b)
        if fused:
            lp, ent = fused_linear_logprobs(hh, ww, labels, bias=bb, temperature=temperature, return_entropy=True,
                                            backend=backend, chunk_size=5, grad_accum_dtype=accum,
                                            tile_policy=policy)
        else:
            logits = hh.double() @ ww.double().T + bb.double()
            lp, ent = reference.selective_logprobs(logits, labels, temperature=temperature, return_entropy=True)
        # Both outputs feed the gradient, the entropy's with its own weights.
        objective = (lp * torch.linspace(0.5, 1.5, 12, device=DEVICE).view(3, 4)).sum() - 0.3 * (ent * ent).sum()
        results.append((lp.detach().float(), ent.detach().float(), *torch.autograd.grad(objective, (hh, ww, bb))))
    for got, want in zip(*results):
        torch.testing.assert_close(got.float(), want.float(), **FP32_TOL)
    assert float(results[0][0][1, 2]) == 0.0 and float(results[0][1][1, 2]) == 0.0


def test_logprobs_under_no_grad_match_the_differentiable_values():
    h, w, b = _head((10,))
    labels = torch.randint(0, VOCAB, (10,), device=DEVICE)
    with torch.no_grad():
        lp = fused_linear_logprobs(h, w, labels, bias=b, chunk_size=3)
    assert lp.grad_fn is None and lp.dtype == torch.float32
    torch.testing.assert_close(lp, reference.selective_logprobs(h @ w.T + b, labels), **FP32_TOL)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_chunk_size_invariance(backend):
    h, w, b, labels, scores, kwargs = _batch(layout="packed", grouping="ids", old="token", with_ref=True)
    num_tokens = labels.numel()
    results = []
    for chunk_size in (1, 2, 7, num_tokens, num_tokens + 5, None):
        fn = lambda h_, w_, b_: fused_linear_tpo_loss(  # noqa: E731
            h_, w_, labels, scores, bias=b_, backend=backend, chunk_size=chunk_size, temperature=0.9, **kwargs
        )
        results.append(_loss_and_grads(fn, h, w, b))
    (loss0, grads0) = results[0]
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, loss0, atol=1e-5, rtol=1e-5)
        for grad, grad0 in zip(grads, grads0):
            torch.testing.assert_close(grad, grad0, atol=1e-5, rtol=1e-5)


def _tied_batch(tie_groups, **kwargs):
    h, w, b, labels, scores, loss_kwargs = _batch(
        num_groups=3, group_size=2, max_len=5, tie_groups=tie_groups, **kwargs
    )
    return _leaves(h, w, b), labels, scores, loss_kwargs


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_all_tied_groups_run_no_backward_matmul_and_give_exact_zeros(backend, layout):
    (h, w, b), labels, scores, kwargs = _tied_batch(3, layout=layout, grouping="ids")
    loss = fused_linear_tpo_loss(h, w, labels, scores, bias=b, backend=backend, chunk_size=4, **kwargs)
    with MatmulRecorder() as recorder:
        loss.backward()
    assert recorder.shapes == []
    for t in (h, w, b):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("cached", [False, True], ids=["recomputed", "default cache"])
def test_tied_groups_tokens_do_no_backward_matmul_work(backend, cached):
    """Tied groups' tokens cost no backward product, recomputed or cached (the default cache of a
    small vocabulary holds them too: the pipeline predicts no signal without a budget of its own)."""
    (h, w, b), labels, scores, kwargs = _tied_batch(2, layout="packed")  # group 2 of 3 carries signal
    chunk_size = 3
    loss, aux = fused_linear_tpo_loss(h, w, labels, scores, bias=b, backend=backend, chunk_size=chunk_size,
                                      return_aux=True, tile_policy=None if cached else _uncached(), **kwargs)
    with MatmulRecorder() as recorder:
        loss.backward()
    # Active tokens: the counted tokens of completions with a nonzero coefficient.
    seq = torch.repeat_interleave(torch.arange(6, device=DEVICE), torch.diff(kwargs["cu_seqlens"].long()))
    active = (labels != -100) & (aux["coef"][seq] != 0)
    num_active = int(active.sum())
    assert 0 < num_active < labels.numel()
    # Per tile (tokens x vocabulary block): recompute the logits, dH = dz @ W, dW += dz.T @ h, each
    # tokens * block * H multiply-adds over at most chunk_size * V logits; in all, three products of
    # the active tokens' [active, V] logits with H and nothing for the others. Cached: dH and dW,
    # each one product over the active tokens.
    work = recorder.multiply_adds()
    assert sum(work) == (2 if cached else 3) * num_active * VOCAB * HIDDEN
    assert max(work) <= (num_active if cached else chunk_size) * VOCAB * HIDDEN
    assert torch.equal(h.grad[~active], torch.zeros_like(h.grad[~active]))


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("cached", [False, True], ids=["recomputed", "default cache"])
def test_only_the_gradients_asked_for_are_computed(backend, cached):
    h, w, b, labels, scores, kwargs = _batch(layout="padded")
    w.requires_grad_(True)
    loss = fused_linear_tpo_loss(h, w, labels, scores, bias=b, backend=backend, chunk_size=4,
                                 tile_policy=None if cached else _uncached(), **kwargs)
    with MatmulRecorder() as recorder:
        (grad_w,) = torch.autograd.grad(loss, (w,))
    # No dH product: only dW (and the recompute without the cache), over every counted token's logits.
    assert sum(recorder.multiply_adds()) == (1 if cached else 2) * int((labels != -100).sum()) * VOCAB * HIDDEN
    ref = torch.autograd.grad(reference.tpo_loss(h @ w.T + b, labels, scores, **kwargs), (w,))[0]
    torch.testing.assert_close(grad_w, ref, **FP32_TOL)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_never_materializes_tokens_times_vocab(backend):
    """The default of a vocabulary above ``small_vocab`` (here: a policy whose threshold lies just below it)."""
    n, t, hidden, vocab, chunk_size = 8, 16, 8, 500, 4
    h, w, b = _leaves(*_head((n, t), hidden=hidden, vocab=vocab))
    labels = torch.randint(0, vocab, (n, t), device=DEVICE)
    scores = torch.randn(n, device=DEVICE)
    policy = _policy(small_vocab=vocab - 1)
    with OutputSizes() as tracker:
        loss = fused_linear_tpo_loss(h, w, labels, scores, bias=b, group_size=4, backend=backend, chunk_size=chunk_size,
                                     tile_policy=policy)
        loss.backward()
        lp = fused_linear_logprobs(h, w, labels, bias=b, return_entropy=True, backend=backend, chunk_size=chunk_size,
                                   tile_policy=policy)[1]
        lp.sum().backward()
    # The largest tensors are one tile of logits and the weight gradient, far below M * V.
    assert tracker.largest <= max(chunk_size * vocab, vocab * hidden) < (n * t * vocab) // 10


def test_weight_dtype_accumulation_and_bf16_gradients_stay_close():
    h, w, b, labels, scores, kwargs = _batch(dtype=torch.bfloat16, old="token")
    results = []
    for accum in (torch.float32, torch.bfloat16):
        fn = lambda h_, w_, b_: fused_linear_tpo_loss(  # noqa: E731
            h_, w_, labels, scores, bias=b_, chunk_size=3, grad_accum_dtype=accum, **kwargs
        )
        results.append(_loss_and_grads(fn, h, w, b))
    for grad32, grad16 in zip(results[0][1], results[1][1]):
        assert grad32.dtype == grad16.dtype == torch.bfloat16
        torch.testing.assert_close(grad16.float(), grad32.float(), **BF16_TOL)

