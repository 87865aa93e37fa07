"""The interface every backend implements: the vocabulary-sized row ops (layer 1), the
candidate ops of token-level TPO and, optionally, a fused group op (layer 2).

Row ops (``M`` rows of a ``[M, V]`` logits matrix, or ``M = B T`` rows of a ``[B, T, V]`` view
whose rows do not flatten into one row stride, such as ``logits[:, :-1]``: row ``b T + t``, read
in place, one launch each way; labels and per-row values are ``[M]`` in that order and ``out``
has the logits' shape; tensors first, settings keyword-only):

* ``row_forward(logits, labels, *, inv_temperature, with_entropy) -> (stats, logprob, entropy | None)``

  With ``z = logits[r]`` and ``d = (z - max z) * inv_temperature``: ``stats`` is ``[2, M]``,
  ``stats[0, r] = max z`` (untempered) and ``stats[1, r] = log sum_v exp(d_v)``, so that the
  tempered logsumexp is ``stats[0] * inv_t + stats[1]`` (never formed: one fp32 lse of logits
  with a large common offset loses the digits a log-prob needs); ``logprob[r] = log
  softmax(z * inv_t)[labels[r]]``, computed so that ``1 - p`` keeps its relative accuracy for
  confident tokens (the label's mass ``e_y`` and the rest ``r`` summed apart: ``-log1p(r / e_y)``
  when ``r < e_y``); ``entropy[r] = -sum_v p log p`` of the tempered softmax, as ``log_sum - t / s``
  with ``t = sum exp(d) d`` (no cancellation; ``0 log 0 = 0`` at ``-inf`` logits). All in the
  compute dtype (float64 for float64 logits, float32 otherwise). Rows with ``labels[r] < 0`` are
  skipped: their outputs are 0 and the row is never read; a row with ``labels[r] >= V`` is not
  read either and its four outputs are NaN. A NaN (or ``+inf``) logit makes the
  row's log_sum, logprob and entropy NaN; a row of only ``-inf`` logits has ``stats[0] = -inf``
  and NaN log-prob and entropy (there is no distribution).

* ``row_backward(logits, labels, stats, logprob, grad_logprob, *, grad_entropy=None,
  entropy=None, inv_temperature, out)``

  Writes ``out[r, v] = inv_t * (g[r] * (onehot(labels[r])[v] - p[v]) - ge[r] * p[v] * (log p[v]
  + entropy[r]))`` with ``log p = (logits - stats[0]) * inv_t - stats[1]``, ``g = grad_logprob``
  and ``ge = grad_entropy`` (None: zero); the label's entry takes ``log p`` from ``logprob`` and
  ``1 - p`` as ``-expm1(logprob)``. ``p log p`` is 0 where ``p == 0``. ``out`` has the logits'
  dtype and shape and may be ``logits`` itself (in-place backward). Rows where ``g == 0`` and
  ``ge == 0`` are written as zeros without reading the logits; a label outside ``[0, V)`` adds no
  one-hot term. The statistics may come from a wider row than ``logits`` (the fused-linear path passes
  a vocabulary block with the statistics of the whole row and block-local labels).

Candidate ops (token-level TPO; ``R`` states with ``K`` candidate token ids each):

* ``candidate_forward(logits, candidates, *, inv_temperature) -> [R, K]``:
  ``logits[r, candidates[r, k]] * inv_t`` in the compute dtype (NaN for an id outside ``[0, V)``).
* ``candidate_backward(grad_cand, candidates, *, inv_temperature, out)``: ``out`` (``[R, V]``,
  the logits' dtype) becomes zero except ``out[r, candidates[r, k]] += grad_cand[r, k] * inv_t``;
  repeated candidates accumulate in ascending k order (deterministic); an id outside ``[0, V)``
  is not written.
* ``candidate_linear_forward(hidden, weight, candidates, *, bias=None, inv_temperature)``:
  ``(hidden[r] . weight[y[r, k]] + bias[y[r, k]]) * inv_t`` without forming ``[R, V]`` (NaN for
  an id outside ``[0, V)``, ``V = weight.shape[0]``).
* ``candidate_linear_backward(grad, hidden, weight, candidates, *, runs, with_hidden,
  with_weight, with_bias) -> (dhidden, dweight, dbias)``, each None unless requested, for
  ``grad`` = dLoss/d(untempered candidate logit); ``runs`` is
  :func:`tpo_kernels.layout.pair_runs` (needed for the weight and bias gradients), so that
  weight rows are summed in a fixed order. An id outside ``[0, V)`` adds nothing to dhidden (its
  grad is ignored) and is not written in dweight / dbias.

Group op: ``group_targets(token_logprobs, layout, scores, *, old_seq_logprobs=None, eta,
anchor, score_eps=0.0) -> GroupResult`` (see :mod:`tpo_kernels.group_math`; ``score_eps >= 0`` is
the near-tie tolerance: a group whose scores' population std is at most it gets ``u = s - mean``,
undivided): the sequence sums and the
``[N]``-sized group math run in float64 (``scores`` and ``old_seq_logprobs`` arrive in float64),
the results come back in the dtype of the token log-probs, with ``coef = p - q`` formed before
the rounding (``None`` lets the caller take the difference of the rounded p and q).

The base class supplies PyTorch implementations of the candidate ops
(:mod:`tpo_kernels.backends.torch_candidates`) and of the group op; a backend overrides what it has
kernels for. Inputs reaching a backend have validated metadata: 2-D logits (3-D for the row
ops) with unit column stride, int64 ids, one device. Id values are checked only with ``validate=True``, so every op
checks each id where it touches memory (DESIGN.md, "Ids outside the vocabulary": the results
above for ids outside ``[0, V)``, where ``V`` is the view's width, not its row stride, on every
backend).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import group_math
from . import torch_candidates


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
        stats: Tensor,
        logprob: Tensor,
        grad_logprob: Tensor,
        *,
        grad_entropy: Optional[Tensor] = None,
        entropy: Optional[Tensor] = None,
        inv_temperature: float,
        out: Tensor,
    ) -> None:
        raise NotImplementedError

    # PyTorch defaults; plain functions, so a backend overrides one by assigning its own.
    candidate_forward = staticmethod(torch_candidates.candidate_forward)
    candidate_backward = staticmethod(torch_candidates.candidate_backward)
    candidate_linear_forward = staticmethod(torch_candidates.candidate_linear_forward)
    candidate_linear_backward = staticmethod(torch_candidates.candidate_linear_backward)
    group_targets = staticmethod(group_math.portable_group_targets)

    def __repr__(self) -> str:
        return f"<tpo_kernels backend {self.name!r}>"
