"""Triton backend: row ops and the group op as Triton kernels.

Runs on CUDA tensors, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``,
slow; meant for tests). This module stays cheap to import: ``triton`` and the kernel modules
are imported on first use, after the interpreter switch has been read from the environment.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import Backend, triton_interpreter_enabled


class TritonBackend(Backend):
    name = "triton"

    def unavailable_reason(self) -> Optional[str]:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton not installed"
        if torch.cuda.is_available() or triton_interpreter_enabled():
            return None
        return "no CUDA device (set TRITON_INTERPRET=1 to run the Triton kernels on CPU)"

    def supports_device(self, device: torch.device) -> bool:
        device = torch.device(device)
        if device.type == "cuda":
            return True
        return device.type == "cpu" and triton_interpreter_enabled()

    def row_forward(
        self, logits: Tensor, labels: Tensor, inv_temperature: float, with_entropy: bool
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        from .row_kernels import row_forward

        return row_forward(logits, labels, inv_temperature, with_entropy)

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
        from .row_kernels import row_backward

        row_backward(logits, labels, lse, grad_logprob, grad_entropy, entropy, inv_temperature, out)

    def candidate_forward(self, logits: Tensor, candidates: Tensor, inv_temperature: float) -> Tensor:
        from .candidate_kernels import candidate_forward

        return candidate_forward(logits, candidates, inv_temperature)

    def candidate_backward(
        self, grad_cand: Tensor, candidates: Tensor, inv_temperature: float, out: Tensor
    ) -> None:
        from .candidate_kernels import candidate_backward

        candidate_backward(grad_cand, candidates, inv_temperature, out)

    def candidate_linear_forward(self, hidden, weight, bias, candidates, inv_temperature) -> Tensor:
        from .candidate_kernels import candidate_linear_forward

        return candidate_linear_forward(hidden, weight, bias, candidates, inv_temperature)

    def candidate_linear_backward(
        self, grad, hidden, weight, candidates, runs, with_hidden, with_weight, with_bias
    ):
        from .candidate_kernels import candidate_linear_backward

        return candidate_linear_backward(
            grad, hidden, weight, candidates, runs, with_hidden, with_weight, with_bias
        )

    def group_targets(
        self, token_logprobs, layout, scores, old_seq_logprobs, eta, anchor, reduction
    ):
        from .group_kernel import group_targets

        return group_targets(
            token_logprobs, layout, scores, old_seq_logprobs, eta, anchor, reduction
        )
