"""The C++ CPU extension (``tpo_kernels._C_cpu``, backend ``cpu``) against the torch backend and
plain float64 math: the shared row_math.h helpers, row forward / backward and
the binding's argument checks. Tolerances: see tests/_native_helpers.py."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from tpo_kernels.backends.rows import RowSummary, compute_dtype
from tpo_kernels.backends import get_backend
from tpo_kernels.backends import TorchBackend

from _backends import HAS_GPU, backend_available, needs_cpu, stats_logprob_entropy
from _native_helpers import (
    DTYPES,
    cpu_backend,
    cpu_ext,
    ent_tol,
    fwd_tol,
    grad_tol,
    make_rows,
    reference_rows,
)

TORCH = TorchBackend()


def cpu_isas():
    if not backend_available("cpu"):
        return ["default"]
    order = ["generic", "avx2", "avx512"]
    return order[: order.index(cpu_ext().isa()) + 1]


@pytest.fixture(params=cpu_isas())
def isa(request):
    """Runs a test once per instruction set the CPU supports (the kernels are compiled per ISA)."""
    if not backend_available("cpu"):
        yield request.param
        return
    ext = cpu_ext()
    previous = ext.isa()
    assert ext.set_isa(request.param) == request.param
    yield request.param
    ext.set_isa(previous)


def forward(backend, logits, labels, it=1.0, with_entropy=True):
    """The row op's ``RowSummary`` (the row-op contract)."""
    return backend.row_forward(logits, labels, inv_temperature=it, with_entropy=with_entropy)


def backward(backend, logits, labels, summary, g, out, it=1.0, ge=None):
    backend.row_backward(logits, labels, summary, g, grad_entropy=ge, inv_temperature=it, out=out)


def lse_of(stats, it=1.0):
    """The tempered logsumexp the row statistics stand for (float64)."""
    return stats[0].double() * it + stats[1].double()


# ----------------------------------------------------------------------------------------------
# Shared row_math.h helpers (the arithmetic the CUDA kernels use too)
# ----------------------------------------------------------------------------------------------


def math_op(op, x, out_dtype):
    y = torch.empty(x.shape, dtype=out_dtype)
    cpu_ext().math_elementwise(op, x.data_ptr(), y.data_ptr(), x.numel())
    return y


@needs_cpu
def test_exp2_f32_is_accurate():
    """The host exp2 of the vocabulary loops: about 1 ulp over its whole range (the device uses
    ex2.approx, 2^-22 relative)."""
    x = torch.cat([torch.linspace(-125.0, 127.99, 2_000_001), torch.randn(500_000) * 10,
                   torch.rand(500_000) - 0.5])
    y = math_op("exp2_f32", x, torch.float32).double()
    ref = torch.exp2(x.double())
    assert ((y - ref).abs() / ref).max().item() < 1.5e-7  # about 1 ulp of float32
    special = torch.tensor([float("nan"), float("-inf"), float("inf"), -126.0, -1000.0, 128.0, 1000.0, 0.0,
                            -1.0])
    out = math_op("exp2_f32", special, torch.float32)
    assert torch.isnan(out[0])
    assert out[1:].tolist() == [0.0, float("inf"), 0.0, 0.0, float("inf"), float("inf"), 1.0, 0.5]


@needs_cpu
@pytest.mark.parametrize("fmt", ["bf16", "half"])
def test_16bit_to_float_exhaustive(fmt):
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float16
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    got = math_op(f"{fmt}_to_float", bits, torch.float32)
    want = bits.view(dtype).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@needs_cpu
@pytest.mark.parametrize("fmt", ["bf16", "half"])
def test_float_to_16bit_rounds_to_nearest_even(fmt):
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float16
    g = torch.Generator().manual_seed(1)
    patterns = torch.randint(-(2 ** 31), 2 ** 31 - 1, (2_000_000,), generator=g, dtype=torch.int64)
    x = patterns.to(torch.int32).view(torch.float32)
    # Ties, subnormal / overflow boundaries and specials, where rounding bugs live.
    edges = torch.tensor(
        [0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 65536.0, 6.1e-5, 6.0e-8, 2.9e-8, 3.0e-8,
         1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 3.4e38, 1e-40,
         float("inf"), float("-inf")]
    )
    x = torch.cat([x, edges, -edges, torch.randn(100_000) * 1e4, torch.randn(100_000) * 1e-6])
    got = math_op(f"float_to_{fmt}", x, torch.int16)
    want = x.to(dtype).view(torch.int16)
    nan = torch.isnan(x)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.isnan(got[nan].view(dtype)).all()


# ----------------------------------------------------------------------------------------------
# Row forward
# ----------------------------------------------------------------------------------------------


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_forward_matches_torch_and_reference(dtype, temperature, isa):
    logits, labels = make_rows(29, 5003, dtype, skip=(4, 17))
    it = 1.0 / temperature
    summary = forward(cpu_backend(), logits, labels, it)
    stats, lp, entropy = stats_logprob_entropy(summary)
    t_summary = forward(TORCH, logits, labels, it)
    t_stats, t_lp, t_entropy = stats_logprob_entropy(t_summary)
    acc = compute_dtype(dtype)
    assert stats.dtype == lp.dtype == entropy.dtype == acc
    torch.testing.assert_close(stats[0], t_stats[0], rtol=0, atol=0)  # the max is exact
    torch.testing.assert_close(stats[1], t_stats[1], **fwd_tol(dtype))
    torch.testing.assert_close(lp, t_lp, **fwd_tol(dtype))
    torch.testing.assert_close(entropy, t_entropy, **ent_tol(dtype))
    r_lse, r_target, r_entropy = reference_rows(logits, labels, it)
    keep = labels >= 0
    torch.testing.assert_close(lse_of(stats, it)[keep], r_lse[keep], **fwd_tol(dtype))
    torch.testing.assert_close(lp.double(), r_target - r_lse, **fwd_tol(dtype))
    torch.testing.assert_close(entropy.double(), r_entropy, **fwd_tol(dtype))
    # Without entropy: same statistics and log-probs, no entropy tensor.
    summary2 = forward(cpu_backend(), logits, labels, it, with_entropy=False)
    stats2, lp2, none = stats_logprob_entropy(summary2)
    assert none is None
    assert torch.equal(stats2, stats) and torch.equal(lp2, lp)


@needs_cpu
def test_row_forward_skipped_rows_are_zero_and_not_read():
    logits, labels = make_rows(8, 300, torch.float32, skip=(1, 6))
    logits[1] = float("nan")
    logits[6] = float("inf")
    summary = forward(cpu_backend(), logits, labels)
    stats, lp, entropy = stats_logprob_entropy(summary)
    for t in (stats[0], stats[1], lp, entropy):
        assert t[1].item() == 0.0 and t[6].item() == 0.0
        assert torch.isfinite(t).all()


@needs_cpu
def test_row_forward_masked_vocab_and_nan(isa):
    logits, labels = make_rows(5, 10_000, torch.float32)
    logits[0, ::3] = float("-inf")  # masked vocab entries contribute exp(-inf) = 0
    logits[0, labels[0]] = 1.0
    logits[1, :9_000] = float("-inf")  # several all--inf chunks before finite values
    labels[1] = 9_500
    logits[2] = float("-inf")  # a fully masked row
    logits[3, 7] = float("nan")  # NaN must propagate, not vanish
    summary = forward(cpu_backend(), logits, labels)
    stats, lp, entropy = stats_logprob_entropy(summary)
    r_lse, r_target, r_entropy = reference_rows(logits, labels, 1.0)
    lse = lse_of(stats)
    for r in (0, 1):
        assert abs(lse[r].item() - r_lse[r].item()) < 1e-5
        assert abs(lp[r].item() - (r_target[r] - r_lse[r]).item()) < 1e-5
        assert abs(entropy[r].item() - r_entropy[r].item()) < 1e-6
    assert stats[0, 2].item() == float("-inf")  # no distribution: max -inf, the rest NaN
    assert torch.isnan(lp[2])
    assert torch.isnan(stats[1, 3]) and torch.isnan(lp[3]) and torch.isnan(entropy[3])
    assert torch.isfinite(stats[:, 4]).all() and torch.isfinite(entropy[4])


@needs_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["first", "label", "alone_in_masked_chunk", "last"])
def test_row_forward_nan_or_inf_logit_makes_the_row_nan(dtype, value, where, isa):
    """No NaN flag: the bad logit reaches the sums (2^(NaN - m), 2^(inf - inf)) and no max,
    rescale or chunk merge may make them finite again; the other rows are untouched."""
    logits, labels = make_rows(3, 9_000, dtype)  # three 4096-column chunks on the CPU
    labels[0] = 5_000
    column = {"first": 0, "label": 5_000, "alone_in_masked_chunk": 100, "last": 8_999}[where]
    if where == "alone_in_masked_chunk":
        logits[0, :4096] = float("-inf")  # the chunk's max is no finite logit
    logits[0, column] = value
    summary = forward(cpu_backend(), logits, labels)
    stats, lp, entropy = stats_logprob_entropy(summary)
    for name, t in (("row_max", stats[0]), ("log_sum", stats[1]), ("logprob", lp), ("entropy", entropy)):
        assert torch.isnan(t[0]), name
        assert torch.isfinite(t[1:]).all(), name
    r_lse, r_target, r_entropy = reference_rows(logits[1:], labels[1:], 1.0)
    torch.testing.assert_close(lp[1:].double(), r_target - r_lse, **fwd_tol(dtype))
    torch.testing.assert_close(entropy[1:].double(), r_entropy, **fwd_tol(dtype))


@needs_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_rows(dtype, isa):
    # Odd vocab over many chunks, large logits range.
    logits, labels = make_rows(16, 131_072 + 7, dtype, scale=8.0, skip=(3,))
    summary = forward(cpu_backend(), logits, labels)
    stats, lp, entropy = stats_logprob_entropy(summary)
    r_lse, r_target, r_entropy = reference_rows(logits, labels, 1.0)
    keep = labels >= 0
    torch.testing.assert_close(lse_of(stats)[keep], r_lse[keep], rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(lp.double(), r_target - r_lse, rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(entropy.double(), r_entropy, rtol=1e-5, atol=1e-5)
    g = torch.randn(16)
    out = torch.empty_like(logits)
    backward(cpu_backend(), logits, labels, summary, g, out)
    ref = torch.empty_like(logits)
    backward(TORCH, logits, labels, summary, g, ref)
    torch.testing.assert_close(out, ref, **grad_tol(dtype))


# ----------------------------------------------------------------------------------------------
# Row backward
# ----------------------------------------------------------------------------------------------


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_row_backward_matches_torch(dtype, with_entropy, isa):
    logits, labels = make_rows(23, 2051, dtype, skip=(2,))
    it = 1.0 / 0.8
    summary = forward(TORCH, logits, labels, it)
    acc = compute_dtype(dtype)
    g = torch.randn(23, dtype=acc)
    g[[5, 9]] = 0.0
    ge = torch.randn(23, dtype=acc) if with_entropy else None
    if ge is not None:
        ge[5] = 0.0
        ge[11] = 0.0
    got = torch.empty_like(logits)
    backward(cpu_backend(), logits, labels, summary, g, got, it, ge)
    want = torch.empty_like(logits)
    backward(TORCH, logits, labels, summary, g, want, it, ge)
    torch.testing.assert_close(got, want, **grad_tol(dtype))
    assert (got[5] == 0).all()


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_backward_in_place_equals_out_of_place(dtype, isa):
    logits, labels = make_rows(12, 4099, dtype, skip=(7,))
    summary = forward(cpu_backend(), logits, labels)
    acc = compute_dtype(dtype)
    g, ge = torch.randn(12, dtype=acc), torch.randn(12, dtype=acc)
    out = torch.empty_like(logits)
    backward(cpu_backend(), logits, labels, summary, g, out, ge=ge)
    buffer = logits.clone()
    backward(cpu_backend(), buffer, labels, summary, g, buffer, ge=ge)
    assert torch.equal(buffer, out)  # the label's entry comes from lp, not the overwritten logit


@needs_cpu
def test_zero_signal_rows_written_without_reading():
    logits, labels = make_rows(6, 999, torch.float32)
    logits[2] = float("nan")  # g == ge == 0 on this row: must not be read
    summary = forward(TORCH, logits, labels)
    g = torch.randn(6)
    ge = torch.randn(6)
    g[2] = 0.0
    ge[2] = 0.0
    out = torch.full_like(logits, 123.0)
    backward(cpu_backend(), logits, labels, summary, g, out, ge=ge)
    assert (out[2] == 0).all()
    assert torch.isfinite(out).all()


@needs_cpu
def test_backward_negative_label_has_no_onehot():
    logits, labels = make_rows(4, 100, torch.float64)
    summary = forward(cpu_backend(), logits, labels, with_entropy=False)
    labels[1] = -1
    g = torch.ones(4, dtype=torch.float64)
    out = torch.empty_like(logits)
    backward(cpu_backend(), logits, labels, summary, g, out)
    p = torch.softmax(logits[1], dim=0)
    torch.testing.assert_close(out[1], -p)


@needs_cpu
def test_masked_vocab_gradient_is_finite():
    logits, labels = make_rows(3, 500, torch.float32)
    logits[:, ::2] = float("-inf")
    labels[:] = 1
    summary = forward(cpu_backend(), logits, labels)
    out = torch.empty_like(logits)
    backward(cpu_backend(), logits, labels, summary, torch.ones(3), out, ge=torch.ones(3))
    assert torch.isfinite(out).all()
    assert (out[:, ::2] == 0).all()


@needs_cpu
def test_gradcheck_float64():
    backend = cpu_backend()

    class RowLogprob(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, labels, it):
            summary = backend.row_forward(logits, labels, inv_temperature=it, with_entropy=True)
            ctx.save_for_backward(logits, labels)
            ctx.summary, ctx.it = summary, it
            return summary.label_logprob, summary.entropy

        @staticmethod
        def backward(ctx, g, ge):
            logits, labels = ctx.saved_tensors
            skipped = labels < 0  # never read in forward: no gradient (as the orchestration does)
            g, ge = torch.where(skipped, 0.0, g), torch.where(skipped, 0.0, ge)
            out = torch.empty_like(logits)
            backend.row_backward(
                logits, labels, ctx.summary, g, grad_entropy=ge, inv_temperature=ctx.it, out=out
            )
            return out, None, None

    logits = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, -1, 10, 5])
    for it in (1.0, 1.0 / 0.6):
        assert torch.autograd.gradcheck(lambda z: RowLogprob.apply(z, labels, it), (logits,))


@needs_cpu
def test_non_contiguous_inputs():
    base, labels = make_rows(10, 1200, torch.float32)
    summary_ref = forward(TORCH, base, labels)
    stats_ref, lp_ref, ent_ref = stats_logprob_entropy(summary_ref)
    # Row-strided view (stride(0) > V): used as is. Transposed copy: needs .contiguous().
    wide = torch.randn(10, 1500)
    wide[:, :1200] = base
    strided = wide[:, :1200]
    transposed = base.t().contiguous().t()
    for view in (strided, transposed):
        summary = forward(cpu_backend(), view, labels)
        stats, lp, ent = stats_logprob_entropy(summary)
        torch.testing.assert_close(stats, stats_ref, **fwd_tol(torch.float32))
        torch.testing.assert_close(lp, lp_ref, **fwd_tol(torch.float32))
        torch.testing.assert_close(ent, ent_ref, **ent_tol(torch.float32))
    g = torch.randn(10)
    want = torch.empty_like(base)
    backward(TORCH, base, labels, summary_ref, g, want)
    # In place into each view: the result lands in the view itself.
    for view in (wide.clone()[:, :1200], base.t().contiguous().t()):
        backward(cpu_backend(), view, labels, summary_ref, g, view)
        torch.testing.assert_close(view, want, **grad_tol(torch.float32))
    # Per-row inputs of other dtypes / layouts are converted.
    out = torch.empty(10, 2400)[:, ::2]
    as_double = summary_ref.map(lambda t: t.double() if t.is_floating_point() else t)
    backward(cpu_backend(), base, labels.int(), as_double, g[None, :].t(), out)
    torch.testing.assert_close(out, want, **grad_tol(torch.float32))


@needs_cpu
def test_deterministic_and_thread_count():
    logits, labels = make_rows(64, 7000, torch.float32)
    a = forward(cpu_backend(), logits, labels)
    b = forward(cpu_backend(), logits, labels)
    for x, y in zip(stats_logprob_entropy(a), stats_logprob_entropy(b)):
        assert torch.equal(x, y)
    assert cpu_ext().max_threads() >= 1


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


@needs_cpu
def test_out_of_range_labels_follow_the_id_contract_on_every_isa(isa):
    """The binding does not check ids: each instruction set's copy of the row kernels guards the
    label itself (NaN forward for a label >= V, no one-hot term backward; the full contract on
    padded views is tests/test_id_bounds.py)."""
    logits, labels = make_rows(4, 50, torch.float32)
    bad = labels.clone()
    bad[2] = 50
    summary = forward(cpu_backend(), logits, bad)
    stats, lp, entropy = stats_logprob_entropy(summary)
    for out in (stats[0], stats[1], lp, entropy):
        assert torch.isnan(out[2]) and not torch.isnan(out[[0, 1, 3]]).any()
    out = torch.empty_like(logits)
    backward(cpu_backend(), logits, bad, summary.map(lambda t: t.nan_to_num() if t.is_floating_point() else t), torch.ones(4), out)
    assert torch.isfinite(out).all()
    # Row 2: -p (no one-hot term), with the statistics the forward would give for a valid label.
    valid_summary = forward(cpu_backend(), logits, labels)
    valid_stats, _, _ = stats_logprob_entropy(valid_summary)
    p = torch.exp(logits[2].double() - valid_stats[0, 2].double() - valid_stats[1, 2].double())
    out_valid_stats = torch.empty_like(logits)
    backward(cpu_backend(), logits, bad, dataclasses.replace(valid_summary, label_logprob=lp.nan_to_num()),
             torch.ones(4), out_valid_stats)
    torch.testing.assert_close(out_valid_stats[2].double(), -p, rtol=1e-5, atol=1e-7)


def _row_forward_kwargs():
    x = torch.randn(4, 8)
    lab = torch.zeros(4, dtype=torch.int64)
    out = torch.empty(4)
    keep = (x, lab, out)  # the caller holds these while the addresses are used
    kwargs = dict(dtype=0, rows=4, vocab=8, row_stride=8, logits=x.data_ptr(), labels=lab.data_ptr(),
                  inv_temperature=1.0, row_max=out.data_ptr(), log_sum=out.data_ptr(), logprob=out.data_ptr())
    return keep, kwargs


@needs_cpu
def test_binding_rejects_bad_arguments():
    ext = cpu_ext()
    keep, good = _row_forward_kwargs()
    ext.row_forward(**good)
    ext.row_forward(**good, entropy=0)  # an optional pointer may be 0 or left out
    for change, message in [
        ({"logits": 0}, "null"),
        ({"labels": 0}, "null"),
        ({"rows": -1}, "rows"),
        ({"vocab": 0}, "vocab"),
        ({"row_stride": 7}, "row_stride"),
        ({"dtype": 9}, "dtype"),
        ({"dtype": -1}, "dtype"),
        ({"inv_temperature": 0.0}, "inv_temperature"),
        ({"inv_temperature": float("nan")}, "inv_temperature"),
        ({"rows_per_batch": 3}, r"rows_per_batch \(3\) must be >= 1 and divide rows \(4\)"),
        ({"rows_per_batch": 0}, "rows_per_batch"),
        ({"rows_per_batch": 2, "batch_stride": -16}, "batch_stride must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            ext.row_forward(**{**good, **change})
    ext.row_forward(**good, rows_per_batch=2, batch_stride=16)  # the batch layout of [2, 2, 8]
    # Keyword arguments only, each named like its csrc/tpo_abi.h field, each of its type.
    for kwargs, message in [
        ({k: v for k, v in good.items() if k != "log_sum"}, "missing required keyword argument 'log_sum'"),
        ({**good, "entropyy": 0}, "unexpected keyword argument 'entropyy'"),
        ({**good, "rows": 4.0}, "rows must be an int"),
        ({**good, "rows_per_batch": 2.0}, "rows_per_batch must be an int"),
        ({**good, "dtype": True}, "dtype must be an int"),
        ({**good, "logits": None}, "logits must be an address"),
        ({**good, "logits": -8}, "non-negative address"),
        ({**good, "inv_temperature": "1"}, "inv_temperature must be a float"),
    ]:
        with pytest.raises(TypeError, match=message):
            ext.row_forward(**kwargs)
    with pytest.raises(TypeError):
        ext.row_forward(*good.values())
    # The other ops run the same shared checks.
    x, lab, out = keep
    with pytest.raises(ValueError, match="out_row_stride"):
        ext.row_backward(dtype=0, rows=4, vocab=8, row_stride=8, logits=x.data_ptr(), labels=lab.data_ptr(),
                         row_max=out.data_ptr(), log_sum=out.data_ptr(), logprob=out.data_ptr(),
                         grad_logprob=out.data_ptr(), inv_temperature=1.0, out=x.data_ptr(), out_row_stride=4)
    with pytest.raises(ValueError, match="grad_entropy needs entropy"):
        ext.row_backward(dtype=0, rows=4, vocab=8, row_stride=8, logits=x.data_ptr(), labels=lab.data_ptr(),
                         row_max=out.data_ptr(), log_sum=out.data_ptr(), logprob=out.data_ptr(),
                         grad_logprob=out.data_ptr(), grad_entropy=out.data_ptr(),
                         inv_temperature=1.0, out=x.data_ptr(), out_row_stride=8)
    # Python-side pointer-boundary checks.
    with pytest.raises(TypeError, match="float32, float16, bfloat16 or float64"):
        forward(cpu_backend(), x.int(), lab, with_entropy=False)
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        forward(cpu_backend(), x, lab.float(), with_entropy=False)
    with pytest.raises(ValueError, match="one per row"):
        forward(cpu_backend(), x, lab[:3], with_entropy=False)
    summary = RowSummary.zeros(4, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="grad_entropy needs the forward's entropy"):
        backward(cpu_backend(), x, lab, summary, out, torch.empty_like(x), ge=out)
    with pytest.raises(ValueError, match="out must have the logits' shape"):
        backward(cpu_backend(), x, lab, summary, out, torch.empty(4, 9))
    with pytest.raises(ValueError, match=r"summary.row_max must have 4 elements \(one per row\)"):
        backward(cpu_backend(), x, lab, dataclasses.replace(summary, row_max=torch.zeros(3)), out, torch.empty_like(x))
    with pytest.raises(ValueError, match="CPU tensors|cpu"):
        if HAS_GPU:
            forward(cpu_backend(), x.cuda(), lab.cuda(), with_entropy=False)
        else:
            raise ValueError("cpu")


@needs_cpu
def test_empty_inputs():
    logits = torch.empty(0, 10)
    labels = torch.empty(0, dtype=torch.int64)
    summary = forward(cpu_backend(), logits, labels)
    stats, lp, entropy = stats_logprob_entropy(summary)
    assert stats.shape == (2, 0) and lp.shape == entropy.shape == (0,)
    backward(cpu_backend(), logits, labels, summary, lp, logits)


@needs_cpu
def test_backend_status_and_auto():
    backend = get_backend("cpu", torch.device("cpu"))
    assert backend.name == "cpu" and backend.unavailable_reason() is None
    assert backend.supports_device(torch.device("cpu"))
    assert not backend.supports_device(torch.device("cuda", 0))
    assert get_backend("auto", torch.device("cpu")).name == "cpu"


@pytest.mark.slow
@needs_cpu
@pytest.mark.skipif(os.environ.get("TPO_PERF_TESTS", "0") == "0", reason="set TPO_PERF_TESTS=1")
def test_faster_than_eager():
    """fwd+bwd at M=8192, V=32768 fp32 (4 GiB of eager temporaries): >= 2x over eager PyTorch."""
    m, v = 8192, 32768
    base = torch.randn(m, v)
    labels = torch.randint(0, v, (m,))
    g = torch.randn(m)

    def eager():
        x = base.clone().requires_grad_()
        t0 = time.perf_counter()
        lp = torch.log_softmax(x, -1).gather(1, labels[:, None]).squeeze(1)
        (lp * g).sum().backward()
        return time.perf_counter() - t0

    def native():
        x = base.clone()
        t0 = time.perf_counter()
        summary = forward(cpu_backend(), x, labels, with_entropy=False)
        backward(cpu_backend(), x, labels, summary, g, x)
        return time.perf_counter() - t0

    eager_s = sorted(eager() for _ in range(3))[1]
    native_s = sorted(native() for _ in range(3))[1]
    print(f"eager {eager_s:.3f}s native {native_s:.3f}s ratio {eager_s / native_s:.2f}")
    assert eager_s / native_s >= 2.0
