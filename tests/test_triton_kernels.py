"""Kernel-level tests of the Triton backend against the torch backend and group_math.portable_group_targets.

On CPU these run under the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py when
CUDA is absent), so shapes are kept small. Tolerances: fp32/fp64 inputs are compared tightly
(fp32 rtol=atol=1e-5, fp64 1e-12); bf16/fp16 forward outputs are fp32 computed from the same
input values, so they use the fp32 tolerance; bf16/fp16 gradients are rounded to the input dtype
on output, so they are compared at one output ulp (bf16 rtol=atol=1e-2, fp16 2e-3).
"""

import textwrap

import pytest
import torch

from tpo_kernels.backends import get_backend, triton_interpreter_enabled
from tpo_kernels.backends import TorchBackend
from tpo_kernels.group_math import build_layout, portable_group_targets as torch_group_targets

from _backends import BACKEND_STATUS, DEVICE, backend_available, needs_triton_nvidia_compiler, stats_logprob_entropy
from _triton_compile import run_compiled_python

if not backend_available("triton"):
    pytest.skip(f"triton backend: {BACKEND_STATUS['triton']}", allow_module_level=True)

from tpo_kernels.backends.triton import TritonBackend  # noqa: E402
from tpo_kernels.backends.triton import group_kernel, row_kernels, row_layout  # noqa: E402

REF = TorchBackend()

FWD_TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-5, torch.float16: 1e-5}
# Group op, fp32. Under the interpreter the kernel's math is numpy's (correctly rounded): 1e-6.
# Compiled for a GPU, Triton emits div.full.f32, sqrt.approx.f32 and ex2.approx.f32 (each within
# about 2 ulp; ex2 also carries the rounding of x * log2(e)); these tests' inputs run through a
# model of those errors stay below 6e-7 of (1 + |expected|), so the GPU tolerance is 5e-6.
GROUP_TOL_FP32 = 1e-6 if triton_interpreter_enabled() else 5e-6
GRAD_TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _close(actual, expected, tol):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def _logits(rows, vocab, dtype, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * scale
    return values.to(dtype).to(DEVICE)


def _labels(rows, vocab, skipped=(), seed=1):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[list(skipped)] = -100
    return labels.to(DEVICE)


# --------------------------------------------------------------------------- backend object


def test_backend_available_and_resolvable():
    backend = TritonBackend()
    assert backend.name == "triton"
    assert backend.unavailable_reason() is None
    assert backend.supports_device(DEVICE)
    assert isinstance(get_backend("triton", DEVICE), TritonBackend)


# --------------------------------------------------------------------------- row forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "vocab,block_v", [(37, 16), (20, None)], ids=["V37_multi_block", "V20_below_block"]
)
def test_row_forward_matches_torch(dtype, vocab, block_v):
    rows = 6
    logits = _logits(rows, vocab, dtype)
    labels = _labels(rows, vocab, skipped=(2,))
    for inv_t, entropy in ((1.0, True), (1.0 / 0.7, True), (1.0 / 0.7, False)):
        summary = row_kernels.row_forward(logits, labels,
            inv_temperature=inv_t, with_entropy=entropy,
                                                 block_v=block_v)
        stats, lp, ent = stats_logprob_entropy(summary)
        ref_summary = REF.row_forward(logits, labels,
            inv_temperature=inv_t, with_entropy=entropy)
        ref_stats, ref_lp, ref_ent = stats_logprob_entropy(ref_summary)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        assert stats.dtype == lp.dtype == acc and stats.shape == (2, rows)
        tol = FWD_TOL[dtype]
        _close(stats, ref_stats, tol)
        _close(lp, ref_lp, tol)
        if entropy:
            assert ent.dtype == acc
            _close(ent, ref_ent, tol)
        else:
            assert ent is None
        assert (stats[:, 2] == 0).all() and lp[2] == 0


def test_row_forward_skipped_rows_are_not_read():
    logits = _logits(5, 23, torch.float32)
    labels = _labels(5, 23, skipped=(0, 3))
    poisoned = logits.clone()
    poisoned[0] = float("nan")
    poisoned[3] = float("nan")
    summary = row_kernels.row_forward(poisoned, labels,
        inv_temperature=1.0, with_entropy=True, block_v=8)
    stats, lp, ent = stats_logprob_entropy(summary)
    ref_summary = REF.row_forward(logits, labels, inv_temperature=1.0, with_entropy=True)
    ref_stats, ref_lp, ref_ent = stats_logprob_entropy(ref_summary)
    for out, ref in ((stats[0], ref_stats[0]), (stats[1], ref_stats[1]), (lp, ref_lp), (ent, ref_ent)):
        assert torch.equal(out[[0, 3]], torch.zeros(2, device=DEVICE))
        _close(out, ref, 1e-5)


def test_row_forward_handles_minus_inf_logits():
    # Row 0: the whole first block is -inf (the running max stays -inf for a while).
    # Row 1: scattered -inf entries (vocab masking). Entropy ignores zero-probability entries.
    vocab = 29
    logits = _logits(2, vocab, torch.float32)
    logits[0, :16] = float("-inf")
    logits[1, ::3] = float("-inf")
    labels = torch.tensor([20, 1], device=DEVICE)
    summary = row_kernels.row_forward(logits, labels,
        inv_temperature=1.3, with_entropy=True, block_v=8)
    stats, lp, ent = stats_logprob_entropy(summary)
    z = logits.double() * 1.3
    ref_lse = torch.logsumexp(z, dim=1)
    p = torch.softmax(z, dim=1)
    ref_ent = -torch.where(p > 0, p * torch.log_softmax(z, dim=1), 0.0).sum(dim=1)
    _close(stats[0].double() * 1.3 + stats[1].double(), ref_lse, 1e-5)
    _close(lp.double(), torch.log_softmax(z, dim=1)[[0, 1], labels], 1e-5)
    _close(ent.double(), ref_ent, 1e-5)
    assert torch.isfinite(ent).all()


def test_row_forward_deterministic():
    logits = _logits(4, 50, torch.bfloat16)
    labels = _labels(4, 50)
    first = row_kernels.row_forward(logits, labels, inv_temperature=1.0, with_entropy=True, block_v=16)
    second = row_kernels.row_forward(logits, labels, inv_temperature=1.0, with_entropy=True, block_v=16)
    for a, b in zip(stats_logprob_entropy(first), stats_logprob_entropy(second)):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- row backward


def _grads(rows, acc, zero_rows=(), seed=2):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(rows, generator=gen, dtype=torch.float64).to(acc)
    ge = torch.randn(rows, generator=gen, dtype=torch.float64).to(acc)
    g[list(zero_rows)] = 0
    ge[list(zero_rows)] = 0
    return g.to(DEVICE), ge.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logprob_grad", "with_entropy_grad"])
def test_row_backward_matches_torch(dtype, with_entropy):
    rows, vocab, inv_t = 6, 37, 1.0 / 0.7
    logits = _logits(rows, vocab, dtype, scale=1.5)
    # row 2: label skipped but its g is nonzero (no one-hot term); row 4: zero-signal row
    labels = _labels(rows, vocab, skipped=(2,))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    # Real statistics for the skipped row too (its label stands in as 0 in the forward).
    summary = REF.row_forward(logits, labels.clamp(min=0), inv_temperature=inv_t, with_entropy=True)
    g, ge = _grads(rows, acc, zero_rows=(4,))
    if not with_entropy:
        ge = None
    expected = torch.empty_like(logits)
    REF.row_backward(logits, labels, summary, g,
        grad_entropy=ge, inv_temperature=inv_t, out=expected)

    out = torch.empty_like(logits)
    row_kernels.row_backward(logits, labels, summary, g,
        grad_entropy=ge, inv_temperature=inv_t, out=out, block_v=16)
    _close(out.to(acc), expected.to(acc), GRAD_TOL[dtype])
    assert torch.equal(out[4], torch.zeros_like(out[4]))

    # In place: the logits buffer becomes its own gradient.
    inplace = logits.clone()
    row_kernels.row_backward(inplace, labels, summary, g,
        grad_entropy=ge, inv_temperature=inv_t, out=inplace, block_v=16)
    assert torch.equal(inplace, out)


def test_row_backward_zero_rows_are_not_read():
    rows, vocab = 5, 21
    logits = _logits(rows, vocab, torch.float32)
    labels = _labels(rows, vocab)
    summary = REF.row_forward(logits, labels, inv_temperature=1.0, with_entropy=True)
    g, ge = _grads(rows, torch.float32, zero_rows=(1, 3))
    ge[0] = 0.0  # row 0: only the log-prob gradient
    g[2] = 0.0  # row 2: only the entropy gradient (still active)
    poisoned = logits.clone()
    poisoned[[1, 3]] = float("nan")
    expected = torch.empty_like(logits)
    REF.row_backward(logits, labels, summary, g, grad_entropy=ge, inv_temperature=1.0, out=expected)
    out = torch.full_like(logits, 7.0)
    row_kernels.row_backward(poisoned, labels, summary, g,
        grad_entropy=ge, inv_temperature=1.0, out=out, block_v=8)
    assert torch.equal(out[[1, 3]], torch.zeros(2, vocab, device=DEVICE))
    _close(out, expected, 1e-5)
    # Without an entropy gradient, g == 0 alone marks a row as zero-signal.
    out = torch.full_like(logits, 7.0)
    row_kernels.row_backward(poisoned, labels, summary, g,
        grad_entropy=None, inv_temperature=1.0, out=out, block_v=8)
    assert torch.equal(out[[1, 2, 3]], torch.zeros(3, vocab, device=DEVICE))
    assert torch.isfinite(out).all()


def test_row_backward_through_the_backend_is_deterministic():
    logits = _logits(4, 40, torch.bfloat16)
    labels = _labels(4, 40)
    backend = TritonBackend()
    summary = backend.row_forward(logits, labels, inv_temperature=1.0, with_entropy=True)
    g, ge = _grads(4, torch.float32)
    first, second = torch.empty_like(logits), torch.empty_like(logits)
    backend.row_backward(logits, labels, summary, g, grad_entropy=ge, inv_temperature=1.0, out=first)
    backend.row_backward(logits, labels, summary, g,
        grad_entropy=ge, inv_temperature=1.0, out=second)
    assert torch.equal(first, second)


def test_gradient_of_logprob_matches_autograd_float64():
    # End to end on the row ops: d/dz of sum_r g_r * logprob_r + ge_r * H_r.
    rows, vocab, inv_t = 3, 13, 1.0 / 0.9
    logits = _logits(rows, vocab, torch.float64).requires_grad_(True)
    labels = _labels(rows, vocab)
    g, ge = _grads(rows, torch.float64)
    z = logits * inv_t
    log_p = torch.log_softmax(z, dim=1)
    entropy = -(log_p.exp() * log_p).sum(dim=1)
    objective = (g * log_p.gather(1, labels[:, None]).squeeze(1)).sum() + (ge * entropy).sum()
    (expected,) = torch.autograd.grad(objective, logits)
    with torch.no_grad():
        summary = row_kernels.row_forward(logits, labels,
            inv_temperature=inv_t, with_entropy=True, block_v=4)
        out = torch.empty_like(logits)
        row_kernels.row_backward(logits, labels, summary, g,
            grad_entropy=ge, inv_temperature=inv_t, out=out, block_v=4)
    _close(out, expected, 1e-12)


# --------------------------------------------------------------------------- row sections
# Each row is read as edges (the columns before its first 16-byte aligned one, and the last
# < VEC columns), an unmasked body of whole chunks and a masked tail (row_kernels.row_sections).
# The cases below put rows at every start offset modulo VEC (row stride not a multiple of 8, and
# a base one element off) and labels, NaN and +inf logits in every section.

SECTIONS = ("head", "body", "tail", "last")


def _section_spans(row_start, vocab, vec, block_v):
    """Column ranges of each section of a row whose first element is element ``row_start``."""
    head = (-row_start) % vec
    vec_len = max(vocab - head, 0) // vec * vec
    body_len = vec_len // block_v * block_v
    return {"head": range(0, min(head, vocab)), "body": range(head, head + body_len),
            "tail": range(head + body_len, head + vec_len), "last": range(head + vec_len, vocab)}


def _strided_logits(rows, vocab, dtype, offset, seed=0):
    """``[rows, vocab]`` logits with row stride vocab + 5, starting ``offset`` elements into the
    buffer, and each row's start in elements from the buffer's (16-byte aligned) base."""
    stride = vocab + 5
    buffer = _logits(rows + 1, stride, dtype, seed=seed).reshape(-1)
    logits = buffer[offset : offset + rows * stride].view(rows, stride)[:, :vocab]
    return logits, [offset + r * stride for r in range(rows)]


def _labels_in_sections(starts, vocab, vec, block_v):
    """One label per row, two rows per section in turn (a row whose section is empty takes its
    middle column); also the set of sections that got a label."""
    labels, hit = [], set()
    for r, start in enumerate(starts):
        spans = _section_spans(start, vocab, vec, block_v)
        wanted = SECTIONS[(r // 2) % len(SECTIONS)]
        span = spans[wanted] or range(vocab // 2, vocab // 2 + 1)
        label = span[len(span) // 2]
        labels.append(label)
        hit.update(name for name, cols in spans.items() if label in cols)
    return torch.tensor(labels, device=DEVICE), hit


ROW_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype,vec", [(torch.float64, 2), (torch.float32, 4), (torch.bfloat16, 8), (torch.float16, 8)])
@pytest.mark.parametrize("block_v", [None, 2, 64])
def test_chunks_hold_at_least_one_16_byte_vector(dtype, vec, block_v):
    # A chunk is a [BLOCK_V // VEC, VEC] tile: BLOCK_V < VEC would make it empty.
    logits = torch.empty(2, 3, dtype=dtype)  # pick_block_v(3) == 4
    assert row_layout.chunk_geometry(logits, block_v) == (max(block_v or 4, vec), vec)


@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned_base", "base_off_by_one"])
@pytest.mark.parametrize("vocab", [1, 3, 37, 300])
def test_row_ops_match_torch_at_every_row_alignment(dtype, offset, vocab):
    rows, block_v, inv_t = 8, 32, 1.0 / 0.7
    logits, starts = _strided_logits(rows, vocab, dtype, offset)
    vec = 16 // logits.element_size()
    labels, hit = _labels_in_sections(starts, vocab, vec, block_v)
    if vocab == 300:  # every section is exercised
        assert hit == set(SECTIONS), hit
    summary = row_kernels.row_forward(logits, labels, inv_temperature=inv_t, with_entropy=True,
                                             block_v=block_v)
    stats, lp, ent = stats_logprob_entropy(summary)
    ref_summary = REF.row_forward(logits, labels, inv_temperature=inv_t, with_entropy=True)
    ref_stats, ref_lp, ref_ent = stats_logprob_entropy(ref_summary)
    for got, ref in ((stats, ref_stats), (lp, ref_lp), (ent, ref_ent)):
        _close(got, ref, FWD_TOL[dtype])

    acc = stats.dtype
    g, ge = _grads(rows, acc, zero_rows=(3,))
    expected = torch.empty(rows, vocab, dtype=dtype, device=DEVICE)
    REF.row_backward(logits, labels, summary, g, grad_entropy=ge, inv_temperature=inv_t,
                     out=expected)
    out = torch.full((rows, vocab), 7.0, dtype=dtype, device=DEVICE)  # rows start at other offsets
    row_kernels.row_backward(logits, labels, summary, g, grad_entropy=ge,
                             inv_temperature=inv_t, out=out, block_v=block_v)
    _close(out.to(acc), expected.to(acc), GRAD_TOL[dtype])
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    # In place (out's rows then start where the logits' rows do).
    row_kernels.row_backward(logits, labels, summary, g, grad_entropy=ge,
                             inv_temperature=inv_t, out=logits, block_v=block_v)
    assert torch.equal(logits, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_ops_match_torch_with_several_vectors_per_thread(dtype):
    """Chunks of 2048 columns (4 warps: each thread holds 2 (bf16) or 4 (fp32) 16-byte vectors of a
    chunk, row_layout.thread_tile) over three body chunks: the label in the head, in the first,
    middle and last body chunk (the chunk read apart, with body chunks before it, after it, or
    both) and in the tail; the threads' running sums merge once per row."""
    rows, vocab, block_v, inv_t = 5, 3 * 2048 + 45, 2048, 1.0 / 0.7
    logits, starts = _strided_logits(rows, vocab, dtype, offset=1)
    vec = 16 // logits.element_size()
    labels = []
    for r, start in enumerate(starts):
        spans = _section_spans(start, vocab, vec, block_v)
        body = spans["body"]
        assert len(spans["head"]) > 0 and len(body) == 3 * block_v and len(spans["tail"]) > 0
        labels.append([spans["head"][0], body[5], body[block_v + 77], body[-1], spans["tail"][3]][r])
    labels = torch.tensor(labels, device=DEVICE)
    summary = row_kernels.row_forward(logits, labels, inv_temperature=inv_t, with_entropy=True, block_v=block_v)
    ref_summary = REF.row_forward(logits, labels, inv_temperature=inv_t, with_entropy=True)
    for got, ref in zip(stats_logprob_entropy(summary), stats_logprob_entropy(ref_summary)):
        _close(got, ref, FWD_TOL[dtype])
    g, ge = _grads(rows, torch.float32)
    expected = torch.empty(rows, vocab, dtype=dtype, device=DEVICE)
    REF.row_backward(logits, labels, summary, g, grad_entropy=ge, inv_temperature=inv_t, out=expected)
    out = torch.empty_like(expected)
    row_kernels.row_backward(logits, labels, summary, g, grad_entropy=ge, inv_temperature=inv_t, out=out,
                             block_v=block_v)
    _close(out.float(), expected.float(), GRAD_TOL[dtype])


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "plus_inf"])
def test_row_forward_nan_or_inf_logit_in_any_section_makes_the_row_nan(section, bad):
    rows, vocab, block_v = 8, 300, 32
    logits, starts = _strided_logits(rows, vocab, torch.bfloat16, 0)
    labels = _labels(rows, vocab)
    poisoned = []
    for r, start in enumerate(starts):
        span = _section_spans(start, vocab, 8, block_v)[section]
        if span and r % 2 == 0:  # odd rows stay finite
            logits[r, span[len(span) // 2]] = bad
            poisoned.append(r)
    assert poisoned
    summary = row_kernels.row_forward(logits, labels, inv_temperature=1.0, with_entropy=True,
                                             block_v=block_v)
    stats, lp, ent = stats_logprob_entropy(summary)
    for value in (stats[1], lp, ent):
        assert value[poisoned].isnan().all()
        assert value[1::2].isfinite().all()


@pytest.mark.parametrize("section", SECTIONS)
def test_confident_label_in_any_section_keeps_one_minus_p_accurate(section):
    # 1 - p_y ~ 3e-9 here: accurate to the fp32 tolerance only if the label's mass is summed apart.
    rows, vocab, block_v = 8, 300, 32
    logits, starts = _strided_logits(rows, vocab, torch.float32, 0)
    logits.zero_()
    labels = []
    for r, start in enumerate(starts):
        span = _section_spans(start, vocab, 4, block_v)[section] or range(vocab // 2, vocab // 2 + 1)
        labels.append(span[-1])
        logits[r, span[-1]] = 25.0
    labels = torch.tensor(labels, device=DEVICE)
    summary = row_kernels.row_forward(logits, labels, inv_temperature=1.0, with_entropy=False,
                                       block_v=block_v)
    _, lp, _ = stats_logprob_entropy(summary)
    one_minus_p = -torch.expm1(lp.double())
    expected = (vocab - 1) / ((vocab - 1) + torch.exp(torch.tensor(25.0, dtype=torch.float64)))
    torch.testing.assert_close(one_minus_p, expected.expand(rows).to(DEVICE), rtol=1e-5, atol=0)


def test_row_forward_all_minus_inf_row_has_no_distribution():
    rows, vocab = 8, 37
    logits, _ = _strided_logits(rows, vocab, torch.float32, 1)
    logits[2] = float("-inf")
    summary = row_kernels.row_forward(logits, _labels(rows, vocab), inv_temperature=1.0,
                                             with_entropy=True, block_v=16)
    stats, lp, ent = stats_logprob_entropy(summary)
    assert stats[0, 2] == float("-inf") and lp[2].isnan() and ent[2].isnan()
    assert lp[[0, 1, 3]].isfinite().all()


# --------------------------------------------------------------------------- group op


def _check_group(layout, token_logprobs, scores, old, eta, anchor, tol, block_t=None):
    settings = dict(old_seq_logprobs=old, eta=eta, anchor=anchor)
    got = group_kernel.fused_group_targets(token_logprobs, layout, scores, block_t=block_t, **settings)
    ref = torch_group_targets(token_logprobs, layout, scores, **settings)
    for name in ("seq_logprobs", "u", "p", "q", "group_loss"):
        assert getattr(got, name).dtype == getattr(ref, name).dtype, name
        _close(getattr(got, name), getattr(ref, name), tol)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_targets_padded_contiguous(dtype):
    n, t, k = 6, 5, 3
    layout = build_layout(n * t, DEVICE, padded_shape=(n, t), group_size=k)
    gen = torch.Generator().manual_seed(3)
    token_lp = -torch.rand(n * t, generator=gen, dtype=dtype).to(DEVICE)
    token_lp[t - 2 : t] = 0  # masked tail of completion 0
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 5.0], dtype=dtype, device=DEVICE)
    old = (torch.randn(n, generator=gen, dtype=dtype) - 2).to(DEVICE)
    tol = 1e-12 if dtype == torch.float64 else GROUP_TOL_FP32
    backend = TritonBackend()
    for anchor in (True, False):
        for old_lp in (None, old):
            _check_group(layout, token_lp, scores, old_lp, 0.7, anchor, tol)
    # The backend method is the kernel, with a multi-tile token loop forced here.
    got = _check_group(layout, token_lp, scores, None, 1.0, True, tol, block_t=2)
    via_backend = backend.group_targets(token_lp, layout, scores, eta=1.0, anchor=True)
    _close(via_backend.p, got.p, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tied_group_on_policy_is_exactly_zero(dtype):
    n, t = 6, 4
    layout = build_layout(n * t, DEVICE, padded_shape=(n, t), group_size=3)
    gen = torch.Generator().manual_seed(4)
    token_lp = -torch.rand(n * t, generator=gen, dtype=dtype).to(DEVICE) * 3
    # Group 0 ties at a value v whose float mean (v + v + v) / 3 != v in fp32 and fp64, so a
    # std-based tie test would produce u = +-1 noise; group 1 does not tie.
    v = 0.45938294312745087
    scores = torch.tensor([v, v, v, 0.0, 1.0, 0.5], dtype=dtype, device=DEVICE)
    got = group_kernel.fused_group_targets(token_lp, layout, scores, eta=0.5, anchor=True)
    assert torch.equal(got.u[:3], torch.zeros(3, dtype=dtype, device=DEVICE))
    assert torch.equal(got.p[:3] - got.q[:3], torch.zeros(3, dtype=dtype, device=DEVICE))
    assert (got.p[3:] - got.q[3:] != 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_targets_group_ids_packed_variable_sizes(dtype):
    # Packed rows with trailing rows outside every completion; group ids in arbitrary order with
    # group sizes 3, 1, 2 and a tied group (id 9 has a single member: u = 0).
    cu = torch.tensor([0, 3, 4, 9, 12, 15, 19], device=DEVICE)
    group_ids = torch.tensor([5, 2, 5, 2, 2, 9], device=DEVICE)
    num_rows = 22
    layout = build_layout(num_rows, DEVICE, cu_seqlens=cu, group_ids=group_ids)
    gen = torch.Generator().manual_seed(5)
    token_lp = -torch.rand(num_rows, generator=gen, dtype=dtype).to(DEVICE)
    token_lp[19:] = 0
    scores = torch.tensor([1.0, -1.0, 3.0, 0.5, 2.0, 4.0], dtype=dtype, device=DEVICE)
    old = (torch.randn(6, generator=gen, dtype=dtype) - 3).to(DEVICE)
    tol = 1e-12 if dtype == torch.float64 else GROUP_TOL_FP32
    for anchor, old_lp in ((True, None), (True, old), (False, None)):
        got = _check_group(layout, token_lp, scores, old_lp, 2.0, anchor, tol)
        _check_group(layout, token_lp, scores, old_lp, 2.0, anchor, tol, block_t=1)
    assert got.u[5] == 0 and got.p[5] == 1  # singleton group


def test_group_targets_deterministic():
    n, t = 12, 9
    layout = build_layout(n * t, DEVICE, padded_shape=(n, t), group_size=4)
    token_lp = -torch.rand(n * t, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    scores = torch.arange(n, dtype=torch.float32, device=DEVICE) % 3
    first = group_kernel.fused_group_targets(token_lp, layout, scores, eta=1.0, anchor=True)
    second = group_kernel.fused_group_targets(token_lp, layout, scores, eta=1.0, anchor=True)
    for name in ("seq_logprobs", "u", "p", "q", "group_loss"):
        assert torch.equal(getattr(first, name), getattr(second, name))


# --------------------------------------------------------------------------- GPU code generation

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import re
    import triton, triton.language as tl
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    from tpo_kernels.backends.triton import group_kernel as gk, row_kernels as rk

    def build(fn, sig, constexprs, arch):
        # Pointers 16-byte aligned (as torch allocates), integers of unknown divisibility: the
        # launchers' specialization for a vocabulary that is not a multiple of 16.
        attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(sig.values()) if ty.startswith("*")}
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
        build.ttir = compiled.asm["ttir"]
        return compiled.asm["ptx"]

    def label_logit_loaded_first(ttir, dt):
        # The label's logit is the forward's one scalar load of the logits: it must come before
        # the chunk loop (issued at the row's start), not after it (a dependent load at the tail).
        scalar = re.search(r"tt\\.load %[\\w.]+ : !tt\\.ptr<" + dt + ">", ttir)
        return scalar is not None and scalar.start() < ttir.index("scf.for")

    def vector_ops(ptx, op):
        return len(re.findall(op + r"\\.global(\\.[a-z]+)*\\.v(4\\.b32|2\\.b64)", ptx))

    for arch in (80, 90):
        for dt, acc in (("bf16", "fp32"), ("fp64", "fp64")):
            ACC = tl.float64 if acc == "fp64" else tl.float32
            vec = 8 if dt == "bf16" else 2
            for flag in (False, True):
                sig = {"logits_ptr": "*" + dt, "labels_ptr": "*i64", "row_max_ptr": "*" + acc,
                       "log_sum_ptr": "*" + acc, "logprob_ptr": "*" + acc,
                       "entropy_ptr": "*" + acc, "base_offset": "i32", "rows_per_batch": "i64", "batch_stride": "i64",
                       "row_stride": "i64", "vocab": "i32", "inv_t_hi": "fp32", "inv_t_mid": "fp32", "inv_t_lo": "fp32",
                       "WITH_ENTROPY": "constexpr", "ACC": "constexpr", "BLOCK_V": "constexpr",
                       "VEC": "constexpr", "THREADS": "constexpr", "ACCURATE_MATH": "constexpr"}
                ptx = build(rk._row_forward_kernel, sig, {"WITH_ENTROPY": flag, "ACC": ACC, "BLOCK_V": 4096,
                            "VEC": vec, "THREADS": 256, "ACCURATE_MATH": True}, arch)
                assert vector_ops(ptx, "ld") > 0, "row forward: no 16-byte loads"
                assert label_logit_loaded_first(build.ttir, {"bf16": "bf16", "fp64": "f64"}[dt]), \
                    "row forward: label's logit loaded after the loop"
                sig = {"logits_ptr": "*" + dt, "out_ptr": "*" + dt, "labels_ptr": "*i64",
                       "row_max_ptr": "*" + acc, "log_sum_ptr": "*" + acc, "logprob_ptr": "*" + acc,
                       "grad_ptr": "*" + acc, "grad_entropy_ptr": "*" + acc,
                       "entropy_ptr": "*" + acc, "logits_base_offset": "i32", "out_base_offset": "i32",
                       "rows_per_batch": "i64", "logits_batch_stride": "i64",
                       "logits_row_stride": "i64", "out_batch_stride": "i64",
                       "out_row_stride": "i64", "vocab": "i32", "inv_t_hi": "fp32",
                       "inv_t_mid": "fp32", "inv_t_lo": "fp32", "HAS_ENTROPY_GRAD": "constexpr",
                       "ACC": "constexpr", "BLOCK_V": "constexpr", "VEC": "constexpr", "THREADS": "constexpr",
                       "OUT_ALIGNED": "constexpr", "ACCURATE_MATH": "constexpr"}
                for out_aligned in (True, False):
                    ptx = build(rk._row_backward_kernel, sig, {"HAS_ENTROPY_GRAD": flag, "ACC": ACC,
                                "BLOCK_V": 4096, "VEC": vec, "THREADS": 256, "OUT_ALIGNED": out_aligned,
                                "ACCURATE_MATH": True}, arch)
                    assert vector_ops(ptx, "ld") > 0, "row backward: no 16-byte loads"
                    assert (vector_ops(ptx, "st") > 0) == out_aligned, "row backward: store width"
                names = ["token_logprobs_ptr", "seq_start_ptr", "seq_len_ptr", "group_offsets_ptr",
                         "group_members_ptr", "scores_ptr", "old_ptr", "log_weights_ptr", "ell_ptr", "u_ptr",
                         "p_ptr", "q_ptr", "group_loss_ptr"]
                sig = {n: "*i64" if n in names[1:5] else "*fp64" for n in names}
                sig["token_logprobs_ptr"] = "*" + acc
                sig.update({n: "fp32" for n in ("inv_eta_hi", "inv_eta_mid", "inv_eta_lo", "half_eps_hi",
                                                "half_eps_mid", "half_eps_lo")})
                sig.update({n: "constexpr" for n in ("HAS_OLD", "HAS_WEIGHTS", "ANCHOR", "BLOCK_K", "BLOCK_T")})
                for weights in (True, False):
                    build(gk._group_targets_kernel, sig, {"HAS_OLD": flag, "HAS_WEIGHTS": weights,
                          "ANCHOR": not flag, "BLOCK_K": 8, "BLOCK_T": 256}, arch)
    print("compiled")
    """
)


@needs_triton_nvidia_compiler
def test_kernels_compile_for_sm80_and_sm90():
    """The interpreter accepts some programs the compiler rejects: compile every kernel variant to
    a cubin (no GPU needed) with the interpreter switched off. Rows whose length is not a multiple
    of 16 still read (and, with out's rows aligned like the logits', write) 16 bytes at a time."""
    result = run_compiled_python("-c", _COMPILE_SCRIPT, timeout=300)
    assert "compiled" in result.stdout
