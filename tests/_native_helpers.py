"""Helpers of the native-backend tests (test_cpu_extension.py, test_cuda_extension.py,
test_native_build.py): the backends and extension modules, where the built extensions lie,
random rows, float64 reference values and the tolerances. Which extensions and compilers are
present here: tests/_backends.py.

Tolerances. The CPU extension and the torch backend read the same logits and accumulate in the
same dtype (fp32; fp64 for fp64 logits), so they differ only by summation order and exp
implementation: fp32 per-row values agree to ~1e-6 relative (checked at rtol 2e-6 on lse, atol
1e-4 on entropies whose torch value comes from lse - sum p z), fp64 to 1e-12. bf16/fp16 inputs
are upcast exactly, so their per-row values get the fp32 tolerance; gradients written back in
bf16/fp16 may differ by one rounding step of the output format (rtol 2^-7 bf16 / 2^-10 fp16
plus a small atol). CUDA results get the same tolerances: there the vocabulary loops' exp2 is
ex2.approx.ftz.f32 (relative error up to 2^-22 per term), which moves a log-sum or an entropy by
at most 2^-22 times a factor of order one (computed for these tests' inputs: < 7e-7 absolute),
well inside them; on the host the same loops use exp2_f32 (about 1 ulp), checked here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tpo_kernels import backends

PACKAGE_DIR = Path(backends.__file__).resolve().parents[1]  # the tpo_kernels being tested

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def cpu_backend():
    from tpo_kernels.backends.cpu import CpuBackend

    return CpuBackend()


def cuda_backend():
    from tpo_kernels.backends.cuda import CudaBackend

    return CudaBackend()


def cpu_ext():
    from tpo_kernels import _C_cpu

    return _C_cpu


# ----------------------------------------------------------------------------------------------
# Rows and reference values
# ----------------------------------------------------------------------------------------------


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
