"""CUDA backend: the kernels of ``tpo_kernels._C_cuda`` (csrc/cuda), launched on the caller's
current CUDA stream through raw device pointers (no torch C++ ABI involved).

Row ops: one block per row, 16-byte loads, fp32 accumulation (fp64 for fp64 logits). The group
op is one block per group (``csrc/cuda/group_kernel.cu``); it falls back to the PyTorch one when
autograd needs to see through it. Candidate ops are deterministic (one thread per row). The tensor
preparation shared with the CPU backend lives in :mod:`.native`; every extension call gets the
trailing ``device, stream`` arguments from :meth:`CudaBackend._launch_args`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .native import NativeBackend, per_row, ptr


class CudaBackend(NativeBackend):
    name = "cuda"

    @staticmethod
    def _import_extension():
        from .. import _C_cuda  # noqa: PLC0415 - optional compiled module

        return _C_cuda

    def unavailable_reason(self) -> Optional[str]:
        if self._ext is None:
            return f"not built ({self._error}); install with nvcc available (see setup.py)"
        if not torch.cuda.is_available():
            return "built, but no CUDA device"
        if self._ext.device_count() == 0:
            return f"built, but its CUDA runtime sees no device ({self._ext.device_error()})"
        return None

    def supports_device(self, device: torch.device) -> bool:
        return torch.device(device).type == "cuda"

    def _launch_args(self, t: Tensor, what: str) -> Tuple[int, int]:
        """(device index, current stream handle) for a kernel on ``t``'s device."""
        if t.device.type != "cuda":
            raise ValueError(f"the cuda backend needs CUDA tensors, got {what} on {t.device}")
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return index, torch.cuda.current_stream(index).cuda_stream

    def group_targets(self, token_logprobs, layout, scores, old_seq_logprobs, eta, anchor, reduction):
        from ..targets import GroupTargets, loss_weight

        needs_autograd = torch.is_grad_enabled() and (
            token_logprobs.requires_grad
            or (old_seq_logprobs is not None and old_seq_logprobs.requires_grad)
        )
        if (
            token_logprobs.device.type != "cuda"
            or token_logprobs.dtype not in (torch.float32, torch.float64)
            or needs_autograd
        ):
            return super().group_targets(
                token_logprobs, layout, scores, old_seq_logprobs, eta, anchor, reduction
            )
        device, stream = self._launch_args(token_logprobs, "token_logprobs")
        dtype, dev = token_logprobs.dtype, token_logprobs.device
        n, g = layout.num_seqs, layout.num_groups
        tokens = token_logprobs.reshape(-1).contiguous()

        def index(t: Tensor) -> Tensor:
            return t.to(device=dev, dtype=torch.int64).contiguous()

        seq_start, seq_len = index(layout.seq_start), index(layout.seq_len)
        offsets, members = index(layout.group_offsets), index(layout.group_members)
        s = per_row(scores, n, dtype, dev, "scores")
        old = per_row(old_seq_logprobs, n, dtype, dev, "old_seq_logprobs")
        ell, u, p, q, coef = (torch.empty(n, dtype=dtype, device=dev) for _ in range(5))
        group_loss = torch.empty(g, dtype=dtype, device=dev)
        self.extension.group_targets(
            0 if dtype == torch.float32 else 3, ptr(tokens), ptr(seq_start), ptr(seq_len),
            ptr(offsets), ptr(members), g, ptr(s), ptr(old), float(eta), bool(anchor),
            float(loss_weight(reduction, g)), ptr(ell), ptr(u), ptr(p), ptr(q), ptr(group_loss),
            ptr(coef), device, stream,
        )
        return GroupTargets(ell, u, p, q, group_loss, coef)
