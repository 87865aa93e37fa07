"""Shared Python side of the native backends (``cpu``: ``tpo_kernels._C_cpu``; ``cuda``:
``tpo_kernels._C_cuda``).

Both extensions take keyword arguments only, named like the fields of the argument structs in
``csrc/tpo_abi.h`` (addresses from ``tensor.data_ptr()``); the CUDA ops add ``device`` and
``stream``. This module prepares the tensors once for both: 2-D row-major views (row stride >= V,
unit column stride; anything else is copied with ``.contiguous()``) and, for the row ops, ``[B, T,
V]`` views whose rows do not flatten (``logits[:, :-1]``: read in place, one launch with a batch
stride), int64 labels,
per-row values in the compute dtype, every tensor on the device of the one the kernel reads.
These pointer-boundary checks raise ``ValueError`` / ``TypeError``; the extensions re-check what
could make a kernel touch memory it should not. A subclass supplies the extension and
:meth:`NativeBackend._launch_args`.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from . import Backend
from .kept_sets import KeptSets
from .rows import RowSummary, compute_dtype, gradient_buffer, rows_in_place

# Element type codes: tpo::DType in csrc/tpo_abi.h.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def dtype_code(dtype: torch.dtype, what: str = "logits") -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(
            f"{what} must be float32, float16, bfloat16 or float64 for the native backends, got {dtype}"
        ) from None


def as_rows(t: Tensor, what: str = "logits") -> Tensor:
    """``t`` as a 2-D matrix the kernels can walk: unit column stride, non-overlapping rows
    (:func:`rows_in_place`). Returns ``t`` itself when it already qualifies (so in-place writes
    reach it), else a copy."""
    if t.dim() != 2:
        raise ValueError(f"{what} must be 2-D [rows, vocab], got shape {tuple(t.shape)}")
    return t if rows_in_place(t) else t.contiguous()


def as_row_batch(t: Tensor, what: str = "logits") -> Tensor:
    """The row ops' input: :func:`as_rows` for a ``[M, V]`` matrix; a ``[B, T, V]`` view (the
    ``logits[:, :-1]`` slice, whose rows do not flatten into one row stride) stays as it is when
    the kernels can walk it in one launch (:func:`rows_in_place`), else it is copied."""
    if t.dim() == 2:
        return as_rows(t, what)
    if t.dim() != 3:
        raise ValueError(f"{what} must be [rows, vocab] or [batch, rows, vocab], got shape {tuple(t.shape)}")
    return t if rows_in_place(t) else t.contiguous()


def batch_args(t: Tensor) -> dict:
    """``rows_per_batch, batch_stride`` of a row-op input (:func:`as_row_batch`): row ``r = b * T + t``
    starts at ``b * batch_stride + t * row_stride`` (csrc/tpo_abi.h); a matrix is one batch entry."""
    if t.dim() == 2:
        return dict(rows_per_batch=max(t.shape[0], 1), batch_stride=0)
    return dict(rows_per_batch=max(t.shape[1], 1), batch_stride=t.stride(0) if t.shape[0] > 1 else 0)


def row_stride(t: Tensor) -> int:
    """Elements between consecutive rows of a ``[M, V]`` matrix (or within a batch entry of a
    ``[B, T, V]`` view)."""
    rows, vocab = t.shape[-2:]
    return t.stride(-2) if rows > 1 else max(vocab, 1)


def matrix_args(t: Tensor) -> dict:
    """The ``dtype, rows, vocab, row_stride`` fields of a matrix returned by :func:`as_rows` (or
    of a batch returned by :func:`as_row_batch`: ``rows`` counts every batch entry's rows)."""
    vocab = t.shape[-1]
    return dict(dtype=DTYPE_CODES[t.dtype], rows=t.shape[:-1].numel(), vocab=vocab, row_stride=row_stride(t))


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


class NativeBackend(Backend):
    """Row ops (and the ragged ones' shared preparation) through a compiled extension. Subclasses set ``name`` and implement
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

    def _launch_args(self, t: Tensor, what: str) -> Dict[str, int]:
        """Raise ValueError unless ``t`` is on this backend's device type; return the keyword
        arguments added to every extension call for a kernel on ``t``'s device."""
        raise NotImplementedError

    @property
    def extension(self):
        reason = self.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the {self.name} backend is not usable here: {reason}")
        return self._ext

    def _same_device(self, t: Tensor, like: Tensor, what: str) -> None:
        """``t`` must be on ``like``'s device (the kernel writes it through a raw pointer)."""
        self._launch_args(t, what)
        if t.device != like.device:
            raise ValueError(f"{what} must be on {like.device}, got {t.device}")

    def _device_sets(self, kept: KeptSets, like: Tensor, rows: Optional[int] = None) -> KeptSets:
        """``kept`` as contiguous int64 tensors on ``like``'s device (the kernels read them through raw
        pointers), for a call over ``rows`` rows when given."""
        if rows is not None and kept.num_rows != rows:
            raise ValueError(f"kept sets must cover {rows} rows, got {kept.num_rows}")
        for t, what in ((kept.ids, "kept ids"), (kept.offsets, "kept offsets"), (kept.label_slot, "kept label_slot")):
            self._same_device(t, like, what)
        return KeptSets(ids=kept.ids.to(torch.int64).contiguous(), offsets=kept.offsets.to(torch.int64).contiguous(),
                        rows=kept.rows, label_slot=kept.label_slot.to(torch.int64).contiguous(), width=kept.width)

    def _ragged_args(self, kept_logits: Tensor, kept: KeptSets, inv_temperature: float) -> dict:
        """The keywords of the extension's ragged row ops: ``kept_logits [P]`` in the compute dtype
        and ``kept`` from :meth:`_device_sets`."""
        launch = self._launch_args(kept_logits, "kept_logits")
        if kept_logits.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"kept_logits must be float32 or float64 (the compute dtype), got {kept_logits.dtype}")
        if kept_logits.numel() != kept.num_pairs:
            raise ValueError(f"kept_logits must have {kept.num_pairs} elements (one per pair), got {kept_logits.numel()}")
        return dict(dtype=dtype_code(kept_logits.dtype), rows=kept.num_rows, num_pairs=kept.num_pairs,
                    kept_logits=ptr(kept_logits), ids=ptr(kept.ids), offsets=ptr(kept.offsets),
                    label_slot=ptr(kept.label_slot), inv_temperature=float(inv_temperature), **launch)

    def row_forward(
        self, logits: Tensor, labels: Tensor, *, inv_temperature: float, with_entropy: bool
    ) -> RowSummary:
        launch = self._launch_args(logits, "logits")
        dtype_code(logits.dtype)
        x = as_row_batch(logits)
        rows, vocab = x.shape[:-1].numel(), x.shape[-1]
        acc = compute_dtype(x.dtype)
        lab = labels_vector(labels, rows, x.device)
        # Separate tensors, not views of one: a custom op's outputs may not alias each other.
        row_max, log_sum = (torch.empty(rows, dtype=acc, device=x.device) for _ in range(2))
        logprob = torch.empty(rows, dtype=acc, device=x.device)
        entropy = torch.empty(rows, dtype=acc, device=x.device) if with_entropy else None
        self.extension.row_forward(
            **matrix_args(x), **batch_args(x), logits=ptr(x), labels=ptr(lab),
            inv_temperature=float(inv_temperature), row_max=ptr(row_max), log_sum=ptr(log_sum), logprob=ptr(logprob),
            entropy=ptr(entropy), **launch,
        )
        return RowSummary(row_max=row_max, log_sum=log_sum, label_logprob=logprob, entropy=entropy,
                          has_label=(lab >= 0) & (lab < vocab))

    def row_backward(
        self,
        logits: Tensor,
        labels: Tensor,
        summary: RowSummary,
        grad_logprob: Tensor,
        *,
        grad_entropy: Optional[Tensor] = None,
        inv_temperature: float,
        out: Tensor,
    ) -> None:
        launch = self._launch_args(logits, "logits")
        self._same_device(out, logits, "out")
        dtype_code(logits.dtype)
        if out.shape != logits.shape:
            raise ValueError(f"out must have the logits' shape {tuple(logits.shape)}, got {tuple(out.shape)}")
        x = as_row_batch(logits)
        rows = x.shape[:-1].numel()
        acc = compute_dtype(x.dtype)
        lab = labels_vector(labels, rows, x.device)
        row_max = per_row(summary.row_max, rows, acc, x.device, "summary.row_max")
        log_sum = per_row(summary.log_sum, rows, acc, x.device, "summary.log_sum")
        lp = per_row(summary.label_logprob, rows, acc, x.device, "summary.label_logprob")
        g = per_row(grad_logprob, rows, acc, x.device, "grad_logprob")
        ge = per_row(grad_entropy, rows, acc, x.device, "grad_entropy")
        ent = None
        if ge is not None:
            if summary.entropy is None:
                raise ValueError("row_backward: grad_entropy needs the forward's entropy (summary.entropy is None)")
            ent = per_row(summary.entropy, rows, acc, x.device, "summary.entropy")
        # Straight into `out` when the kernel can (the in-place path when out is logits), else
        # into a temporary copied over afterwards (gradient_buffer).
        target = gradient_buffer(x, out)
        self.extension.row_backward(
            **matrix_args(x), **batch_args(x), logits=ptr(x), labels=ptr(lab), row_max=ptr(row_max),
            log_sum=ptr(log_sum), logprob=ptr(lp), grad_logprob=ptr(g), grad_entropy=ptr(ge), entropy=ptr(ent),
            inv_temperature=float(inv_temperature), out=ptr(target), out_row_stride=row_stride(target),
            out_batch_stride=batch_args(target)["batch_stride"], **launch,
        )
        if target is not out:
            out.copy_(target)
