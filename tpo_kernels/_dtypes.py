"""Floating-point dtypes the package accepts, and the dtype its reductions run in."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64 (for gradcheck), every other dtype uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
