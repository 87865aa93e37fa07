"""CUDA backend: the kernels of ``tpo_kernels._C_cuda`` (csrc/cuda), launched on the caller's
current CUDA stream through raw device pointers (no torch C++ ABI involved).

Row ops: one block per row, 16-byte loads, fp32 accumulation (fp64 for fp64 logits). The group
op is one block per group (``csrc/cuda/group_kernel.cu``). The tensor preparation shared with the
CPU backend lives in :mod:`.native`; every extension call gets the ``device`` and ``stream``
keywords from :meth:`CudaBackend._launch_args`.

Kept-set ops of replay and of token-level TPO's candidates (``csrc/cuda/kept_kernels.cu``): the
gather and the scatter of the logits path, the ragged row forward / backward and the fused head's
dot products (``kept_linear_forward``) run in the extension, one launch each: one warp per row (one block per row for the scatter, which
zero-fills the row first), each row summed in an order fixed by its own pairs, no float atomics
(deterministic; a row's values do not depend on the other rows). The kept sets stay on the device
unchecked (their values are checked by ``validate=True`` upstream): every kernel clamps a row's pair
range to ``[0, P)`` and guards each id and label slot.

What is not a CUDA kernel here: ``kept_linear_backward`` is the Triton backend's kernel when
Triton is usable in this process, else the PyTorch default (:func:`kept_ops`), so that
``backend="auto"``, which picks this backend on a GPU, runs them as a handful of fused launches
rather than chunked PyTorch; ``kept_linear_forward`` with mixed dtypes (hidden, weight and bias not
all one dtype) is the PyTorch default. Either way the results follow the backend contract
(deterministic; weight rows summed in a fixed order).
"""

from __future__ import annotations

from types import ModuleType
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..group_math import BatchLayout, GroupResult
from . import _reason
from . import torch_kept
from .kept_sets import KeptSets
from .native import (DTYPE_CODES, NativeBackend, as_row_batch, as_rows, batch_args, dtype_code, matrix_args, per_row, ptr,
                     row_stride)
from .rows import RowSummary, compute_dtype


def kept_ops(triton_unavailable: Optional[str]) -> ModuleType:
    """The module whose ``kept_linear_backward`` the cuda backend runs (the other kept-set ops are
    CUDA kernels): the Triton kernels when Triton is usable (``triton_unavailable is None``), else
    the PyTorch defaults."""
    if triton_unavailable is None:
        from .triton import kept_kernels  # noqa: PLC0415 - imports Triton

        return kept_kernels
    return torch_kept


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

    def _launch_args(self, t: Tensor, what: str) -> Dict[str, int]:
        """Device index and current stream handle for a kernel on ``t``'s device."""
        if t.device.type != "cuda":
            raise ValueError(f"the cuda backend needs CUDA tensors, got {what} on {t.device}")
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return dict(device=index, stream=torch.cuda.current_stream(index).cuda_stream)

    def kept_gather(self, logits: Tensor, kept: KeptSets) -> Tensor:
        """``[P]`` raw ``logits[row, id]`` in the compute dtype (hole: -inf; id >= V: NaN), from a
        ``[M, V]`` matrix or a ``[B, T, V]`` view read in place."""
        launch = self._launch_args(logits, "logits")
        dtype_code(logits.dtype)
        if logits.shape[-1] == 0:  # no column to read: every pair is a hole or outside
            return torch_kept.kept_gather(logits, kept)
        x = as_row_batch(logits)
        sets = self._device_sets(kept, x, x.shape[:-1].numel())
        out = torch.empty(sets.num_pairs, dtype=compute_dtype(x.dtype), device=x.device)
        self.extension.kept_gather(**matrix_args(x), **batch_args(x), ids=ptr(sets.ids), offsets=ptr(sets.offsets),
                                   num_pairs=sets.num_pairs, logits=ptr(x), kept_logits=ptr(out), **launch)
        return out

    def kept_scatter(self, grad: Tensor, kept: KeptSets, *, out: Tensor) -> None:
        """``out`` zero except ``out[row, id]``, the sum of that row's pairs in ascending order."""
        launch = self._launch_args(out, "out")
        dtype_code(out.dtype, "out")
        if out.numel() == 0:
            return
        target = as_row_batch(out, "out")  # out itself when the kernel can write it in place
        sets = self._device_sets(kept, target, target.shape[:-1].numel())
        values = grad.to(device=target.device, dtype=compute_dtype(target.dtype)).contiguous()
        if values.numel() != sets.num_pairs:
            raise ValueError(f"grad must have {sets.num_pairs} elements (one per pair), got {values.numel()}")
        self.extension.kept_scatter(**matrix_args(target), **batch_args(target), ids=ptr(sets.ids),
                                    offsets=ptr(sets.offsets), num_pairs=sets.num_pairs, grad=ptr(values),
                                    out=ptr(target), **launch)
        if target is not out:
            out.copy_(target)

    def kept_linear_forward(self, hidden: Tensor, weight: Tensor, kept: KeptSets, *,
                            bias: Optional[Tensor] = None) -> Tensor:
        """``[P]`` raw ``hidden[row] . weight[id] + bias[id]`` by the extension (one warp per row, in an
        order fixed by H alone); mixed dtypes take the PyTorch default."""
        if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
            return torch_kept.kept_linear_forward(hidden, weight, kept, bias=bias)
        launch = self._launch_args(hidden, "hidden")
        for t, what in ((weight, "weight"), (bias, "bias")):
            if t is not None:
                self._same_device(t, hidden, what)
        code = dtype_code(hidden.dtype, "hidden")
        h = as_rows(hidden.reshape(-1, hidden.shape[-1]), "hidden")
        w = as_rows(weight, "weight")
        b = None if bias is None else bias.reshape(-1).contiguous()
        if b is not None and b.numel() != w.shape[0]:
            raise ValueError(f"bias must have {w.shape[0]} elements (one per weight row), got {b.numel()}")
        if w.shape[0] == 0:  # no weight row: every pair is a hole or outside
            return torch_kept.kept_linear_forward(hidden, weight, kept, bias=bias)
        sets = self._device_sets(kept, h, h.shape[0])
        out = torch.empty(sets.num_pairs, dtype=compute_dtype(hidden.dtype), device=hidden.device)
        self.extension.kept_linear_forward(
            dtype=code, rows=h.shape[0], hidden_size=w.shape[1], vocab=w.shape[0], hidden=ptr(h),
            hidden_row_stride=row_stride(h), weight=ptr(w), weight_row_stride=row_stride(w), bias=ptr(b),
            ids=ptr(sets.ids), offsets=ptr(sets.offsets), num_pairs=sets.num_pairs, out=ptr(out), **launch,
        )
        return out

    def kept_linear_backward(self, grad: Tensor, hidden: Tensor, weight: Tensor, kept: KeptSets, *,
                             runs: Optional[Tuple[Tensor, Tensor, Tensor]], with_hidden: bool, with_weight: bool,
                             with_bias: bool) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        return kept_ops(_reason("triton")).kept_linear_backward(
            grad, hidden, weight, kept, runs=runs, with_hidden=with_hidden, with_weight=with_weight,
            with_bias=with_bias)

    def ragged_row_forward(self, kept_logits: Tensor, kept: KeptSets, *, inv_temperature: float,
                           with_entropy: bool) -> RowSummary:
        """The ragged row forward by the extension: one warp per row."""
        z = kept_logits.reshape(-1).contiguous()
        sets = self._device_sets(kept, z, kept.num_rows)
        row_max, log_sum, logprob = (torch.empty(sets.num_rows, dtype=z.dtype, device=z.device) for _ in range(3))
        entropy = torch.empty(sets.num_rows, dtype=z.dtype, device=z.device) if with_entropy else None
        self.extension.ragged_row_forward(**self._ragged_args(z, sets, inv_temperature), row_max=ptr(row_max),
                                          log_sum=ptr(log_sum), logprob=ptr(logprob), entropy=ptr(entropy))
        return RowSummary(row_max=row_max, log_sum=log_sum, label_logprob=logprob, entropy=entropy,
                          has_label=sets.label_slot >= 0)

    def ragged_row_backward(self, kept_logits: Tensor, kept: KeptSets, summary: RowSummary, grad_logprob: Tensor,
                            *, grad_entropy: Optional[Tensor] = None, inv_temperature: float, out: Tensor) -> None:
        """The ragged row backward by the extension, into ``out [P]``."""
        z = kept_logits.reshape(-1).contiguous()
        sets = self._device_sets(kept, z, kept.num_rows)
        self._same_device(out, z, "out")
        if out.numel() != z.numel():
            raise ValueError(f"out must have {z.numel()} elements (one per pair), got {out.numel()}")
        if grad_entropy is not None and summary.entropy is None:
            raise ValueError("ragged_row_backward: grad_entropy needs the forward's entropy (summary.entropy is None)")
        rows = sets.num_rows

        def values(t: Optional[Tensor], what: str) -> Optional[Tensor]:
            return per_row(t, rows, z.dtype, z.device, what)

        target = out if out.is_contiguous() and out.dtype == z.dtype else torch.empty_like(z)
        self.extension.ragged_row_backward(
            **self._ragged_args(z, sets, inv_temperature), row_max=ptr(values(summary.row_max, "summary.row_max")),
            log_sum=ptr(values(summary.log_sum, "summary.log_sum")),
            logprob=ptr(values(summary.label_logprob, "summary.label_logprob")),
            entropy=ptr(values(summary.entropy if grad_entropy is not None else None, "summary.entropy")),
            grad_logprob=ptr(values(grad_logprob, "grad_logprob")),
            grad_entropy=ptr(values(grad_entropy, "grad_entropy")), out=ptr(target))
        if target is not out:
            out.copy_(target)

    def group_targets(
        self,
        token_logprobs: Tensor,
        layout: BatchLayout,
        scores: Tensor,
        *,
        old_seq_logprobs: Optional[Tensor] = None,
        eta: float,
        anchor: bool,
        score_eps: float = 0.0,
        seq_log_weights: Optional[Tensor] = None,
    ) -> GroupResult:
        """The fused group op (contract: :func:`tpo_kernels.group_math.portable_group_targets`), one block
        per group, in float64 (results cast to the token dtype). Takes float32 / float64 token
        log-probs on a CUDA device; not differentiable by itself (the autograd rule lives with the
        op that calls it)."""
        launch = self._launch_args(token_logprobs, "token_logprobs")
        dtype, dev = token_logprobs.dtype, token_logprobs.device
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"the cuda group op needs float32 or float64 token_logprobs, got {dtype}")
        n, g = layout.num_seqs, layout.num_groups

        def index(t: Tensor) -> Tensor:
            return t.to(device=dev, dtype=torch.int64).contiguous()

        f64 = torch.float64
        tokens = token_logprobs.reshape(-1).contiguous()
        seq_start, seq_len = index(layout.seq_start), index(layout.seq_len)
        offsets, members = index(layout.group_offsets), index(layout.group_members)
        s = per_row(scores, n, f64, dev, "scores")
        old = per_row(old_seq_logprobs, n, f64, dev, "old_seq_logprobs")
        log_weights = per_row(seq_log_weights, n, f64, dev, "seq_log_weights")
        # Completions outside every group (no counted token) keep 0.
        ell, u, p, q = (torch.zeros(n, dtype=f64, device=dev) for _ in range(4))
        group_loss = torch.empty(g, dtype=f64, device=dev)
        self.extension.group_targets(
            dtype=DTYPE_CODES[dtype], num_groups=g, token_logprobs=ptr(tokens),
            seq_start=ptr(seq_start), seq_len=ptr(seq_len), group_offsets=ptr(offsets),
            group_members=ptr(members), scores=ptr(s), old_seq_logprobs=ptr(old),
            seq_log_weights=ptr(log_weights), eta=float(eta),
            score_eps=float(score_eps), anchor=bool(anchor), seq_logprobs=ptr(ell), u=ptr(u), p=ptr(p), q=ptr(q),
            group_loss=ptr(group_loss), **launch,
        )
        return GroupResult(seq_logprobs=ell, u=u, p=p, q=q, group_loss=group_loss, coef=p - q).to(dtype)
