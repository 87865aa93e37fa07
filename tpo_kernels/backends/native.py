"""Shared Python glue of the native backends (``cpu``: ``tpo_kernels._C_cpu``; ``cuda``:
``tpo_kernels._C_cuda``).

Both extensions work on raw pointers (``tensor.data_ptr()``) and take the same argument lists;
the CUDA functions add a trailing ``device, stream``. So this module prepares the tensors once for
both: 2-D row-major views (row stride >= V, unit column stride; anything else is copied with
``.contiguous()``), int64 labels and candidates, per-row values in the compute dtype, every
tensor on the device of the one the kernel reads. A subclass supplies the extension and
:meth:`NativeBackend._launch_args`, which checks a tensor is on the backend's device and returns
the arguments appended to every extension call.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._dtypes import compute_dtype
from .interface import Backend

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


def candidate_ids(candidates: Tensor, rows: int, device) -> Tensor:
    """``candidates`` as a contiguous int64 ``[rows, K]`` tensor on ``device``."""
    cand = candidates.to(device=device, dtype=torch.int64).contiguous()
    if cand.dim() != 2 or cand.shape[0] != rows:
        raise ValueError(f"candidates must be [{rows}, K], got {tuple(candidates.shape)}")
    return cand


class NativeBackend(Backend):
    """Row and candidate ops through a compiled extension. Subclasses set ``name`` and implement
    :meth:`_import_extension`, :meth:`unavailable_reason`, :meth:`supports_device` and
    :meth:`_launch_args`."""

    def __init__(self) -> None:
        try:
            self._ext, self._error = self._import_extension(), None
        except ImportError as exc:
            self._ext, self._error = None, f"{type(exc).__name__}: {exc}"

    @staticmethod
    def _import_extension():
        """The compiled module; raises ImportError when it is not built."""
        raise NotImplementedError

    def _launch_args(self, t: Tensor, what: str) -> tuple:
        """Raise ValueError unless ``t`` is on this backend's device type; return the arguments
        appended to every extension call for a kernel on ``t``'s device."""
        raise NotImplementedError

    @property
    def extension(self):
        reason = self.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the {self.name} backend is not usable here: {reason}")
        return self._ext

    def _check_out(self, out: Tensor, like: Tensor) -> None:
        """``out`` must be on ``like``'s device (the kernel writes it through a raw pointer)."""
        self._launch_args(out, "out")
        if out.device != like.device:
            raise ValueError(f"out must be on {like.device}, got {out.device}")

    def row_forward(
        self, logits: Tensor, labels: Tensor, *, inv_temperature: float, with_entropy: bool
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        launch = self._launch_args(logits, "logits")
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
            ptr(lse), ptr(target), ptr(entropy), *launch,
        )
        return lse, target, entropy

    def row_backward(
        self,
        logits: Tensor,
        labels: Tensor,
        lse: Tensor,
        grad_logprob: Tensor,
        *,
        grad_entropy: Optional[Tensor] = None,
        entropy: Optional[Tensor] = None,
        inv_temperature: float,
        out: Tensor,
    ) -> None:
        launch = self._launch_args(logits, "logits")
        self._check_out(out, logits)
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
        # logits); otherwise into a temporary that is copied over. An `out` that starts at the
        # logits' address with another row stride would be overwritten while still being read,
        # so it gets a temporary too.
        direct = out.dtype == x.dtype and as_rows(out) is out
        target = out if direct else torch.empty_like(x)
        if target.data_ptr() == x.data_ptr() and row_stride(target) != row_stride(x):
            target = torch.empty_like(x)
            direct = False
        self.extension.row_backward(
            ptr(x), code, rows, vocab, row_stride(x), ptr(lab), ptr(lse_v), ptr(g), ptr(ge),
            ptr(ent), float(inv_temperature), ptr(target), row_stride(target), *launch,
        )
        if not direct:
            out.copy_(target)

    def candidate_forward(self, logits: Tensor, candidates: Tensor, *, inv_temperature: float) -> Tensor:
        launch = self._launch_args(logits, "logits")
        code = dtype_code(logits.dtype)
        x = as_rows(logits)
        rows, vocab = x.shape
        cand = candidate_ids(candidates, rows, x.device)
        k = cand.shape[1]
        out = torch.empty(rows, k, dtype=compute_dtype(x.dtype), device=x.device)
        self.extension.candidate_forward(
            ptr(x), code, rows, vocab, row_stride(x), ptr(cand), k, float(inv_temperature),
            ptr(out), *launch,
        )
        return out

    def candidate_backward(
        self, grad_cand: Tensor, candidates: Tensor, *, inv_temperature: float, out: Tensor
    ) -> None:
        launch = self._launch_args(out, "out")
        code = dtype_code(out.dtype, "out")
        if out.dim() != 2:
            raise ValueError(f"out must be 2-D [rows, vocab], got shape {tuple(out.shape)}")
        rows, vocab = out.shape
        cand = candidate_ids(candidates, rows, out.device)
        k = cand.shape[1]
        grad = grad_cand.to(device=out.device, dtype=compute_dtype(out.dtype)).contiguous()
        if grad.shape != cand.shape:
            raise ValueError(f"grad_cand must be {tuple(cand.shape)}, got {tuple(grad_cand.shape)}")
        target = out if out.is_contiguous() else torch.empty(rows, vocab, dtype=out.dtype, device=out.device)
        self.extension.candidate_backward(
            ptr(grad), ptr(cand), rows, k, vocab, float(inv_temperature), ptr(target), code, *launch,
        )
        if target is not out:
            out.copy_(target)
