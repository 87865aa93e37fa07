"""Native backends (issue 5): the C++ CPU row ops and the CUDA kernels against the torch backend
and plain float64 math, plus the shared row_math.h helpers, the bindings' safety checks and the
build products.

Tolerances. The CPU extension and the torch backend read the same logits and accumulate in the
same dtype (fp32; fp64 for fp64 logits), so they differ only by summation order and exp
implementation: fp32 per-row values agree to ~1e-6 relative (checked at rtol 2e-6 on lse, atol
1e-4 on entropies whose torch value comes from lse - sum p z), fp64 to 1e-12. bf16/fp16 inputs
are upcast exactly, so their per-row values get the fp32 tolerance; gradients written back in
bf16/fp16 may differ by one rounding step of the output format (rtol 2^-7 bf16 / 2^-10 fp16
plus a small atol). CUDA results get the same tolerances.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

import tpo_kernels
from tpo_kernels.backends import Backend, backend_status, compute_dtype
from tpo_kernels.backends.pytorch import TorchBackend
from tpo_kernels.layout import build_layout
from tpo_kernels.targets import group_targets as torch_group_targets

CPU_OK = backend_status()["cpu"] == "available"
needs_cpu_ext = pytest.mark.skipif(not CPU_OK, reason=f"cpu backend: {backend_status()['cpu']}")
HAS_GPU = torch.cuda.is_available()
CUDA_OK = backend_status()["cuda"] == "available"
needs_cuda = pytest.mark.skipif(not CUDA_OK, reason=f"cuda backend: {backend_status()['cuda']}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
TORCH = TorchBackend()


def cpu_backend():
    from tpo_kernels.backends.cpu import CpuBackend

    return CpuBackend()


def cuda_backend():
    from tpo_kernels.backends.cuda import CudaBackend

    return CudaBackend()


def cpu_ext():
    from tpo_kernels import _C_cpu

    return _C_cpu


def fwd_tol(dtype):
    return dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-6, atol=2e-5)


def ent_tol(dtype):
    return dict(rtol=1e-12, atol=1e-11) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-4)


def grad_tol(dtype):
    return {
        torch.float64: dict(rtol=1e-11, atol=1e-13),
        torch.float32: dict(rtol=1e-5, atol=1e-7),
        torch.bfloat16: dict(rtol=2 ** -7, atol=1e-5),
        torch.float16: dict(rtol=2 ** -10, atol=1e-6),
    }[dtype]


def make_rows(rows, vocab, dtype, device="cpu", scale=3.0, skip=()):
    logits = (torch.randn(rows, vocab, dtype=torch.float64) * scale).to(dtype).to(device)
    labels = torch.randint(0, vocab, (rows,), device=device)
    for r in skip:
        labels[r] = -100
    return logits, labels


def reference_rows(logits, labels, inv_t):
    """float64 lse, target logit and entropy from plain math on the same (rounded) inputs."""
    z = logits.double() * inv_t
    lse = torch.logsumexp(z, dim=1)
    entropy = torch.special.entr(torch.exp(z - lse[:, None])).sum(dim=1)  # 0 log 0 = 0
    target = z.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    skipped = labels < 0
    zero = torch.zeros((), dtype=torch.float64, device=logits.device)
    return (torch.where(skipped, zero, lse), torch.where(skipped, zero, target), torch.where(skipped, zero, entropy))


def cpu_isas():
    if not CPU_OK:
        return ["default"]
    ext = cpu_ext()
    best = ext.isa()
    order = ["generic", "avx2", "avx512"]
    return order[: order.index(best) + 1]


@pytest.fixture(params=cpu_isas())
def isa(request):
    """Runs a test once per instruction set the CPU supports (the kernels are compiled per ISA)."""
    if not CPU_OK:
        yield request.param
        return
    ext = cpu_ext()
    previous = ext.isa()
    assert ext.set_isa(request.param) == request.param
    yield request.param
    ext.set_isa(previous)


# ----------------------------------------------------------------------------------------------
# Shared row_math.h helpers (the arithmetic the CUDA kernels use too)
# ----------------------------------------------------------------------------------------------


def math_op(op, x, out_dtype):
    y = torch.empty(x.shape, dtype=out_dtype)
    cpu_ext().math_elementwise(op, x.data_ptr(), y.data_ptr(), x.numel())
    return y


@needs_cpu_ext
def test_exp_f32_is_accurate():
    x = torch.cat([torch.linspace(-86.0, 88.7, 2_000_001), torch.randn(500_000)])
    y = math_op("exp_f32", x, torch.float32).double()
    ref = torch.exp(x.double())
    assert ((y - ref).abs() / ref).max().item() < 1.5e-7  # about 1 ulp of float32
    special = torch.tensor([float("nan"), float("-inf"), float("inf"), -1000.0, 1000.0, 0.0])
    out = math_op("exp_f32", special, torch.float32)
    assert torch.isnan(out[0])
    assert out[1:].tolist() == [0.0, float("inf"), 0.0, float("inf"), 1.0]


@needs_cpu_ext
@pytest.mark.parametrize("fmt", ["bf16", "half"])
def test_16bit_to_float_exhaustive(fmt):
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float16
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    got = math_op(f"{fmt}_to_float", bits, torch.float32)
    want = bits.view(dtype).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@needs_cpu_ext
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
# CPU row forward
# ----------------------------------------------------------------------------------------------


@needs_cpu_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cpu_row_forward_matches_torch_and_reference(dtype, temperature, isa):
    logits, labels = make_rows(29, 5003, dtype, skip=(4, 17))
    it = 1.0 / temperature
    lse, target, entropy = cpu_backend().row_forward(logits, labels, it, True)
    t_lse, t_target, t_entropy = TORCH.row_forward(logits, labels, it, True)
    acc = compute_dtype(dtype)
    assert lse.dtype == target.dtype == entropy.dtype == acc
    torch.testing.assert_close(lse, t_lse, **fwd_tol(dtype))
    torch.testing.assert_close(target, t_target, rtol=0, atol=0)
    torch.testing.assert_close(entropy, t_entropy, **ent_tol(dtype))
    r_lse, r_target, r_entropy = reference_rows(logits, labels, it)
    torch.testing.assert_close(lse.double(), r_lse, **fwd_tol(dtype))
    torch.testing.assert_close(target.double(), r_target, **fwd_tol(dtype))
    # Against float64 math the entropy is tight too (the torch backend's form cancels).
    torch.testing.assert_close(entropy.double(), r_entropy, **fwd_tol(dtype))
    # Without entropy: same lse / target, no entropy tensor.
    lse2, target2, none = cpu_backend().row_forward(logits, labels, it, False)
    assert none is None
    assert torch.equal(lse2, lse) and torch.equal(target2, target)


@needs_cpu_ext
def test_cpu_row_forward_skipped_rows_are_zero_and_not_read():
    logits, labels = make_rows(8, 300, torch.float32, skip=(1, 6))
    logits[1] = float("nan")
    logits[6] = float("inf")
    lse, target, entropy = cpu_backend().row_forward(logits, labels, 1.0, True)
    for t in (lse, target, entropy):
        assert t[1].item() == 0.0 and t[6].item() == 0.0
        assert torch.isfinite(t).all()


@needs_cpu_ext
def test_cpu_row_forward_masked_vocab_and_nan(isa):
    logits, labels = make_rows(5, 10_000, torch.float32)
    logits[0, ::3] = float("-inf")  # masked vocab entries contribute exp(-inf) = 0
    logits[0, labels[0]] = 1.0
    logits[1, :9_000] = float("-inf")  # several all--inf chunks before finite values
    labels[1] = 9_500
    logits[2] = float("-inf")  # a fully masked row
    logits[3, 7] = float("nan")  # NaN must propagate, not vanish
    lse, target, entropy = cpu_backend().row_forward(logits, labels, 1.0, True)
    r_lse, _, r_entropy = reference_rows(logits, labels, 1.0)
    for r in (0, 1):
        assert abs(lse[r].item() - r_lse[r].item()) < 1e-5
        assert abs(entropy[r].item() - r_entropy[r].item()) < 1e-4
    assert lse[2].item() == float("-inf")
    assert torch.isnan(lse[3]) and torch.isnan(entropy[3])
    assert torch.isfinite(lse[4]) and torch.isfinite(entropy[4])


@needs_cpu_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_large_rows(dtype, isa):
    # Odd vocab over many chunks, large logits range.
    logits, labels = make_rows(16, 131_072 + 7, dtype, scale=8.0, skip=(3,))
    lse, target, entropy = cpu_backend().row_forward(logits, labels, 1.0, True)
    r_lse, r_target, r_entropy = reference_rows(logits, labels, 1.0)
    torch.testing.assert_close(lse.double(), r_lse, rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(entropy.double(), r_entropy, rtol=1e-5, atol=1e-4)
    g = torch.randn(16)
    out = torch.empty_like(logits)
    cpu_backend().row_backward(logits, labels, lse, g, None, None, 1.0, out)
    ref = torch.empty_like(logits)
    TORCH.row_backward(logits, labels, lse, g, None, None, 1.0, ref)
    torch.testing.assert_close(out, ref, **grad_tol(dtype))


# ----------------------------------------------------------------------------------------------
# CPU row backward
# ----------------------------------------------------------------------------------------------


@needs_cpu_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_cpu_row_backward_matches_torch(dtype, with_entropy, isa):
    logits, labels = make_rows(23, 2051, dtype, skip=(2,))
    it = 1.0 / 0.8
    lse, _, entropy = TORCH.row_forward(logits, labels, it, True)
    acc = compute_dtype(dtype)
    g = torch.randn(23, dtype=acc)
    g[[5, 9]] = 0.0
    ge = torch.randn(23, dtype=acc) if with_entropy else None
    if ge is not None:
        ge[5] = 0.0
        ge[11] = 0.0
    got = torch.empty_like(logits)
    cpu_backend().row_backward(logits, labels, lse, g, ge, entropy if with_entropy else None, it, got)
    want = torch.empty_like(logits)
    TORCH.row_backward(logits, labels, lse, g, ge, entropy if with_entropy else None, it, want)
    torch.testing.assert_close(got, want, **grad_tol(dtype))
    assert (got[5] == 0).all()


@needs_cpu_ext
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_row_backward_in_place_equals_out_of_place(dtype, isa):
    logits, labels = make_rows(12, 4099, dtype, skip=(7,))
    lse, _, entropy = cpu_backend().row_forward(logits, labels, 1.0, True)
    acc = compute_dtype(dtype)
    g, ge = torch.randn(12, dtype=acc), torch.randn(12, dtype=acc)
    out = torch.empty_like(logits)
    cpu_backend().row_backward(logits, labels, lse, g, ge, entropy, 1.0, out)
    buffer = logits.clone()
    cpu_backend().row_backward(buffer, labels, lse, g, ge, entropy, 1.0, buffer)
    assert torch.equal(buffer, out)  # the label's logit is read before it is overwritten


@needs_cpu_ext
def test_cpu_zero_signal_rows_written_without_reading():
    logits, labels = make_rows(6, 999, torch.float32)
    logits[2] = float("nan")  # g == ge == 0 on this row: must not be read
    lse, _, entropy = TORCH.row_forward(logits, labels, 1.0, True)
    g = torch.randn(6)
    ge = torch.randn(6)
    g[2] = 0.0
    ge[2] = 0.0
    out = torch.full_like(logits, 123.0)
    cpu_backend().row_backward(logits, labels, lse, g, ge, entropy, 1.0, out)
    assert (out[2] == 0).all()
    assert torch.isfinite(out).all()


@needs_cpu_ext
def test_cpu_backward_negative_label_has_no_onehot():
    logits, labels = make_rows(4, 100, torch.float64)
    lse, _, _ = cpu_backend().row_forward(logits, labels, 1.0, False)
    labels[1] = -1
    g = torch.ones(4, dtype=torch.float64)
    out = torch.empty_like(logits)
    cpu_backend().row_backward(logits, labels, lse, g, None, None, 1.0, out)
    p = torch.softmax(logits[1], dim=0)
    torch.testing.assert_close(out[1], -p)


@needs_cpu_ext
def test_cpu_masked_vocab_gradient_is_finite():
    logits, labels = make_rows(3, 500, torch.float32)
    logits[:, ::2] = float("-inf")
    labels[:] = 1
    lse, _, entropy = cpu_backend().row_forward(logits, labels, 1.0, True)
    out = torch.empty_like(logits)
    cpu_backend().row_backward(logits, labels, lse, torch.ones(3), torch.ones(3), entropy, 1.0, out)
    assert torch.isfinite(out).all()
    assert (out[:, ::2] == 0).all()


@needs_cpu_ext
def test_cpu_gradcheck_float64():
    backend = cpu_backend()

    class RowLogprob(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, labels, it):
            lse, target, entropy = backend.row_forward(logits, labels, it, True)
            ctx.save_for_backward(logits, labels, lse, entropy)
            ctx.it = it
            return target - lse, entropy

        @staticmethod
        def backward(ctx, g, ge):
            logits, labels, lse, entropy = ctx.saved_tensors
            skipped = labels < 0  # never read in forward: no gradient (as the orchestration does)
            g, ge = torch.where(skipped, 0.0, g), torch.where(skipped, 0.0, ge)
            out = torch.empty_like(logits)
            backend.row_backward(logits, labels, lse, g, ge, entropy, ctx.it, out)
            return out, None, None

    logits = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, -1, 10, 5])
    for it in (1.0, 1.0 / 0.6):
        assert torch.autograd.gradcheck(lambda z: RowLogprob.apply(z, labels, it), (logits,))


@needs_cpu_ext
def test_cpu_non_contiguous_inputs():
    base, labels = make_rows(10, 1200, torch.float32)
    lse_ref, target_ref, ent_ref = TORCH.row_forward(base, labels, 1.0, True)
    # Row-strided view (stride(0) > V): used as is. Transposed copy: needs .contiguous().
    wide = torch.randn(10, 1500)
    wide[:, :1200] = base
    strided = wide[:, :1200]
    transposed = base.t().contiguous().t()
    for view in (strided, transposed):
        lse, target, ent = cpu_backend().row_forward(view, labels, 1.0, True)
        torch.testing.assert_close(lse, lse_ref, **fwd_tol(torch.float32))
        torch.testing.assert_close(target, target_ref)
        torch.testing.assert_close(ent, ent_ref, **ent_tol(torch.float32))
    g = torch.randn(10)
    want = torch.empty_like(base)
    TORCH.row_backward(base, labels, lse_ref, g, None, None, 1.0, want)
    # In place into each view: the result lands in the view itself.
    for view in (wide.clone()[:, :1200], base.t().contiguous().t()):
        cpu_backend().row_backward(view, labels, lse_ref, g, None, None, 1.0, view)
        torch.testing.assert_close(view, want, **grad_tol(torch.float32))
    # Per-row inputs of other dtypes / layouts are converted.
    out = torch.empty(10, 2400)[:, ::2]
    cpu_backend().row_backward(base, labels.int(), lse_ref.double(), g[None, :].t(), None, None, 1.0, out)
    torch.testing.assert_close(out, want, **grad_tol(torch.float32))


@needs_cpu_ext
def test_cpu_deterministic_and_thread_count():
    logits, labels = make_rows(64, 7000, torch.float32)
    a = cpu_backend().row_forward(logits, labels, 1.0, True)
    b = cpu_backend().row_forward(logits, labels, 1.0, True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert cpu_ext().max_threads() >= 1


# ----------------------------------------------------------------------------------------------
# CPU candidate ops and bad input
# ----------------------------------------------------------------------------------------------


@needs_cpu_ext
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_candidate_ops_match_base(dtype):
    logits, _ = make_rows(9, 300, dtype)
    cand = torch.randint(0, 300, (9, 6))
    cand[0] = torch.tensor([5, 5, 7, 5, 7, 9])  # duplicates accumulate in ascending k order
    it = 1.0 / 0.9
    got = cpu_backend().candidate_forward(logits, cand, it)
    want = Backend.candidate_forward(TORCH, logits, cand, it)
    assert got.dtype == want.dtype and torch.equal(got, want)
    grad = torch.randn(9, 6, dtype=compute_dtype(dtype))
    out_got = torch.full_like(logits, 7.0)
    cpu_backend().candidate_backward(grad, cand, it, out_got)
    out_want = torch.empty_like(logits)
    Backend.candidate_backward(TORCH, grad, cand, it, out_want)
    assert torch.equal(out_got, out_want)


@needs_cpu_ext
def test_cpu_rejects_out_of_range_ids():
    logits, labels = make_rows(4, 50, torch.float32)
    bad = labels.clone()
    bad[2] = 50
    with pytest.raises(ValueError, match=r"labels\[2\] = 50"):
        cpu_backend().row_forward(logits, bad, 1.0, False)
    lse, _, _ = cpu_backend().row_forward(logits, labels, 1.0, False)
    before = logits.clone()
    with pytest.raises(ValueError, match="labels"):
        cpu_backend().row_backward(logits, bad, lse, torch.ones(4), None, None, 1.0, logits)
    assert torch.equal(logits, before)  # nothing written
    cand = torch.randint(0, 50, (4, 3))
    cand[1, 2] = -1
    with pytest.raises(ValueError, match="candidates"):
        cpu_backend().candidate_forward(logits, cand, 1.0)
    cand[1, 2] = 99
    with pytest.raises(ValueError, match="candidates"):
        cpu_backend().candidate_backward(torch.ones(4, 3), cand, 1.0, torch.empty_like(logits))


@needs_cpu_ext
def test_cpu_bindings_reject_bad_arguments():
    ext = cpu_ext()
    x = torch.randn(4, 8)
    lab = torch.zeros(4, dtype=torch.int64)
    out = torch.empty(4)
    good = dict(logits=x.data_ptr(), dtype=0, rows=4, vocab=8, row_stride=8, labels=lab.data_ptr(),
                inv_temperature=1.0, lse=out.data_ptr(), target=out.data_ptr(), entropy=0)
    ext.row_forward(**good)
    for change, message in [
        ({"logits": 0}, "null"),
        ({"labels": 0}, "null"),
        ({"rows": -1}, "rows"),
        ({"vocab": 0}, "vocab"),
        ({"row_stride": 7}, "row_stride"),
        ({"dtype": 9}, "dtype"),
        ({"inv_temperature": 0.0}, "inv_temperature"),
        ({"inv_temperature": float("nan")}, "inv_temperature"),
    ]:
        with pytest.raises(ValueError, match=message):
            ext.row_forward(**{**good, **change})
    with pytest.raises(TypeError, match="float32, float16, bfloat16 or float64"):
        cpu_backend().row_forward(x.int(), lab, 1.0, False)
    with pytest.raises(ValueError, match="CPU tensors|cpu"):
        if HAS_GPU:
            cpu_backend().row_forward(x.cuda(), lab.cuda(), 1.0, False)
        else:
            raise ValueError("cpu")


@needs_cpu_ext
def test_cpu_empty_inputs():
    logits = torch.empty(0, 10)
    labels = torch.empty(0, dtype=torch.int64)
    lse, target, entropy = cpu_backend().row_forward(logits, labels, 1.0, True)
    assert lse.shape == target.shape == entropy.shape == (0,)
    cpu_backend().row_backward(logits, labels, lse, lse, None, None, 1.0, logits)


@needs_cpu_ext
def test_cpu_backend_status_and_auto():
    from tpo_kernels.backends import get_backend

    backend = get_backend("cpu", torch.device("cpu"))
    assert backend.name == "cpu" and backend.unavailable_reason() is None
    assert backend.supports_device(torch.device("cpu"))
    assert not backend.supports_device(torch.device("cuda", 0))
    assert get_backend("auto", torch.device("cpu")).name == "cpu"


@pytest.mark.slow
@needs_cpu_ext
@pytest.mark.skipif(os.environ.get("TPO_PERF_TESTS", "0") == "0", reason="set TPO_PERF_TESTS=1")
def test_cpu_faster_than_eager():
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
        lse, _, _ = cpu_backend().row_forward(x, labels, 1.0, False)
        cpu_backend().row_backward(x, labels, lse, g, None, None, 1.0, x)
        return time.perf_counter() - t0

    eager_s = sorted(eager() for _ in range(3))[1]
    native_s = sorted(native() for _ in range(3))[1]
    print(f"eager {eager_s:.3f}s native {native_s:.3f}s ratio {eager_s / native_s:.2f}")
    assert eager_s / native_s >= 2.0


# ----------------------------------------------------------------------------------------------
# Build products
# ----------------------------------------------------------------------------------------------


def _find_nvcc():
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand):
            return cand
    return None


def test_cpu_extension_built():
    pkg = Path(tpo_kernels.__file__).parent
    assert list(pkg.glob("_C_cpu*.so")) or list(pkg.glob("_C_cpu*.pyd")), backend_status()["cpu"]
    assert CPU_OK, backend_status()["cpu"]


@pytest.mark.skipif(_find_nvcc() is None, reason="nvcc not found: the CUDA extension is not built")
@pytest.mark.skipif(os.environ.get("TPO_SKIP_CUDA", "0") not in ("", "0"), reason="TPO_SKIP_CUDA set")
def test_cuda_extension_built_when_nvcc_present():
    pkg = Path(tpo_kernels.__file__).parent
    assert list(pkg.glob("_C_cuda*.so")), "nvcc is present but tpo_kernels/_C_cuda*.so was not built"
    try:
        from tpo_kernels import _C_cuda
    except ImportError as exc:  # pragma: no cover - e.g. a loader without libcuda support
        pytest.skip(f"built but not importable here: {exc}")
    assert _C_cuda.device_count() >= 0
    reason = backend_status()["cuda"]
    if HAS_GPU:
        assert reason == "available"
    else:
        assert reason == "built, but no CUDA device"


# ----------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ----------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1000, 32_003, 151_936])
def test_cuda_row_forward_backward_match_torch(dtype, vocab):
    logits, labels = make_rows(33, vocab, dtype, device="cuda", skip=(3,))
    it = 1.0 / 0.7
    be = cuda_backend()
    lse, target, entropy = be.row_forward(logits, labels, it, True)
    t_lse, t_target, t_entropy = TORCH.row_forward(logits, labels, it, True)
    torch.testing.assert_close(lse, t_lse, **fwd_tol(dtype))
    torch.testing.assert_close(target, t_target, **fwd_tol(dtype))
    torch.testing.assert_close(entropy, t_entropy, **ent_tol(dtype))
    acc = compute_dtype(dtype)
    g = torch.randn(33, dtype=acc, device="cuda")
    ge = torch.randn(33, dtype=acc, device="cuda")
    g[7] = ge[7] = 0.0
    for ge_arg in (None, ge):
        want = torch.empty_like(logits)
        TORCH.row_backward(logits, labels, t_lse, g, ge_arg, t_entropy, it, want)
        got = torch.empty_like(logits)
        be.row_backward(logits, labels, t_lse, g, ge_arg, t_entropy, it, got)
        torch.testing.assert_close(got, want, **grad_tol(dtype))
        in_place = logits.clone()
        be.row_backward(in_place, labels, t_lse, g, ge_arg, t_entropy, it, in_place)
        assert torch.equal(in_place, got)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_misaligned_rows_and_zero_rows(dtype):
    # Offset by one element and an odd vocab: every row starts at a different alignment.
    storage, _ = make_rows(1, 17 * 4097 + 1, dtype, device="cuda")
    logits = storage.view(-1)[1 : 1 + 17 * 4097].view(17, 4097)
    labels = torch.randint(0, 4097, (17,), device="cuda")
    logits[4] = float("nan")  # zero-signal row: never read
    lse, _, _ = TORCH.row_forward(logits, labels, 1.0, False)
    got_lse, _, _ = cuda_backend().row_forward(logits, labels, 1.0, False)
    keep = torch.arange(17, device="cuda") != 4
    torch.testing.assert_close(got_lse[keep], lse[keep], **fwd_tol(dtype))
    g = torch.randn(17, device="cuda")
    g[4] = 0.0
    want = torch.empty_like(logits)
    TORCH.row_backward(logits, labels, lse, g, None, None, 1.0, want)
    cuda_backend().row_backward(logits, labels, lse, g, None, None, 1.0, logits)  # in place
    torch.testing.assert_close(logits[keep], want[keep], **grad_tol(dtype))
    assert (logits[4] == 0).all()


@needs_cuda
def test_cuda_skipped_rows_and_invalid_labels_are_not_read():
    logits, labels = make_rows(6, 777, torch.float32, device="cuda", skip=(2,))
    logits[2] = float("nan")
    labels[4] = 777  # out of range: never dereferenced, reported as NaN
    lse, target, entropy = cuda_backend().row_forward(logits, labels, 1.0, True)
    assert lse[2].item() == target[2].item() == entropy[2].item() == 0.0
    assert torch.isnan(lse[4]) and torch.isnan(target[4])


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_candidate_ops_match_base_and_are_deterministic(dtype):
    logits, _ = make_rows(300, 5000, dtype, device="cuda")
    cand = torch.randint(0, 40, (300, 8), device="cuda")  # many duplicates
    grad = torch.randn(300, 8, dtype=compute_dtype(dtype), device="cuda")
    be = cuda_backend()
    got = be.candidate_forward(logits, cand, 1.3)
    assert torch.equal(got, Backend.candidate_forward(TORCH, logits, cand, 1.3))
    outs = []
    for _ in range(2):
        out = torch.full_like(logits, 5.0)
        be.candidate_backward(grad, cand, 1.3, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    want = torch.empty_like(logits)
    Backend.candidate_backward(TORCH, grad, cand, 1.3, want)
    torch.testing.assert_close(outs[0], want, **grad_tol(dtype))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grouping", ["contiguous", "ids", "packed"])
@pytest.mark.parametrize("anchor", [True, False])
def test_cuda_group_op_matches_torch(dtype, grouping, anchor):
    n, t = 12, 37
    device = torch.device("cuda")
    if grouping == "packed":
        lens = torch.randint(1, 40, (n,))
        cu = torch.zeros(n + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lens, 0)
        m = int(cu[-1]) + 5  # trailing rows outside every completion
        layout = build_layout(m, device, cu_seqlens=cu.to(device), group_size=4)
    elif grouping == "ids":
        m = n * t
        ids = torch.tensor([3, 1, 3, 2, 1, 1, 2, 3, 9, 9, 1, 2], device=device)
        layout = build_layout(m, device, padded_shape=(n, t), group_ids=ids)
    else:
        m = n * t
        layout = build_layout(m, device, padded_shape=(n, t), group_size=4)
    tokens = -torch.rand(m, dtype=dtype, device=device)
    scores = torch.randn(n, dtype=dtype, device=device)
    scores[:4] = 1.0  # a tied group (contiguous) / some ties elsewhere
    old = tokens.new_empty(n).uniform_(-30, -10)
    for old_arg in (None, old):
        for reduction in ("mean", "sum", "none"):
            got = cuda_backend().group_targets(tokens, layout, scores, old_arg, 0.7, anchor, reduction)
            want = torch_group_targets(tokens, layout, scores, old_arg, 0.7, anchor, reduction)
            tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
            for name in ("seq_logprobs", "u", "p", "q", "group_loss", "coef"):
                torch.testing.assert_close(getattr(got, name), getattr(want, name), **tol, msg=name)
    if grouping == "contiguous":
        on_policy = cuda_backend().group_targets(tokens, layout, scores, None, 0.7, True, "mean")
        assert (on_policy.coef[:4] == 0).all()  # tied on-policy group: exactly zero
        assert torch.equal(on_policy.p[:4], on_policy.q[:4])


@needs_cuda
def test_cuda_runs_on_the_current_stream():
    logits, labels = make_rows(64, 20_000, torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        lse, _, _ = cuda_backend().row_forward(logits, labels, 1.0, False)
    side.synchronize()
    t_lse, _, _ = TORCH.row_forward(logits, labels, 1.0, False)
    torch.testing.assert_close(lse, t_lse, **fwd_tol(torch.bfloat16))
