"""Backends (layer 1): the contract every backend implements (:class:`Backend`) and the registry;
one small module per backend behind it.

========  =============================================  =========================================
name      module                                         runs on
========  =============================================  =========================================
torch     :mod:`.pytorch` (chunked PyTorch)              any device
triton    :mod:`.triton` (Triton kernels)                CUDA; CPU under ``TRITON_INTERPRET=1``
cpu       :mod:`.cpu` (C++ extension ``_C_cpu``)         CPU
cuda      :mod:`.cuda` (CUDA extension ``_C_cuda``)      CUDA
========  =============================================  =========================================

Backend modules are imported on first use, so ``import tpo_kernels`` never imports Triton or
loads an extension. ``backend="auto"`` prefers cuda > triton > torch on CUDA tensors and
cpu > torch on CPU tensors. A :class:`Backend` instance may be passed wherever a name is
accepted (e.g. a backend of your own, or one wrapped for testing).

**The contract.** Every backend implements the vocabulary-sized row ops (layer 1), the
candidate ops of token-level TPO and, optionally, a fused group op (layer 2).

Row ops (``M`` rows of a ``[M, V]`` logits matrix, or ``M = B T`` rows of a ``[B, T, V]`` view
whose rows do not flatten into one row stride, such as ``logits[:, :-1]``: row ``b T + t``, read
in place, one launch each way; labels and per-row values are ``[M]`` in that order and ``out``
has the logits' shape; tensors first, settings keyword-only):

* ``row_forward(logits, labels, *, inv_temperature, with_entropy) -> RowSummary``

  A :class:`~tpo_kernels.backends.row_summary.RowSummary`, built by keyword, of ``[M]`` tensors.
  With ``z = logits[r]`` and ``d = (z - max z) * inv_temperature``: ``row_max[r] = max z``
  (untempered) and ``log_sum[r] = log sum_v exp(d_v)``, so that the tempered logsumexp is
  ``row_max * inv_t + log_sum`` (never formed: one fp32 lse of logits with a large common offset
  loses the digits a log-prob needs); ``label_logprob[r] = log softmax(z * inv_t)[labels[r]]``,
  computed so that ``1 - p`` keeps its relative accuracy for confident tokens (the label's mass
  ``e_y`` and the rest ``r`` summed apart: ``-log1p(r / e_y)`` when ``r < e_y``); ``entropy[r] =
  -sum_v p log p`` of the tempered softmax, as ``log_sum - t / s`` with ``t = sum exp(d) d`` (no
  cancellation; ``0 log 0 = 0`` at ``-inf`` logits), None unless ``with_entropy``; ``has_label[r]
  = 0 <= labels[r] < V`` (bool). All but ``has_label`` in the compute dtype (float64 for float64
  logits, float32 otherwise). Rows with ``labels[r] < 0`` are skipped: their outputs are 0 and the
  row is never read; a row with ``labels[r] >= V`` is not read either and its four float outputs
  are NaN. A NaN (or ``+inf``) logit makes the row's log_sum, label_logprob and entropy NaN; a row
  of only ``-inf`` logits has ``row_max = -inf`` and NaN log-prob and entropy (there is no
  distribution).

* ``row_backward(logits, labels, summary, grad_logprob, *, grad_entropy=None, inv_temperature,
  out)``

  ``summary``: the ``RowSummary`` of the forward (its ``row_max``, ``log_sum``, ``label_logprob``
  and, with ``grad_entropy``, ``entropy`` are read). Writes ``out[r, v] = inv_t * (g[r] *
  (onehot(labels[r])[v] - p[v]) - ge[r] * p[v] * (log p[v] + entropy[r]))`` with ``log p =
  (logits - row_max) * inv_t - log_sum``, ``g = grad_logprob`` and ``ge = grad_entropy`` (None:
  zero); the label's entry takes ``log p`` from ``label_logprob`` and ``1 - p`` as
  ``-expm1(label_logprob)``. ``p log p`` is 0 where ``p == 0``. ``out`` has the logits' dtype and
  shape and may be ``logits`` itself (in-place backward); the native and Triton backends read
  logits whose rows overlap from a copy and fill an ``out`` whose rows overlap by
  ``out.copy_(gradient)`` (:func:`rows_in_place`, :func:`gradient_buffer`: no two programs store
  one address). Rows where ``g == 0`` and ``ge == 0`` are written as zeros without reading the
  logits; a label outside ``[0, V)`` adds no one-hot term. The summary may come from a wider row
  than ``logits`` (the fused-linear path passes a vocabulary block with the summary of the whole
  row and block-local labels).

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
  :func:`tpo_kernels.group_math.pair_runs` (needed for the weight and bias gradients), so that
  weight rows are summed in a fixed order. An id outside ``[0, V)`` adds nothing to dhidden (its
  grad is ignored) and is not written in dweight / dbias.

Kept-set ops (sampling-mask replay; ``kept`` a :class:`~tpo_kernels.backends.kept_sets.KeptSets`
of ``P`` (row, id) pairs over ``M`` rows; a negative id is a hole: no entry):

* ``kept_gather(logits, kept) -> [P]``: raw ``logits[row, id]`` in the compute dtype from ``[M, V]``
  or a ``[B, T, V]`` view (hole: ``-inf``; id ``>= V``: NaN).
* ``kept_scatter(grad, kept, *, out)``: ``out`` zero except ``out[row, id]``, the sum of that row's
  pairs in ascending order; holes and ids outside ``[0, V)`` are never written.
* ``kept_linear_forward(hidden, weight, kept, *, bias=None) -> [P]``: raw ``h[row] . W[id] + b[id]``.
* ``kept_linear_backward(grad, hidden, weight, kept, *, runs, with_hidden, with_weight, with_bias)``:
  as ``candidate_linear_backward``, ``runs = pair_runs(kept.ids)``.
* ``ragged_row_forward(kept_logits, kept, *, inv_temperature, with_entropy) -> RowSummary`` and
  ``ragged_row_backward(kept_logits, kept, summary, grad_logprob, *, grad_entropy=None,
  inv_temperature, out)``: the row ops above over row ``r = kept_logits[offsets[r]:offsets[r+1]]``
  with label ``label_slot[r] - offsets[r]``; a label slot of -1 follows the negative-label rule,
  -2 (the label is not in the set) the ``labels >= V`` rule for the label log-prob only (the
  statistics are computed); ``out`` is ``[P]`` in the compute dtype.

Group op: ``group_targets(token_logprobs, layout, scores, *, old_seq_logprobs=None,
seq_log_weights=None, eta, anchor, score_eps=0.0) -> GroupResult`` (see :mod:`tpo_kernels.group_math`;
``score_eps >= 0`` is the near-tie tolerance: a group whose scores' population std is at most it gets
``u = s - mean``, undivided; ``seq_log_weights`` ``lw``, finite or -inf, is added by one same add to
``ell`` and to q's base, and a member with ``lw = -inf`` has ``p = q = 0`` and no u): the sequence sums and the
``[N]``-sized group math run in float64 (``scores``, ``old_seq_logprobs`` and ``seq_log_weights`` arrive in float64),
the results come back in the dtype of the token log-probs, with ``coef = p - q`` formed before
the rounding (``None`` lets the caller take the difference of the rounded p and q).

The base class supplies PyTorch implementations of the candidate ops
(:mod:`tpo_kernels.backends.torch_candidates`), of the kept-set ops
(:mod:`tpo_kernels.backends.torch_kept`) and of the group op; a backend overrides what it has
kernels for. Inputs reaching a backend have validated metadata: 2-D logits (3-D for the row
ops) with unit column stride, int64 ids, one device. Id values are checked only with ``validate=True``, so every op
checks each id where it touches memory (DESIGN.md, "Ids outside the vocabulary": the results
above for ids outside ``[0, V)``, where ``V`` is the view's width, not its row stride, on every
backend).
"""

from __future__ import annotations

import importlib
import os
from typing import Dict, Optional, Union

import torch
from torch import Tensor

from .. import group_math
from . import torch_candidates, torch_kept
from .row_summary import RowSummary

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
    ) -> RowSummary:
        raise NotImplementedError

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
        raise NotImplementedError

    # PyTorch defaults; plain functions, so a backend overrides one by assigning its own.
    candidate_forward = staticmethod(torch_candidates.candidate_forward)
    candidate_backward = staticmethod(torch_candidates.candidate_backward)
    candidate_linear_forward = staticmethod(torch_candidates.candidate_linear_forward)
    candidate_linear_backward = staticmethod(torch_candidates.candidate_linear_backward)
    group_targets = staticmethod(group_math.portable_group_targets)
    kept_gather = staticmethod(torch_kept.kept_gather)
    kept_scatter = staticmethod(torch_kept.kept_scatter)
    kept_linear_forward = staticmethod(torch_kept.kept_linear_forward)
    kept_linear_backward = staticmethod(torch_kept.kept_linear_backward)
    ragged_row_forward = staticmethod(torch_kept.ragged_row_forward)
    ragged_row_backward = staticmethod(torch_kept.ragged_row_backward)

    def __repr__(self) -> str:
        return f"<tpo_kernels backend {self.name!r}>"


# ----------------------------------------------------------------------------- registry

BACKEND_NAMES = ("torch", "triton", "cpu", "cuda")
_MODULES = {"torch": ("pytorch", "TorchBackend"), "triton": ("triton", "TritonBackend"),
            "cpu": ("cpu", "CpuBackend"), "cuda": ("cuda", "CudaBackend")}
_AUTO_ORDER = {"cuda": ("cuda", "triton", "torch")}
_AUTO_ORDER_DEFAULT = ("cpu", "torch")

# Every backend a call may dispatch to, by key: the built-in ones by name, user instances under a
# key of their own. The custom ops of tpo_kernels.ops take this key (a string) as an argument.
_REGISTRY: Dict[str, Backend] = {}


def _load(name: str) -> Backend:
    if name not in _REGISTRY:
        module, cls = _MODULES[name]
        _REGISTRY[name] = getattr(importlib.import_module(f".{module}", __name__), cls)()
    return _REGISTRY[name]


def _reason(name: str) -> Optional[str]:
    try:
        return _load(name).unavailable_reason()
    except ImportError as exc:  # a backend module whose dependency is missing
        return f"not importable: {exc}"


def backend_status() -> dict:
    """Map every backend name to ``"available"`` or a one-line reason it is not usable here."""
    return {name: (_reason(name) or "available") for name in BACKEND_NAMES}


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ----------------------------------------------------------------------------- row layouts


def rows_in_place(t: Tensor) -> bool:
    """Whether a row kernel may read and write ``t`` where it lies: a ``[M, V]`` matrix or a ``[B,
    T, V]`` view with unit column stride whose rows never overlap (a row stride of at least V,
    batch entries apart). The native and Triton backends copy anything else before a kernel sees
    it: overlapping rows (an ``expand``, a row stride below V) written in place would be stored by
    several programs at once, and read after another program wrote them."""
    if t.dim() not in (2, 3) or t.numel() == 0 or t.stride(-1) != 1:
        return False
    per_batch, vocab = t.shape[-2:]
    step = t.stride(-2) if per_batch > 1 else vocab
    return step >= vocab and (t.dim() == 2 or t.shape[0] == 1 or t.stride(0) >= (per_batch - 1) * step + vocab)


def gradient_buffer(rows: Tensor, out: Tensor) -> Tensor:
    """Where a row backward kernel reading ``rows`` (a layout :func:`rows_in_place` accepts) writes
    the gradient for ``out``: ``out`` itself when it can be written in place (rows_in_place, the
    dtype of ``rows`` and, if it starts where ``rows`` does, their layout, so that each row is read
    before it is written), else a new buffer that the caller copies into ``out`` afterwards."""
    direct = (out.dtype == rows.dtype and rows_in_place(out)
              and (out.data_ptr() != rows.data_ptr() or out.stride() == rows.stride()))
    return out if direct else torch.empty_like(rows)


# The registry checks the one argument it resolves itself (so that backends/ imports nothing above it).


def _check_backend_arg(backend) -> None:
    """``backend`` is "auto", a backend name or a Backend instance."""
    if isinstance(backend, Backend):
        return
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string or a tpo_kernels Backend, got {type(backend).__name__}")
    if backend != "auto" and backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be 'auto' or one of {BACKEND_NAMES} (or a Backend instance), got {backend!r}")


def _device_error(name: str, device: torch.device) -> ValueError:
    return ValueError(f"backend {name!r} does not run on {device.type} tensors")


def get_backend(backend: Union[str, Backend], device: torch.device) -> Backend:
    """Resolve ``backend`` (a name, ``"auto"`` or a :class:`Backend`) to a usable backend for
    ``device``; raises naming ``backend`` when it cannot run there."""
    _check_backend_arg(backend)
    if isinstance(backend, Backend):
        reason = backend.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"backend {backend.name!r} is not usable here: {reason}")
        if not backend.supports_device(device):
            raise _device_error(backend.name, device)
        return backend
    return _REGISTRY[_usable_backend_name(backend, device.type)]


@torch.compiler.assume_constant_result
def _usable_backend_name(backend: str, device_type: str) -> str:
    """The built-in backend that ``backend`` (a name or "auto") resolves to on ``device_type``,
    loaded into the registry. Under torch.compile this runs once at trace time and its result is a
    constant of the graph: loading a backend imports a module, which Dynamo cannot trace, so a
    compiled step works from the first tpo_kernels call of a process."""
    device = torch.device(device_type)
    if backend == "auto":
        for name in _AUTO_ORDER.get(device_type, _AUTO_ORDER_DEFAULT):
            if _reason(name) is None and _load(name).supports_device(device):
                return name
        _load("torch")
        return "torch"
    reason = _reason(backend)
    if reason is not None:
        raise RuntimeError(f"backend {backend!r} is not usable here: {reason}")
    if not _load(backend).supports_device(device):
        raise _device_error(backend, device)
    return backend


def backend_key(backend: Backend) -> str:
    """The string under which the custom ops find ``backend`` (registering it if needed)."""
    if _REGISTRY.get(backend.name) is backend:
        return backend.name
    key = f"{backend.name}@{id(backend):x}"
    _REGISTRY[key] = backend
    return key


def resolve_backend_key(backend: Union[str, Backend], device: torch.device) -> str:
    """The key of the backend a call dispatches to: :func:`get_backend`, then :func:`backend_key`."""
    return backend_key(get_backend(backend, device))


def backend_by_key(key: str) -> Backend:
    return _REGISTRY[key] if key in _REGISTRY else _load(key)


__all__ = ["BACKEND_NAMES", "Backend", "backend_by_key", "backend_key", "backend_status",
           "get_backend", "gradient_buffer", "resolve_backend_key", "rows_in_place", "triton_interpreter_enabled"]
