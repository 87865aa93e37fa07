"""Logit scaling and soft-capping (``logit_scale``, ``logit_softcap``): every public function that
takes logits or an lm_head against reference.py, whose logits are ``softcap(scale * z) /
temperature`` in plain autograd; float64 gradchecks; the scale folding into the temperature; the
soft cap's chunked memory bound and in-place backward.

Tolerances: fp32 against the float64 reference as for untransformed logits (the cap is a few
fp32 roundings per logit), atol 5e-5 / rtol 2e-4; bf16 inputs are rounded once and both sides
see the same rounded values, while the fused-linear path also rounds each logits tile and each
``dz`` tile to bf16 for its matmuls: atol / rtol 3e-2."""

import pytest
import torch

import tpo_kernels
from tpo_kernels import reference

from _backends import DEVICE, DEVICE_BACKENDS, INTERPRETED_BACKENDS
from _batches import make_batch
from _dispatch import OpRecorder

TOL = {torch.float32: dict(atol=5e-5, rtol=2e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# (logit_scale, logit_softcap): Gemma 2 (cap 30), Gemma 2 final-layer style cap 50 under a
# Granite-like scale 1/16, a Cohere-like scale 8 under a cap, and the scales alone.
TRANSFORMS = [
    pytest.param(1.0, 30.0, id="cap30"),
    pytest.param(0.0625, 50.0, id="scale0.0625-cap50"),
    pytest.param(8.0, 30.0, id="scale8-cap30"),
    pytest.param(0.0625, None, id="scale0.0625"),
    pytest.param(8.0, None, id="scale8"),
]
DTYPES = [torch.float32, torch.bfloat16]
HIDDEN, VOCAB, LOGIT_STD = 16, 37, 20.0  # logits of std 20: a cap of 30 bends most of them


def _logits_batch(dtype, **kwargs):
    logits, labels, scores, loss_kwargs = make_batch(vocab=VOCAB, dtype=torch.float64, old="token", **kwargs)
    return (logits * LOGIT_STD / 2).to(dtype), labels, scores.float(), loss_kwargs


def _head(token_shape, dtype):
    h = torch.randn(*token_shape, HIDDEN, dtype=torch.float64, device=DEVICE)
    w = torch.randn(VOCAB, HIDDEN, dtype=torch.float64, device=DEVICE) * LOGIT_STD / HIDDEN ** 0.5
    b = torch.randn(VOCAB, dtype=torch.float64, device=DEVICE)
    return h.to(dtype), w.to(dtype), b.to(dtype)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _grads(output, inputs):
    """Gradients of a non-uniformly weighted sum of ``output`` (a tensor or a tuple of them)."""
    outputs = output if isinstance(output, tuple) else (output,)
    total = sum((o * torch.linspace(0.5, 1.5, o.numel(), dtype=o.dtype, device=o.device).view(o.shape)).sum()
                for o in outputs)
    return torch.autograd.grad(total, inputs)


def _assert_close(actual, expected, dtype):
    actual = actual if isinstance(actual, (tuple, list)) else (actual,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.double(), e.double(), **TOL[dtype])


def _compare(fn, reference_fn, inputs, dtype, reference_inputs=None):
    """Values and gradients of ``fn(*inputs)`` against ``reference_fn`` on the float64 copies of
    the same (rounded) inputs, or on ``reference_inputs(float64 copies)``."""
    mine = _leaves(*inputs)
    out = fn(*mine)
    ref = _leaves(*(t.double() for t in inputs))
    ref_out = reference_fn(*(ref if reference_inputs is None else reference_inputs(*ref)))
    _assert_close(tuple(o.detach() for o in (out if isinstance(out, tuple) else (out,))),
                  tuple(o.detach() for o in (ref_out if isinstance(ref_out, tuple) else (ref_out,))), dtype)
    _assert_close(_grads(out, mine), _grads(ref_out, ref), dtype)


class NewBuffers(OpRecorder):
    """The element counts of the tensors ops allocate (outputs that are not views of an input)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def record(self, func, args, kwargs, out):
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(t.numel())


def _materialized(h, w, b):
    return h @ w.T + b


def _materialized_as(dtype):
    """The reference's logits from the head: rounded to ``dtype`` as the fused path's tiles are
    (bf16 logits times a scale of 8 move by whole units: both sides must see the same ones)."""
    return lambda h, w, b: (_materialized(h, w, b).to(dtype).double(),)


# ----------------------------------------------------------------------------- against the reference


# The triton backend under the interpreter: a capped transform in fp32 only (slow there).
CASES = [(b, t, d) for b in DEVICE_BACKENDS for t in TRANSFORMS for d in DTYPES] + [
    (b, TRANSFORMS[2], torch.float32) for b in INTERPRETED_BACKENDS]


def _cases(cases):
    return [pytest.param(backend.values[0], *transform.values, dtype, marks=backend.marks,
                         id=f"{backend.id}-{transform.id}-{str(dtype)[6:]}") for backend, transform, dtype in cases]


@pytest.mark.parametrize("backend, scale, cap, dtype", _cases(CASES))
def test_tpo_loss_matches_reference(backend, scale, cap, dtype):
    logits, labels, scores, kwargs = _logits_batch(dtype, layout="packed", grouping="ids")
    kwargs.update(temperature=0.7, logit_scale=scale, logit_softcap=cap, reduction="none")
    _compare(lambda z: tpo_kernels.tpo_loss(z, labels, scores, backend=backend, inplace_backward=False, **kwargs),
             lambda z: reference.tpo_loss(z, labels, scores.double(), **kwargs), (logits,), dtype)


@pytest.mark.parametrize("backend, scale, cap, dtype", _cases(CASES))
def test_selective_logprobs_and_entropy_match_reference(backend, scale, cap, dtype):
    logits, labels, _, _ = _logits_batch(dtype)
    kwargs = dict(temperature=1.3, logit_scale=scale, logit_softcap=cap, return_entropy=True)
    _compare(lambda z: tpo_kernels.selective_logprobs(z, labels, backend=backend, **kwargs),
             lambda z: reference.selective_logprobs(z, labels, **kwargs), (logits,), dtype)


@pytest.mark.parametrize("backend, scale, cap, dtype", _cases(CASES))
def test_fused_linear_tpo_loss_matches_reference(backend, scale, cap, dtype):
    _, labels, scores, kwargs = _logits_batch(dtype, grouping="ids")
    kwargs.update(temperature=0.7, logit_scale=scale, logit_softcap=cap, reduction="none")
    # Tiles of 4 rows by vocabulary blocks of 8: chunked, blocked and merged.
    policy = tpo_kernels.TilePolicy(logits_bytes=0, min_tile_tokens=4, accum_bytes=8 * HIDDEN * 4)
    _compare(lambda h, w, b: tpo_kernels.fused_linear_tpo_loss(h, w, labels, scores, bias=b, backend=backend,
                                                               chunk_size=1, tile_policy=policy, **kwargs),
             lambda z: reference.tpo_loss(z, labels, scores.double(), **kwargs),
             _head(labels.shape, dtype), dtype, reference_inputs=_materialized_as(dtype))


@pytest.mark.parametrize("backend, scale, cap, dtype", _cases(CASES))
def test_fused_linear_logprobs_and_entropy_match_reference(backend, scale, cap, dtype):
    _, labels, _, _ = _logits_batch(dtype, layout="packed")
    kwargs = dict(temperature=1.3, logit_scale=scale, logit_softcap=cap, return_entropy=True)
    _compare(lambda h, w, b: tpo_kernels.fused_linear_logprobs(h, w, labels, bias=b, backend=backend, chunk_size=3,
                                                               **kwargs),
             lambda z: reference.selective_logprobs(z, labels, **kwargs),
             _head(labels.shape, dtype), dtype, reference_inputs=_materialized_as(dtype))


def _candidate_batch(dtype, states=6, num_cand=4):
    candidates = torch.randint(0, VOCAB, (states, num_cand), device=DEVICE)
    scores = torch.randn(states, num_cand, device=DEVICE)
    scores[0] = 0.5  # a tied state
    return candidates, scores


@pytest.mark.parametrize("backend, scale, cap, dtype", _cases(CASES))
def test_token_tpo_loss_matches_reference(backend, scale, cap, dtype):
    candidates, scores = _candidate_batch(dtype)
    logits = (torch.randn(candidates.shape[0], VOCAB, dtype=torch.float64, device=DEVICE) * LOGIT_STD).to(dtype)
    kwargs = dict(temperature=0.7, logit_scale=scale, logit_softcap=cap, reduction="none")
    _compare(lambda z: tpo_kernels.token_tpo_loss(z, candidates, scores, backend=backend, **kwargs),
             lambda z: reference.token_tpo_loss(z, candidates, scores.double(), **kwargs), (logits,), dtype)


@pytest.mark.parametrize("backend, scale, cap, dtype", _cases(CASES))
def test_fused_linear_token_tpo_loss_matches_reference(backend, scale, cap, dtype):
    candidates, scores = _candidate_batch(dtype)
    kwargs = dict(temperature=0.7, logit_scale=scale, logit_softcap=cap, reduction="none")
    _compare(lambda h, w, b: tpo_kernels.fused_linear_token_tpo_loss(h, w, candidates, scores, bias=b,
                                                                     backend=backend, **kwargs),
             lambda z: reference.token_tpo_loss(z, candidates, scores.double(), **kwargs),
             _head(candidates.shape[:1], dtype), dtype, reference_inputs=lambda h, w, b: (_materialized(h, w, b),))


def test_candidate_logits_in_aux_are_transformed():
    candidates, scores = _candidate_batch(torch.float32)
    logits = torch.randn(candidates.shape[0], VOCAB, device=DEVICE) * LOGIT_STD
    kwargs = dict(temperature=0.7, logit_scale=0.5, logit_softcap=30.0, return_aux=True)
    _, aux = tpo_kernels.token_tpo_loss(logits, candidates, scores, **kwargs)
    _, ref_aux = reference.token_tpo_loss(logits.double(), candidates, scores.double(), **kwargs)
    torch.testing.assert_close(aux["candidate_logits"].double(), ref_aux["candidate_logits"], **TOL[torch.float32])


# ----------------------------------------------------------------------------- gradients in float64


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_gradcheck_logits_paths(backend):
    logits, labels, scores, kwargs = _logits_batch(torch.float64, num_groups=1, max_len=3)
    transform = dict(logit_scale=0.5, logit_softcap=30.0, temperature=0.7)
    z = (logits / 4).requires_grad_(True)  # capped, but not so saturated that sech^2 underflows
    assert torch.autograd.gradcheck(
        lambda x: tpo_kernels.tpo_loss(x, labels, scores.double(), backend=backend, inplace_backward=False,
                                       **kwargs, **transform), (z,))
    assert torch.autograd.gradcheck(
        lambda x: tpo_kernels.selective_logprobs(x, labels, backend=backend, return_entropy=True, **transform), (z,))
    candidates, cand_scores = _candidate_batch(torch.float64, states=3)
    zc = torch.randn(3, VOCAB, dtype=torch.float64, device=DEVICE, requires_grad=True)
    old = -torch.rand(candidates.shape, dtype=torch.float64, device=DEVICE)  # off-policy: q is a constant
    assert torch.autograd.gradcheck(
        lambda x: tpo_kernels.token_tpo_loss(x, candidates, cand_scores.double(), old_logprobs=old, backend=backend,
                                             **transform), (zc,))


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_gradcheck_fused_linear_paths(backend):
    _, labels, scores, kwargs = _logits_batch(torch.float64, num_groups=1, max_len=3)
    transform = dict(logit_scale=0.5, logit_softcap=30.0, temperature=0.7)
    h, w, b = _leaves(*(t[..., :4] if t.dim() > 1 else t for t in _head(labels.shape, torch.float64)))
    # fast_mode: the Jacobian against random directions (the full one is ~800 columns of tiles).
    assert torch.autograd.gradcheck(
        lambda h_, w_, b_: tpo_kernels.fused_linear_tpo_loss(h_, w_, labels, scores.double(), bias=b_,
                                                             backend=backend, chunk_size=2, **kwargs, **transform),
        (h, w, b), fast_mode=True)
    assert torch.autograd.gradcheck(
        lambda h_, w_, b_: tpo_kernels.fused_linear_logprobs(h_, w_, labels, bias=b_, backend=backend, chunk_size=2,
                                                             return_entropy=True, **transform),
        (h, w, b), fast_mode=True)
    candidates, cand_scores = _candidate_batch(torch.float64, states=3)
    old = -torch.rand(candidates.shape, dtype=torch.float64, device=DEVICE)  # off-policy: q is a constant
    hc = torch.randn(3, 4, dtype=torch.float64, device=DEVICE, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda h_, w_, b_: tpo_kernels.fused_linear_token_tpo_loss(h_, w_, candidates, cand_scores.double(), bias=b_,
                                                                   old_logprobs=old, backend=backend, **transform),
        (hc, w, b), fast_mode=True)


# ----------------------------------------------------------------------------- how it runs


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_scale_without_cap_folds_into_the_temperature_bit_for_bit(backend):
    """A scale alone is one factor of the row ops' inverse temperature: no extra pass, and
    ``logit_scale=8`` at temperature 1 is exactly temperature 1/8 (both factors are 8.0)."""
    logits, labels, scores, kwargs = _logits_batch(torch.float32)
    scaled = tpo_kernels.tpo_loss(logits, labels, scores, backend=backend, logit_scale=8.0, **kwargs)
    tempered = tpo_kernels.tpo_loss(logits, labels, scores, backend=backend, temperature=0.125, **kwargs)
    assert torch.equal(scaled, tempered)
    h, w, b = _head(labels.shape, torch.float32)
    scaled = tpo_kernels.fused_linear_logprobs(h, w, labels, bias=b, backend=backend, logit_scale=8.0)
    tempered = tpo_kernels.fused_linear_logprobs(h, w, labels, bias=b, backend=backend, temperature=0.125)
    assert torch.equal(scaled, tempered)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_capped_logits_path_makes_no_logits_sized_tensor(backend):
    """Forward and in-place backward of a capped loss hold one row chunk of capped logits at a
    time (the device's tile budget), never a ``[M, V]`` copy: here the logits span two chunks."""
    vocab = 4096
    chunk = tpo_kernels.TilePolicy.for_device(DEVICE).chunk_size(1 << 30, vocab)
    rows = 2 * chunk
    base = torch.randn(rows, vocab, device=DEVICE, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device=DEVICE)
    cu_seqlens = torch.arange(0, rows + 1, rows // 8, device=DEVICE, dtype=torch.int32)
    scores = torch.randn(8, device=DEVICE)
    logits = base.requires_grad_(True) * 1  # an activation: its buffer takes its gradient
    with NewBuffers() as buffers:
        loss = tpo_kernels.tpo_loss(logits, labels, scores, cu_seqlens=cu_seqlens, group_size=4, backend=backend,
                                    logit_softcap=30.0)
        (grad,) = torch.autograd.grad(loss, logits)
    assert grad.data_ptr() == logits.data_ptr()
    assert max(buffers.sizes) <= chunk * vocab  # one chunk of capped logits (or of their derivative)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_capped_inplace_backward_equals_out_of_place(backend):
    logits, labels, scores, kwargs = _logits_batch(torch.float32)
    kwargs.update(logit_scale=0.5, logit_softcap=30.0)
    leaf = logits.clone().requires_grad_(True)
    tpo_kernels.tpo_loss(leaf, labels, scores, backend=backend, inplace_backward=False, **kwargs).backward()
    activation = logits.requires_grad_(True) * 1  # a non-leaf: the in-place backward may overwrite it
    loss = tpo_kernels.tpo_loss(activation, labels, scores, backend=backend, **kwargs)
    (grad,) = torch.autograd.grad(loss, activation)
    assert grad.data_ptr() == activation.data_ptr()
    assert torch.equal(grad, leaf.grad)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_capped_losses_are_deterministic(backend):
    logits, labels, scores, kwargs = _logits_batch(torch.float32)
    h, w, b = _head(labels.shape, torch.float32)
    kwargs.update(logit_scale=0.5, logit_softcap=30.0)
    runs = []
    for _ in range(2):
        z, hh, ww = _leaves(logits, h, w)
        loss = tpo_kernels.tpo_loss(z, labels, scores, backend=backend, inplace_backward=False, **kwargs)
        fused = tpo_kernels.fused_linear_tpo_loss(hh, ww, labels, scores, backend=backend, chunk_size=3, **kwargs)
        runs.append((loss, fused, *torch.autograd.grad(loss + fused, (z, hh, ww))))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


# A strided ``logits[:, :-1]`` is walked one leading index at a time, its contiguous copy in chunks of
# the flat rows: their chunk boundaries differ. 16 blocks of 19 x 37 logits end every block's chunk
# at another remainder modulo the CPU vector width than the copy's, so any op that computes a
# chunk's tail with other code than its body (as ``cosh`` did) shows in the gradient.
# The GPU row kernels (cuda, triton) sum a row in an order that follows its address, which a copy
# changes (tests/test_strided.py): bit for bit on torch and cpu.
STRIDED_SHAPE = (16, 19, 37)
ADDRESS_FREE_BACKENDS = [b for b in DEVICE_BACKENDS if b.id in ("torch", "cpu")]


@pytest.mark.parametrize("backend", ADDRESS_FREE_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_capped_strided_view_gives_its_contiguous_copys_results_bit_for_bit(backend, dtype, inplace):
    """Loss, log-probs, entropies and logits gradient of a soft-capped ``logits[:, :-1]`` equal
    those of its contiguous copy bit for bit: the cap and its derivative give every logit the same
    bits wherever the chunk boundaries fall."""
    batch, tokens, vocab = STRIDED_SHAPE
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    full = (torch.randn(batch, tokens + 1, vocab, generator=gen, device=DEVICE) * LOGIT_STD).to(dtype)
    labels = torch.randint(0, vocab, (batch, tokens), generator=gen, device=DEVICE)
    scores = torch.randn(batch, generator=gen, device=DEVICE)
    kwargs = dict(group_size=4, backend=backend, logit_scale=0.5, logit_softcap=30.0)
    results = []
    for strided in (False, True):
        source = full.clone().requires_grad_(True)
        source = source * 1 if inplace else source  # an activation's buffer may take the gradient
        logits = source[:, :-1] if strided else source[:, :-1].contiguous()
        assert logits.is_contiguous() != strided
        loss = tpo_kernels.tpo_loss(logits, labels, scores, inplace_backward=inplace, **kwargs)
        (grad,) = torch.autograd.grad(loss, logits)
        logprobs, entropy = tpo_kernels.selective_logprobs(
            full[:, :-1] if strided else full[:, :-1].contiguous(), labels, backend=backend, logit_scale=0.5,
            logit_softcap=30.0, return_entropy=True)
        results.append(dict(loss=loss, grad=grad, logprobs=logprobs, entropy=entropy))
    contiguous, strided = results
    for name in contiguous:
        assert torch.equal(contiguous[name], strided[name]), name


def test_modules_pass_the_transform():
    logits, labels, scores, kwargs = _logits_batch(torch.float32)
    settings = dict(temperature=0.7, logit_scale=0.5, logit_softcap=30.0)
    module = tpo_kernels.TPOLoss(**settings)
    assert torch.equal(module(logits.clone(), labels, scores, **kwargs),
                       tpo_kernels.tpo_loss(logits.clone(), labels, scores, **settings, **kwargs))
    assert "logit_softcap=30.0" in repr(module)
