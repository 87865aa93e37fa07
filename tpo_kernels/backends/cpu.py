"""CPU backend: the C++ row ops of ``tpo_kernels._C_cpu`` (csrc/cpu, threads over rows).

Every call passes ``num_threads=torch.get_num_threads()``: the row ops run on at most that many
threads (the caller and the extension's own helpers, which sleep between calls), so
``torch.set_num_threads`` governs them as it does PyTorch's ops; a call under ATen's grain (32768
elements per thread) runs on the calling thread alone, as PyTorch's own ops do. Why they do not
use OpenMP threads (they collapsed on a loaded machine): csrc/cpu/parallel.h.

The tensor preparation shared with the CUDA backend lives in :mod:`.native`; the extension
functions take no other launch arguments. The group op is the portable PyTorch one. Of the
kept-set ops (sampling-mask replay; token-level TPO's candidates), the fused head's dot products
and the ragged row ops run in the extension (one call each, where the PyTorch defaults take a dozen
``[P]``-sized ops, each waking ATen's threads); the gather (one indexing op), the scatter (a fill
and one ``index_put_``: the fill is the work) and the linear backward (``embedding_bag`` sums) are
the PyTorch defaults.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from . import torch_kept
from .kept_sets import KeptSets
from .native import NativeBackend, as_rows, dtype_code, ptr
from .rows import RowSummary, compute_dtype


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

    def ragged_row_forward(self, kept_logits: Tensor, kept: KeptSets, *, inv_temperature: float,
                           with_entropy: bool) -> RowSummary:
        """The ragged row forward by the extension: each row summed sequentially in pair order."""
        z = kept_logits.contiguous()
        kept = self._device_sets(kept, z)
        row_max, log_sum, logprob = (torch.empty(kept.num_rows, dtype=z.dtype) for _ in range(3))
        entropy = torch.empty(kept.num_rows, dtype=z.dtype) if with_entropy else None
        self.extension.ragged_row_forward(**self._ragged_args(z, kept, inv_temperature), row_max=ptr(row_max),
                                          log_sum=ptr(log_sum), logprob=ptr(logprob), entropy=ptr(entropy))
        return RowSummary(row_max=row_max, log_sum=log_sum, label_logprob=logprob, entropy=entropy,
                          has_label=kept.label_slot >= 0)

    def ragged_row_backward(self, kept_logits: Tensor, kept: KeptSets, summary: RowSummary, grad_logprob: Tensor, *,
                            grad_entropy: Optional[Tensor] = None, inv_temperature: float, out: Tensor) -> None:
        """The ragged row backward by the extension, into ``out [P]``."""
        z = kept_logits.contiguous()
        kept = self._device_sets(kept, z)

        def per_row(t: Optional[Tensor]) -> Optional[Tensor]:
            return None if t is None else t.to(z.dtype).contiguous()

        if grad_entropy is not None and summary.entropy is None:
            raise ValueError("ragged_row_backward: grad_entropy needs the forward's entropy (summary.entropy is None)")
        target = out if out.is_contiguous() and out.dtype == z.dtype else torch.empty_like(z)
        fields = [per_row(t) for t in (summary.row_max, summary.log_sum, summary.label_logprob,
                                       summary.entropy if grad_entropy is not None else None, grad_logprob,
                                       grad_entropy)]
        row_max, log_sum, logprob, entropy, g, ge = fields
        self.extension.ragged_row_backward(**self._ragged_args(z, kept, inv_temperature), row_max=ptr(row_max),
                                           log_sum=ptr(log_sum), logprob=ptr(logprob), entropy=ptr(entropy),
                                           grad_logprob=ptr(g), grad_entropy=ptr(ge), out=ptr(target))
        if target is not out:
            out.copy_(target)
