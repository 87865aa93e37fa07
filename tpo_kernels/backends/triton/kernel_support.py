"""What the Triton kernels of this backend share (row, candidate and group kernels alike).

Scalars at full precision: Triton types a float kernel argument as fp32, so a launcher passes a
float as three fp32 parts (:func:`split_scalar`) that a kernel adds up in its compute dtype
(``scalar_from_parts``). Accurate ``log1p`` / ``expm1``: from libdevice when compiled; the
interpreter (no libdevice) uses Kahan's forms over its exact numpy ``exp`` / ``log``
(``ACCURATE_MATH``, :func:`use_libdevice`). And the launch's device (:func:`device_guard`).
"""

from typing import Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from .. import triton_interpreter_enabled


def split_scalar(value: float) -> Tuple[float, float, float]:
    """Split a Python float into three fp32-exact parts whose sum is ``value`` to ~72 bits.

    Triton types a float kernel argument as fp32 (and the interpreter rounds Python floats to
    fp32), so an fp64 kernel would otherwise see a temperature or eta rounded to 24 bits.
    ``scalar_from_parts`` rebuilds the value in the compute dtype.
    """
    value = float(value)
    hi = float(torch.tensor(value, dtype=torch.float32))
    mid = float(torch.tensor(value - hi, dtype=torch.float32))
    lo = float(torch.tensor(value - hi - mid, dtype=torch.float32))
    return hi, mid, lo


@triton.jit
def scalar_from_parts(hi, mid, lo, ACC: tl.constexpr):
    return tl.cast(hi, ACC) + (tl.cast(mid, ACC) + tl.cast(lo, ACC))


def use_libdevice() -> bool:
    """The ACCURATE_MATH constexpr of the kernels: libdevice when compiled, not interpreted."""
    return not triton_interpreter_enabled()


@triton.jit
def log1p(x, ACCURATE_MATH: tl.constexpr):
    if ACCURATE_MATH:
        return libdevice.log1p(x)
    else:
        u = 1.0 + x
        den = tl.where(u == 1.0, 1.0, u - 1.0)
        return tl.where(u == 1.0, x, tl.log(u) * (x / den))


@triton.jit
def expm1(x, ACCURATE_MATH: tl.constexpr):
    if ACCURATE_MATH:
        return libdevice.expm1(x)
    else:
        u = tl.exp(x)
        log_u = tl.log(tl.where(u == 1.0, 2.0, u))
        out = (u - 1.0) * (x / tl.where(u == 1.0, 1.0, log_u))
        return tl.where(u == 1.0, x, tl.where(u - 1.0 == -1.0, -1.0, out))


def device_guard(tensor: Tensor):
    # Triton launches on the current CUDA device; make it the tensor's.
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    import contextlib

    return contextlib.nullcontext()
