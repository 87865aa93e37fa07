"""Backends: the vocab-sized row ops (layer 1) and, optionally, a fused group op (layer 2).

Every backend implements the same small interface, :class:`Backend`. The orchestration in
``tpo_kernels.autograd`` (layer 3) is written once against it.

Row-op contract (shared by every backend; ``M`` rows of a ``[M, V]`` logits matrix):

* ``row_forward(logits, labels, inv_temperature, with_entropy) -> (lse, target, entropy | None)``

  ``lse[r] = logsumexp_v(logits[r, v] * inv_temperature)`` and
  ``target[r] = logits[r, labels[r]] * inv_temperature``; the token log-prob is
  ``target - lse``. ``entropy[r] = -sum_v p log p`` of the tempered softmax. Outputs are in the
  compute dtype (float64 for float64 logits, float32 otherwise). Rows with ``labels[r] < 0`` are
  skipped: their outputs are 0 and the row is never read.

* ``row_backward(logits, labels, lse, grad_logprob, grad_entropy, entropy, inv_temperature, out)``

  Writes ``out[r, v] = inv_t * (g[r] * (onehot(labels[r])[v] - p[v])
  - ge[r] * p[v] * (log p[v] + entropy[r]))`` with ``p = exp(logits * inv_t - lse)``,
  ``g = grad_logprob``, ``ge = grad_entropy`` (``None`` means zero). ``out`` has the logits' dtype
  and shape and may be ``logits`` itself (in-place backward). Rows where ``g == 0`` and ``ge == 0``
  are written as zeros without reading the logits. ``labels[r] < 0`` contributes no one-hot term.

Candidate-op contract (token-level TPO; ``R`` states, ``K`` candidates each):

* ``candidate_forward(logits, candidates, inv_temperature) -> cand_logits``:
  ``cand_logits[r, k] = logits[r, candidates[r, k]] * inv_t`` in the compute dtype, ``[R, K]``.
* ``candidate_backward(grad_cand, candidates, inv_temperature, out)``: ``out`` (``[R, V]``, the
  logits' dtype) becomes zero except ``out[r, candidates[r, k]] += grad_cand[r, k] * inv_t``;
  duplicated candidates accumulate in ascending k order (deterministic).

* ``candidate_linear_forward(hidden, weight, bias, candidates, inv_temperature) -> cand_logits``:
  ``(hidden[r] . weight[y[r, k]] + bias[y[r, k]]) * inv_t`` without forming ``[R, V]``.
* ``candidate_linear_backward(grad, hidden, weight, candidates, runs, with_hidden, with_weight,
  with_bias) -> (dhidden, dweight, dbias)`` for ``grad`` = dLoss/d(untempered candidate logit);
  ``runs`` = :func:`tpo_kernels.backends.candidates.pair_runs` (the (r, k) pairs sorted by token
  id), so weight rows are summed in a fixed order.

The base class implements the candidate ops in PyTorch (:mod:`.candidates`); backends may
override them.

Inputs reaching a backend are already validated: 2-D contiguous logits, int64 labels in
``[0, V)`` or negative, same device.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
from torch import Tensor

BACKEND_NAMES = ("torch", "triton", "cpu", "cuda")


class Backend:
    """Interface every backend implements. Subclasses override the row ops; the group op
    defaults to the portable PyTorch one in :mod:`tpo_kernels.targets`."""

    name: str = "?"

    def unavailable_reason(self) -> Optional[str]:
        """``None`` when usable in this process, else a one-line reason."""
        return None

    def supports_device(self, device: torch.device) -> bool:
        raise NotImplementedError

    def row_forward(
        self, logits: Tensor, labels: Tensor, inv_temperature: float, with_entropy: bool
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        raise NotImplementedError

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
        raise NotImplementedError

    def candidate_forward(self, logits: Tensor, candidates: Tensor, inv_temperature: float) -> Tensor:
        from .candidates import candidate_forward

        return candidate_forward(logits, candidates, inv_temperature)

    def candidate_backward(
        self, grad_cand: Tensor, candidates: Tensor, inv_temperature: float, out: Tensor
    ) -> None:
        from .candidates import candidate_backward

        candidate_backward(grad_cand, candidates, inv_temperature, out)

    def candidate_linear_forward(self, hidden, weight, bias, candidates, inv_temperature) -> Tensor:
        from .candidates import candidate_linear_forward

        return candidate_linear_forward(hidden, weight, bias, candidates, inv_temperature)

    def candidate_linear_backward(
        self, grad, hidden, weight, candidates, runs, with_hidden, with_weight, with_bias
    ):
        from .candidates import candidate_linear_backward

        return candidate_linear_backward(
            grad, hidden, weight, candidates, runs, with_hidden, with_weight, with_bias
        )

    def group_targets(self, token_logprobs, layout, scores, old_seq_logprobs, eta, anchor, reduction):
        from ..targets import group_targets

        return group_targets(token_logprobs, layout, scores, old_seq_logprobs, eta, anchor, reduction)

    def __repr__(self) -> str:
        return f"<tpo_kernels backend {self.name!r}>"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64 (for gradcheck), everything else uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_instances: dict = {}


def _load(name: str) -> Backend:
    if name not in _instances:
        if name == "torch":
            from .pytorch import TorchBackend as cls
        elif name == "triton":
            from .triton import TritonBackend as cls
        elif name == "cpu":
            from .cpu import CpuBackend as cls
        elif name == "cuda":
            from .cuda import CudaBackend as cls
        else:  # pragma: no cover - guarded by callers
            raise ValueError(name)
        _instances[name] = cls()
    return _instances[name]


def _reason(name: str) -> Optional[str]:
    try:
        return _load(name).unavailable_reason()
    except ImportError as exc:  # a backend module whose dependency is missing
        return f"not importable: {exc}"


def backend_status() -> dict:
    """Map every backend name to ``"available"`` or a one-line reason it is not usable here."""
    return {name: (_reason(name) or "available") for name in BACKEND_NAMES}


def get_backend(name: str, device: torch.device) -> Backend:
    """Resolve ``name`` (a backend name or ``"auto"``) to a usable backend for ``device``.

    ``auto`` prefers cuda > triton on CUDA tensors and cpu > torch on CPU tensors.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    if name == "auto":
        order = ("cuda", "triton", "torch") if device.type == "cuda" else ("cpu", "torch")
        for candidate in order:
            if _reason(candidate) is None and _load(candidate).supports_device(device):
                return _load(candidate)
        return _load("torch")
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be 'auto' or one of {BACKEND_NAMES}, got {name!r}")
    reason = _reason(name)
    if reason is not None:
        raise RuntimeError(f"backend {name!r} is not usable here: {reason}")
    backend = _load(name)
    if not backend.supports_device(device):
        raise ValueError(f"backend {name!r} does not run on {device.type} tensors")
    return backend


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
