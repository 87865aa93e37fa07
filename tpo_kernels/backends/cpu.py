"""CPU backend: the C++ row ops of ``tpo_kernels._C_cpu`` (csrc/cpu, threads over rows).

Every call passes ``num_threads=torch.get_num_threads()``: the row ops run on at most that many
threads (the caller and the extension's own helpers, which sleep between calls), so
``torch.set_num_threads`` governs them as it does PyTorch's ops; a call under ATen's grain (32768
elements per thread) runs on the calling thread alone, as PyTorch's own ops do. Why they do not
use OpenMP threads (they collapsed on a loaded machine): csrc/cpu/parallel.h.

The tensor preparation shared with the CUDA backend lives in :mod:`.native`; the extension
functions take no other launch arguments. The group op is the portable PyTorch one.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from .native import NativeBackend


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
