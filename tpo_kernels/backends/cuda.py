"""CUDA backend: the kernels of ``tpo_kernels._C_cuda`` (csrc/cuda), launched on the caller's
current CUDA stream through raw device pointers (no torch C++ ABI involved).

Row ops: one block per row, 16-byte loads, fp32 accumulation (fp64 for fp64 logits). The group
op is one block per group (``csrc/cuda/group_kernel.cu``); it falls back to the PyTorch one when
autograd needs to see through it. Candidate ops are deterministic (one thread per row).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import Backend, compute_dtype
from .cpu import as_rows, dtype_code, labels_vector, per_row, ptr, row_stride


def _load_extension():
    try:
        from .. import _C_cuda  # noqa: PLC0415 - optional compiled module
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return _C_cuda, None


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self) -> None:
        self._ext, self._error = _load_extension()

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

    @property
    def extension(self):
        reason = self.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the cuda backend is not usable here: {reason}")
        return self._ext

    @staticmethod
    def _device_and_stream(t: Tensor, what: str) -> Tuple[int, int]:
        if t.device.type != "cuda":
            raise ValueError(f"the cuda backend needs CUDA tensors, got {what} on {t.device}")
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return index, torch.cuda.current_stream(index).cuda_stream

    def row_forward(
        self, logits: Tensor, labels: Tensor, inv_temperature: float, with_entropy: bool
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        device, stream = self._device_and_stream(logits, "logits")
        code = dtype_code(logits.dtype)
        x = as_rows(logits)
        rows, vocab = x.shape
        acc = compute_dtype(x.dtype)
        lab = labels_vector(labels, rows, x.device)
        lse = torch.empty(rows, dtype=acc, device=x.device)
        target = torch.empty(rows, dtype=acc, device=x.device)
        entropy = torch.empty(rows, dtype=acc, device=x.device) if with_entropy else None
        self.extension.row_forward(
            ptr(x), code, rows, vocab, row_stride(x), ptr(lab), float(inv_temperature),
            ptr(lse), ptr(target), ptr(entropy), device, stream,
        )
        return lse, target, entropy

    def row_backward(
        self,
        logits: Tensor,
        labels: Tensor,
        lse: Tensor,
        grad_logprob: Tensor,
        grad_entropy: Optional[Tensor],
        entropy: Optional[Tensor],
        inv_temperature: float,
        out: Tensor,
    ) -> None:
        device, stream = self._device_and_stream(logits, "logits")
        if out.device != logits.device:
            raise ValueError(f"out must be on {logits.device}, got {out.device}")
        code = dtype_code(logits.dtype)
        if out.shape != logits.shape:
            raise ValueError(f"out must have the logits' shape {tuple(logits.shape)}, got {tuple(out.shape)}")
        x = as_rows(logits)
        rows, vocab = x.shape
        acc = compute_dtype(x.dtype)
        lab = labels_vector(labels, rows, x.device)
        lse_v = per_row(lse, rows, acc, x.device, "lse")
        g = per_row(grad_logprob, rows, acc, x.device, "grad_logprob")
        ge = per_row(grad_entropy, rows, acc, x.device, "grad_entropy")
        ent = None
        if ge is not None:
            if entropy is None:
                raise ValueError("row_backward: grad_entropy needs the forward's entropy")
            ent = per_row(entropy, rows, acc, x.device, "entropy")
        direct = out.dtype == x.dtype and as_rows(out) is out
        target = out if direct else torch.empty_like(x)
        self.extension.row_backward(
            ptr(x), code, rows, vocab, row_stride(x), ptr(lab), ptr(lse_v), ptr(g), ptr(ge),
            ptr(ent), float(inv_temperature), ptr(target), row_stride(target), device, stream,
        )
        if not direct:
            out.copy_(target)

    def candidate_forward(self, logits: Tensor, candidates: Tensor, inv_temperature: float) -> Tensor:
        device, stream = self._device_and_stream(logits, "logits")
        code = dtype_code(logits.dtype)
        x = as_rows(logits)
        rows, vocab = x.shape
        cand = candidates.to(device=x.device, dtype=torch.int64).contiguous()
        if cand.dim() != 2 or cand.shape[0] != rows:
            raise ValueError(f"candidates must be [{rows}, K], got {tuple(candidates.shape)}")
        k = cand.shape[1]
        out = torch.empty(rows, k, dtype=compute_dtype(x.dtype), device=x.device)
        self.extension.candidate_forward(
            ptr(x), code, rows, vocab, row_stride(x), ptr(cand), k, float(inv_temperature),
            ptr(out), device, stream,
        )
        return out

    def candidate_backward(
        self, grad_cand: Tensor, candidates: Tensor, inv_temperature: float, out: Tensor
    ) -> None:
        device, stream = self._device_and_stream(out, "out")
        code = dtype_code(out.dtype, "out")
        if out.dim() != 2:
            raise ValueError(f"out must be 2-D [rows, vocab], got shape {tuple(out.shape)}")
        rows, vocab = out.shape
        cand = candidates.to(device=out.device, dtype=torch.int64).contiguous()
        if cand.dim() != 2 or cand.shape[0] != rows:
            raise ValueError(f"candidates must be [{rows}, K], got {tuple(candidates.shape)}")
        k = cand.shape[1]
        grad = grad_cand.to(device=out.device, dtype=compute_dtype(out.dtype)).contiguous()
        if grad.shape != cand.shape:
            raise ValueError(f"grad_cand must be {tuple(cand.shape)}, got {tuple(grad_cand.shape)}")
        target = out if out.is_contiguous() else torch.empty(rows, vocab, dtype=out.dtype, device=out.device)
        self.extension.candidate_backward(
            ptr(grad), ptr(cand), rows, k, vocab, float(inv_temperature), ptr(target), code,
            device, stream,
        )
        if target is not out:
            out.copy_(target)

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
        device, stream = self._device_and_stream(token_logprobs, "token_logprobs")
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
