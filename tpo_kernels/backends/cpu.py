"""CPU backend: the C++ row ops of ``tpo_kernels._C_cpu`` (csrc/cpu, threads over rows).

Every call passes ``num_threads=torch.get_num_threads()``: the row ops run on at most that many
threads (the caller and the extension's own helpers, which sleep between calls), so
``torch.set_num_threads`` governs them as it does PyTorch's ops; a call under ATen's grain (32768
elements per thread) runs on the calling thread alone, as PyTorch's own ops do. Why they do not
use OpenMP threads (they collapsed on a loaded machine): csrc/cpu/parallel.h.

The tensor preparation shared with the CUDA backend lives in :mod:`.native`; the extension
functions take no other launch arguments. The group op is the portable PyTorch one. Of the
kept-set ops (sampling-mask replay), the fused head's dot products run in the extension
(``kept_linear_forward``: no ``[P, H]`` gathers); the others are the PyTorch defaults.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from . import torch_kept
from .kept_sets import KeptSets
from .native import NativeBackend, as_rows, dtype_code, ptr
from .row_summary import compute_dtype


class CpuBackend(NativeBackend):
    name = "cpu"

    @staticmethod
    def _import_extension():
        from .. import _C_cpu  # noqa: PLC0415 - optional compiled module

        return _C_cpu

    def unavailable_reason(self) -> Optional[str]:
        if self._ext is None:
            return f"not built ({self._error}); reinstall with a C++ compiler (pip install -e .)"
        return None

    def supports_device(self, device: torch.device) -> bool:
        return torch.device(device).type == "cpu"

    def _launch_args(self, t: Tensor, what: str) -> Dict[str, int]:
        if t.device.type != "cpu":
            raise ValueError(f"the cpu backend needs CPU tensors, got {what} on {t.device}")
        return {"num_threads": torch.get_num_threads()}

    def kept_linear_forward(self, hidden: Tensor, weight: Tensor, kept: KeptSets, *,
                            bias: Optional[Tensor] = None) -> Tensor:
        """``[P]`` raw ``hidden[row] . weight[id] + bias[id]`` by the extension (one dot product per
        pair, in an order fixed by H alone); mixed dtypes take the PyTorch default."""
        if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
            return torch_kept.kept_linear_forward(hidden, weight, kept, bias=bias)
        launch = self._launch_args(hidden, "hidden")
        for t, what in ((weight, "weight"), (bias, "bias"), (kept.ids, "kept ids")):
            if t is not None:
                self._same_device(t, hidden, what)
        code = dtype_code(hidden.dtype, "hidden")
        h = as_rows(hidden.reshape(-1, hidden.shape[-1]), "hidden")
        w = as_rows(weight, "weight")
        b = None if bias is None else bias.contiguous()
        ids = kept.ids.to(torch.int64).contiguous()
        offsets = kept.offsets.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), dtype=compute_dtype(hidden.dtype), device=hidden.device)
        self.extension.kept_linear_forward(
            dtype=code, rows=offsets.numel() - 1, hidden_size=w.shape[1], vocab=w.shape[0], hidden=ptr(h),
            hidden_row_stride=h.stride(0) if h.shape[0] > 1 else h.shape[1], weight=ptr(w),
            weight_row_stride=w.stride(0) if w.shape[0] > 1 else w.shape[1], bias=ptr(b), ids=ptr(ids),
            offsets=ptr(offsets), num_pairs=ids.numel(), out=ptr(out), **launch,
        )
        return out
