"""Triton backend: row ops, kept-set ops (replay, and token-level TPO's candidates) and the group op
as Triton kernels.

Runs on CUDA tensors, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``,
slow; meant for tests). Importing this module imports Triton; the backend registry imports it
on first use only.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import triton_interpreter_enabled
from .. import Backend
from . import group_kernel, kept_kernels, row_kernels


class TritonBackend(Backend):
    name = "triton"

    row_forward = staticmethod(row_kernels.row_forward)
    row_backward = staticmethod(row_kernels.row_backward)
    group_targets = staticmethod(group_kernel.fused_group_targets)
    kept_gather = staticmethod(kept_kernels.kept_gather)
    kept_scatter = staticmethod(kept_kernels.kept_scatter)
    kept_linear_forward = staticmethod(kept_kernels.kept_linear_forward)
    kept_linear_backward = staticmethod(kept_kernels.kept_linear_backward)
    ragged_row_forward = staticmethod(kept_kernels.ragged_row_forward)
    ragged_row_backward = staticmethod(kept_kernels.ragged_row_backward)

    def unavailable_reason(self) -> Optional[str]:
        if torch.cuda.is_available() or triton_interpreter_enabled():
            return None
        return "no CUDA device (set TRITON_INTERPRET=1 to run the Triton kernels on CPU)"

    def supports_device(self, device: torch.device) -> bool:
        device = torch.device(device)
        if device.type == "cuda":
            return True
        return device.type == "cpu" and triton_interpreter_enabled()
