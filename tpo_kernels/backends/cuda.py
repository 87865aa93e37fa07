"""CUDA backend: the kernels of ``tpo_kernels._C_cuda`` (csrc/cuda), launched on the caller's
current CUDA stream through raw device pointers (no torch C++ ABI involved).

Row ops: one block per row, 16-byte loads, fp32 accumulation (fp64 for fp64 logits). The group
op is one block per group (``csrc/cuda/group_kernel.cu``). The candidate ops of the logits path
are deterministic (one thread per row). The tensor preparation shared with the CPU backend lives
in :mod:`.native`; every extension call gets the ``device`` and ``stream`` keywords from
:meth:`CudaBackend._launch_args`.

The fused-linear candidate ops (token-level TPO from hidden states) have no CUDA kernels: they
are the Triton backend's kernels when Triton is usable in this process, else the PyTorch
defaults (:func:`linear_candidate_ops`), so that ``backend="auto"``, which picks this backend on
a GPU, runs the token-level path as a handful of fused launches rather than chunked PyTorch.
Either way their results follow the backend contract (deterministic; weight rows summed in a
fixed order), and they are tested as the Triton and PyTorch ops. The kept-set ops of replay (the
ragged dot products and row ops) go the same way (:func:`kept_ops`); their gather and scatter
are the PyTorch defaults.
"""

from __future__ import annotations

from types import ModuleType
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..group_math import BatchLayout, GroupResult
from . import _reason
from . import torch_candidates as torch_candidate_ops
from . import torch_kept
from .kept_sets import KeptSets
from .rows import RowSummary
from .native import DTYPE_CODES, NativeBackend, per_row, ptr


def linear_candidate_ops(triton_unavailable: Optional[str]) -> ModuleType:
    """The module whose ``candidate_linear_forward`` / ``candidate_linear_backward`` the cuda
    backend runs, given the Triton backend's ``unavailable_reason()``: the Triton kernels when it
    is None, else the PyTorch defaults."""
    if triton_unavailable is None:
        from .triton import candidate_kernels  # noqa: PLC0415 - imports Triton

        return candidate_kernels
    return torch_candidate_ops


def kept_ops(triton_unavailable: Optional[str]) -> ModuleType:
    """The module of the kept-set dot products and ragged row ops the cuda backend runs: the
    Triton kernels when Triton is usable (``triton_unavailable is None``), else the PyTorch defaults."""
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

    def candidate_linear_forward(
        self, hidden: Tensor, weight: Tensor, candidates: Tensor, *, bias: Optional[Tensor] = None,
        inv_temperature: float,
    ) -> Tensor:
        return linear_candidate_ops(_reason("triton")).candidate_linear_forward(
            hidden, weight, candidates, bias=bias, inv_temperature=inv_temperature
        )

    def candidate_linear_backward(
        self, grad: Tensor, hidden: Tensor, weight: Tensor, candidates: Tensor, *,
        runs: Optional[Tuple[Tensor, Tensor, Tensor]], with_hidden: bool, with_weight: bool, with_bias: bool,
    ) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        return linear_candidate_ops(_reason("triton")).candidate_linear_backward(
            grad, hidden, weight, candidates, runs=runs, with_hidden=with_hidden, with_weight=with_weight,
            with_bias=with_bias,
        )

    def kept_linear_forward(self, hidden: Tensor, weight: Tensor, kept: KeptSets, *,
                            bias: Optional[Tensor] = None) -> Tensor:
        return kept_ops(_reason("triton")).kept_linear_forward(hidden, weight, kept, bias=bias)

    def kept_linear_backward(self, grad: Tensor, hidden: Tensor, weight: Tensor, kept: KeptSets, *,
                             runs: Optional[Tuple[Tensor, Tensor, Tensor]], with_hidden: bool, with_weight: bool,
                             with_bias: bool) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        return kept_ops(_reason("triton")).kept_linear_backward(
            grad, hidden, weight, kept, runs=runs, with_hidden=with_hidden, with_weight=with_weight,
            with_bias=with_bias)

    def ragged_row_forward(self, kept_logits: Tensor, kept: KeptSets, *, inv_temperature: float,
                           with_entropy: bool) -> RowSummary:
        return kept_ops(_reason("triton")).ragged_row_forward(kept_logits, kept, inv_temperature=inv_temperature,
                                                              with_entropy=with_entropy)

    def ragged_row_backward(self, kept_logits: Tensor, kept: KeptSets, summary: RowSummary, grad_logprob: Tensor,
                            *, grad_entropy: Optional[Tensor] = None, inv_temperature: float, out: Tensor) -> None:
        kept_ops(_reason("triton")).ragged_row_backward(kept_logits, kept, summary, grad_logprob,
                                                        grad_entropy=grad_entropy, inv_temperature=inv_temperature,
                                                        out=out)

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
