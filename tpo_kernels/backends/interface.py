"""The interface every backend implements: the vocabulary-sized row ops (layer 1), the
candidate ops of token-level TPO and, optionally, a fused group op (layer 2).

Row ops (``M`` rows of a ``[M, V]`` logits matrix; tensors first, settings keyword-only):

* ``row_forward(logits, labels, *, inv_temperature, with_entropy) -> (lse, target, entropy | None)``

  ``lse[r] = logsumexp_v(logits[r, v] * inv_temperature)``,
  ``target[r] = logits[r, labels[r]] * inv_temperature`` (the token log-prob is
  ``target - lse``) and ``entropy[r] = -sum_v p log p`` of the tempered softmax, in the compute
  dtype (float64 for float64 logits, float32 otherwise). Rows with ``labels[r] < 0`` are skipped:
  their outputs are 0 and the row is never read.

* ``row_backward(logits, labels, lse, grad_logprob, *, grad_entropy=None, entropy=None,
  inv_temperature, out)``

  Writes ``out[r, v] = inv_t * (g[r] * (onehot(labels[r])[v] - p[v])
  - ge[r] * p[v] * (log p[v] + entropy[r]))`` with ``p = exp(logits * inv_t - lse)``,
  ``g = grad_logprob`` and ``ge = grad_entropy`` (None: zero). ``out`` has the logits' dtype and
  shape and may be ``logits`` itself (in-place backward). Rows where ``g == 0`` and ``ge == 0``
  are written as zeros without reading the logits; ``labels[r] < 0`` adds no one-hot term.

Candidate ops (token-level TPO; ``R`` states with ``K`` candidate token ids each):

* ``candidate_forward(logits, candidates, *, inv_temperature) -> [R, K]``:
  ``logits[r, candidates[r, k]] * inv_t`` in the compute dtype.
* ``candidate_backward(grad_cand, candidates, *, inv_temperature, out)``: ``out`` (``[R, V]``,
  the logits' dtype) becomes zero except ``out[r, candidates[r, k]] += grad_cand[r, k] * inv_t``;
  repeated candidates accumulate in ascending k order (deterministic).
* ``candidate_linear_forward(hidden, weight, candidates, *, bias=None, inv_temperature)``:
  ``(hidden[r] . weight[y[r, k]] + bias[y[r, k]]) * inv_t`` without forming ``[R, V]``.
* ``candidate_linear_backward(grad, hidden, weight, candidates, *, runs, with_hidden,
  with_weight, with_bias) -> (dhidden, dweight, dbias)``, each None unless requested, for
  ``grad`` = dLoss/d(untempered candidate logit); ``runs`` is
  :func:`tpo_kernels.layout.pair_runs` (needed for the weight and bias gradients), so that
  weight rows are summed in a fixed order.

Group op: ``group_targets(token_logprobs, layout, scores, *, old_seq_logprobs=None, eta,
anchor) -> GroupResult`` (see :mod:`tpo_kernels.group_op`).

The base class supplies PyTorch implementations of the candidate ops
(:mod:`tpo_kernels.backends.candidates`) and of the group op; a backend overrides what it has
kernels for. Inputs reaching a backend are validated: 2-D logits with unit column stride,
int64 labels in ``[0, V)`` or negative, one device.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import group_op
from . import candidates


class Backend:
    """A backend: a name, where it runs, and the ops above."""

    name: str = "?"

    def unavailable_reason(self) -> Optional[str]:
        """``None`` when usable in this process, else a one-line reason."""
        return None

    def supports_device(self, device: torch.device) -> bool:
        raise NotImplementedError

    def row_forward(
        self, logits: Tensor, labels: Tensor, *, inv_temperature: float, with_entropy: bool
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        raise NotImplementedError

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
        raise NotImplementedError

    # PyTorch defaults; plain functions, so a backend overrides one by assigning its own.
    candidate_forward = staticmethod(candidates.candidate_forward)
    candidate_backward = staticmethod(candidates.candidate_backward)
    candidate_linear_forward = staticmethod(candidates.candidate_linear_forward)
    candidate_linear_backward = staticmethod(candidates.candidate_linear_backward)
    group_targets = staticmethod(group_op.group_targets)

    def __repr__(self) -> str:
        return f"<tpo_kernels backend {self.name!r}>"
