"""CPU backend: the C++ row ops of ``tpo_kernels._C_cpu`` (csrc/cpu, OpenMP over rows).

The extension works on raw pointers, so this module prepares the tensors: 2-D row-major views
(row stride >= V, unit column stride; anything else is copied with ``.contiguous()``), int64
labels, per-row values in the compute dtype. The group op is the portable PyTorch one.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import Backend, compute_dtype

# Element type codes understood by the extensions (csrc/cpu/row_ops.h).
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def dtype_code(dtype: torch.dtype, what: str = "logits") -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(
            f"{what} must be float32, float16, bfloat16 or float64 for the native backends, got {dtype}"
        ) from None


def as_rows(t: Tensor, what: str = "logits") -> Tensor:
    """``t`` as a 2-D matrix the kernels can walk: unit column stride, non-overlapping rows.
    Returns ``t`` itself when it already qualifies (so in-place writes reach it), else a copy."""
    if t.dim() != 2:
        raise ValueError(f"{what} must be 2-D [rows, vocab], got shape {tuple(t.shape)}")
    rows, vocab = t.shape
    if rows > 0 and vocab > 0 and t.stride(1) == 1 and (rows == 1 or t.stride(0) >= vocab):
        return t
    return t.contiguous()


def row_stride(t: Tensor) -> int:
    rows, vocab = t.shape
    return t.stride(0) if rows > 1 else max(vocab, 1)


def per_row(t: Optional[Tensor], rows: int, dtype: torch.dtype, device, what: str) -> Optional[Tensor]:
    """A contiguous ``[rows]`` tensor of ``dtype`` on ``device`` (None stays None)."""
    if t is None:
        return None
    t = t.reshape(-1)
    if t.numel() != rows:
        raise ValueError(f"{what} must have {rows} elements (one per row), got {t.numel()}")
    return t.to(device=device, dtype=dtype).contiguous()


def labels_vector(labels: Tensor, rows: int, device) -> Tensor:
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    return per_row(labels, rows, torch.int64, device, "labels")


def ptr(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _load_extension():
    try:
        from .. import _C_cpu  # noqa: PLC0415 - optional compiled module
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return _C_cpu, None


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self) -> None:
        self._ext, self._error = _load_extension()

    def unavailable_reason(self) -> Optional[str]:
        if self._ext is None:
            return f"not built ({self._error}); reinstall with a C++ compiler (pip install -e .)"
        return None

    def supports_device(self, device: torch.device) -> bool:
        return torch.device(device).type == "cpu"

    @property
    def extension(self):
        if self._ext is None:
            raise RuntimeError(f"the cpu backend is not usable here: {self.unavailable_reason()}")
        return self._ext

    @staticmethod
    def _check_device(t: Tensor, what: str) -> None:
        if t.device.type != "cpu":
            raise ValueError(f"the cpu backend needs CPU tensors, got {what} on {t.device}")

    def row_forward(
        self, logits: Tensor, labels: Tensor, inv_temperature: float, with_entropy: bool
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        self._check_device(logits, "logits")
        code = dtype_code(logits.dtype)
        x = as_rows(logits)
        rows, vocab = x.shape
        acc = compute_dtype(x.dtype)
        lab = labels_vector(labels, rows, x.device)
        lse = torch.empty(rows, dtype=acc)
        target = torch.empty(rows, dtype=acc)
        entropy = torch.empty(rows, dtype=acc) if with_entropy else None
        self.extension.row_forward(
            ptr(x), code, rows, vocab, row_stride(x), ptr(lab), float(inv_temperature),
            ptr(lse), ptr(target), ptr(entropy),
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
        self._check_device(logits, "logits")
        self._check_device(out, "out")
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
        # Write straight into `out` when the kernel can (this is the in-place path when out is
        # logits); otherwise into a temporary that is copied over.
        direct = out.dtype == x.dtype and as_rows(out) is out
        target = out if direct else torch.empty_like(x)
        if target.data_ptr() == x.data_ptr() and row_stride(target) != row_stride(x):
            target = torch.empty_like(x)
            direct = False
        self.extension.row_backward(
            ptr(x), code, rows, vocab, row_stride(x), ptr(lab), ptr(lse_v), ptr(g), ptr(ge),
            ptr(ent), float(inv_temperature), ptr(target), row_stride(target),
        )
        if not direct:
            out.copy_(target)

    def candidate_forward(self, logits: Tensor, candidates: Tensor, inv_temperature: float) -> Tensor:
        self._check_device(logits, "logits")
        code = dtype_code(logits.dtype)
        x = as_rows(logits)
        rows, vocab = x.shape
        cand = candidates.to(torch.int64).contiguous()
        if cand.dim() != 2 or cand.shape[0] != rows:
            raise ValueError(f"candidates must be [{rows}, K], got {tuple(candidates.shape)}")
        k = cand.shape[1]
        out = torch.empty(rows, k, dtype=compute_dtype(x.dtype))
        self.extension.candidate_forward(
            ptr(x), code, rows, vocab, row_stride(x), ptr(cand), k, float(inv_temperature), ptr(out)
        )
        return out

    def candidate_backward(
        self, grad_cand: Tensor, candidates: Tensor, inv_temperature: float, out: Tensor
    ) -> None:
        self._check_device(out, "out")
        code = dtype_code(out.dtype, "out")
        if out.dim() != 2:
            raise ValueError(f"out must be 2-D [rows, vocab], got shape {tuple(out.shape)}")
        rows, vocab = out.shape
        cand = candidates.to(torch.int64).contiguous()
        if cand.dim() != 2 or cand.shape[0] != rows:
            raise ValueError(f"candidates must be [{rows}, K], got {tuple(candidates.shape)}")
        k = cand.shape[1]
        grad = grad_cand.to(compute_dtype(out.dtype)).contiguous()
        if grad.shape != cand.shape:
            raise ValueError(f"grad_cand must be {tuple(cand.shape)}, got {tuple(grad_cand.shape)}")
        target = out if out.is_contiguous() else torch.empty(rows, vocab, dtype=out.dtype)
        self.extension.candidate_backward(
            ptr(grad), ptr(cand), rows, k, vocab, float(inv_temperature), ptr(target), code
        )
        if target is not out:
            out.copy_(target)
