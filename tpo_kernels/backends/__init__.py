"""Backends (layer 1): the contract every backend implements (:class:`Backend`), its PyTorch
implementation (:class:`TorchBackend`, the reference beside the contract) and the registry; one
small module per compiled backend behind it.

========  =============================================  =========================================
name      module                                         runs on
========  =============================================  =========================================
torch     this module (chunked PyTorch)                  any device
triton    :mod:`.triton` (Triton kernels)                CUDA; CPU under ``TRITON_INTERPRET=1``
cpu       :mod:`.cpu` (C++ extension ``_C_cpu``)         CPU
cuda      :mod:`.cuda` (CUDA extension ``_C_cuda``)      CUDA
========  =============================================  =========================================

Backend modules are imported on first use, so ``import tpo_kernels`` never imports Triton or
loads an extension. ``backend="auto"`` prefers cuda > triton > torch on CUDA tensors and
cpu > torch on CPU tensors. A :class:`Backend` instance may be passed wherever a name is
accepted (e.g. a backend of your own, or one wrapped for testing).

**The contract.** Every backend implements the vocabulary-sized row ops (layer 1), the
kept-set ops (a few ids per row: sampling-mask replay, and token-level TPO's candidates) and,
optionally, a fused group op (layer 2).

Row ops (``M`` rows of a ``[M, V]`` logits matrix, or ``M = B T`` rows of a ``[B, T, V]`` view
whose rows do not flatten into one row stride, such as ``logits[:, :-1]``: row ``b T + t``, read
in place, one launch each way; labels and per-row values are ``[M]`` in that order and ``out``
has the logits' shape; tensors first, settings keyword-only):

* ``row_forward(logits, labels, *, inv_temperature, with_entropy) -> RowSummary``

  A :class:`~tpo_kernels.backends.rows.RowSummary`, built by keyword, of ``[M]`` tensors.
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
  ``out.copy_(gradient)`` (:func:`.rows.rows_in_place`, :func:`.rows.gradient_buffer`: no two programs store
  one address). Rows where ``g == 0`` and ``ge == 0`` are written as zeros without reading the
  logits; a label outside ``[0, V)`` adds no one-hot term. The summary may come from a wider row
  than ``logits`` (the fused-linear path passes a vocabulary block with the summary of the whole
  row and block-local labels).

Kept-set ops (``kept`` a :class:`~tpo_kernels.backends.kept_sets.KeptSets` of ``P`` (row, id)
pairs over ``M`` rows; a negative id is a hole: no entry). Sampling-mask replay runs all six;
token-level TPO's ``[R, K]`` candidates are kept sets of K pairs per row (``offsets = K arange(R +
1)``, :meth:`~tpo_kernels.backends.kept_sets.KeptSets.from_candidates`) through the first four
(:mod:`tpo_kernels.ops.candidates` adds the temperature and its NaN for a negative id):

* ``kept_gather(logits, kept) -> [P]``: raw ``logits[row, id]`` in the compute dtype from ``[M, V]``
  or a ``[B, T, V]`` view (hole: ``-inf``; id ``>= V``: NaN).
* ``kept_scatter(grad, kept, *, out)``: ``out`` zero except ``out[row, id]``, the sum of that row's
  pairs (duplicate ids: candidates drawn with replacement) in ascending order in ``grad``'s dtype,
  rounded to ``out``'s once; holes and ids outside ``[0, V)`` are never written.
* ``kept_linear_forward(hidden, weight, kept, *, bias=None) -> [P]``: raw ``h[row] . W[id] + b[id]``.
* ``kept_linear_backward(grad, hidden, weight, kept, *, runs, with_hidden, with_weight, with_bias)
  -> (dhidden, dweight, dbias)``, each None unless requested, for ``grad [P]`` = dLoss/d(raw kept
  logit); ``runs = pair_runs(kept.ids)`` (:func:`tpo_kernels.group_math.pair_runs`, needed for the
  weight and bias gradients), so that weight rows are summed in a fixed order. A hole or an id
  outside ``[0, V)`` adds nothing to dhidden (its grad is ignored) and is not written in dweight / dbias.
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

The base class supplies PyTorch implementations of the kept-set ops
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
from . import torch_kept
from .rows import RowSummary, compute_dtype, gradient_buffer

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
    group_targets = staticmethod(group_math.portable_group_targets)
    kept_gather = staticmethod(torch_kept.kept_gather)
    kept_scatter = staticmethod(torch_kept.kept_scatter)
    kept_linear_forward = staticmethod(torch_kept.kept_linear_forward)
    kept_linear_backward = staticmethod(torch_kept.kept_linear_backward)
    ragged_row_forward = staticmethod(torch_kept.ragged_row_forward)
    ragged_row_backward = staticmethod(torch_kept.ragged_row_backward)

    def __repr__(self) -> str:
        return f"<tpo_kernels backend {self.name!r}>"


# ----------------------------------------------------------------------------- the torch backend
#
# Portable PyTorch row ops, the fallback on any device. They work on chunks of consecutive rows (of a
# ``[M, V]`` matrix, or whole entries / row ranges of a ``[B, T, V]`` view such as ``logits[:, :-1]``,
# read in place), each pass over a chunk one vectorized op into a reused buffer of at most
# ``_CHUNK_ELEMENTS`` compute-dtype values, never a full ``[M, V]`` fp32 copy of the logits (the chunk
# size trades op count, each op a parallel region, against memory). Every row is computed and the
# rows to skip (negative label forward, zero gradient backward) are then set to 0 by ``torch.where``
# on per-row results: the results of never reading them, with no count or index of rows read back to
# the host (sync-free, CUDA-graph capturable). Ids outside the vocabulary (DESIGN.md) the same way: a
# label ``>= V`` is read as column 0, its row's outputs then replaced by NaN, and the backward adds no
# one-hot term for it (no index error, no device-side assert).

_CHUNK_ELEMENTS = 1 << 23  # 32 MiB of fp32 per buffer: few ops per call, far below one [M, V] copy


def _chunks(batch: int, per_batch: int, vocab: int):
    """``([(batch slice, row slice)], rows per chunk at most)`` covering a ``[B, T, V]`` batch (a
    ``[M, V]`` matrix is ``[1, M, V]``): whole batch entries per chunk while they fit, else row
    ranges of one entry; each chunk is one ``[b, t, V]`` view, so a ``logits[:, :-1]`` view is read
    in place in as few ops as a matrix of the same size."""
    if batch * per_batch == 0:
        return [], 0
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    if per_batch <= step:
        entries = max(1, step // max(per_batch, 1))
        chunks = [(slice(b, min(b + entries, batch)), slice(0, per_batch)) for b in range(0, batch, entries)]
    else:
        chunks = [(slice(b, b + 1), slice(t, min(t + step, per_batch)))
                  for b in range(batch) for t in range(0, per_batch, step)]
    return chunks, min(step, batch * per_batch)


def _as_batch(t: Tensor) -> Tensor:
    """``[M, V]`` as ``[1, M, V]``; a ``[B, T, V]`` view as it is."""
    return t.unsqueeze(0) if t.dim() == 2 else t


def _shifted(z: Tensor, shift: Tensor, inv_temperature: float, out: Tensor) -> Tensor:
    """``(z - shift) * inv_temperature`` written into ``out`` (which may be ``z`` itself)."""
    torch.sub(z, shift, out=out)
    return out if inv_temperature == 1.0 else out.mul_(inv_temperature)


class TorchBackend(Backend):
    name = "torch"

    def supports_device(self, device: torch.device) -> bool:
        return True

    def row_forward(
        self, logits: Tensor, labels: Tensor, *, inv_temperature: float, with_entropy: bool
    ) -> RowSummary:
        z3 = _as_batch(logits)
        batch, per_batch, v = z3.shape
        m = batch * per_batch
        acc = compute_dtype(logits.dtype)
        row_max, log_sum = logits.new_zeros(m, dtype=acc), logits.new_zeros(m, dtype=acc)
        logprob = logits.new_zeros(m, dtype=acc)
        entropy = logits.new_zeros(m, dtype=acc) if with_entropy else None
        chunks, rows_max = _chunks(batch, per_batch, v)
        buffer = logits.new_empty(rows_max * v, dtype=acc)
        weights = logits.new_empty(rows_max * v, dtype=acc) if with_entropy else None
        labels = labels.reshape(m)
        labels3 = labels.view(batch, per_batch)
        row_max3, log_sum3 = row_max.view(batch, per_batch), log_sum.view(batch, per_batch)
        logprob3 = logprob.view(batch, per_batch)
        entropy3 = entropy.view(batch, per_batch) if with_entropy else None
        for bs, ts in chunks:
            z = z3[bs, ts]  # read only: may be the logits the backward overwrites later
            lab = labels3[bs, ts]
            counted = lab >= 0
            in_vocab = counted & (lab < v)
            # NaN for a label >= V (as the native kernels), 0 for an ignored (negative) one.
            skipped = torch.where(counted, float("nan"), 0.0).to(acc)
            label = torch.where(in_vocab, lab, 0).unsqueeze(-1)
            chunk_max = z.amax(dim=-1).to(acc)
            # d = (z - max) * it <= 0; an all -inf row shifts by 0 (no -inf - -inf).
            shift = torch.where(chunk_max == float("-inf"), 0.0, chunk_max).unsqueeze(-1)
            d = _shifted(z, shift, inv_temperature, buffer[: z.numel()].view(z.shape))
            d_y = d.gather(-1, label).squeeze(-1)
            if with_entropy:
                e = torch.exp(d, out=weights[: z.numel()].view(z.shape))
                # t = sum e d, with 0 (not 0 * -inf) where e == 0: -inf becomes the lowest float.
                t = d.clamp_(min=torch.finfo(acc).min).mul_(e).sum(dim=-1)
            else:
                e = d.exp_()
            e_y = e.gather(-1, label).squeeze(-1)
            rest = e.scatter_(-1, label, 0.0).sum(dim=-1)  # the mass without the label
            total = rest + e_y
            chunk_log_sum = torch.log(total)
            # log(e_y / (e_y + rest)): -log1p(rest / e_y) keeps 1 - p exact-ish for confident tokens.
            lp = torch.where(rest < e_y, -torch.log1p(rest / e_y), d_y - chunk_log_sum)
            logprob3[bs, ts] = torch.where(in_vocab, lp, skipped)
            row_max3[bs, ts] = torch.where(in_vocab, chunk_max, skipped)
            log_sum3[bs, ts] = torch.where(in_vocab, chunk_log_sum, skipped)
            if with_entropy:
                entropy3[bs, ts] = torch.where(in_vocab, chunk_log_sum - t / total, skipped)
        return RowSummary(row_max=row_max, log_sum=log_sum, label_logprob=logprob, entropy=entropy,
                          has_label=(labels >= 0) & (labels < v))

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
        # Chunk by chunk in place, overlapping rows of ``out`` would overwrite logits a later chunk
        # still reads: such an ``out`` gets the gradient through a buffer, as on every backend.
        target = gradient_buffer(logits, out)
        z3, out3 = _as_batch(logits), _as_batch(target)
        batch, per_batch, v = z3.shape
        acc = compute_dtype(logits.dtype)
        it = inv_temperature
        chunks, rows_max = _chunks(batch, per_batch, v)

        def rows_of(t: Optional[Tensor]) -> Optional[Tensor]:
            return None if t is None else t.reshape(batch, per_batch)

        labels3, logprob3, grad3 = rows_of(labels), rows_of(summary.label_logprob), rows_of(grad_logprob)
        grad_entropy3 = rows_of(grad_entropy)
        entropy3 = rows_of(summary.entropy) if grad_entropy is not None else None
        if grad_entropy is not None and entropy3 is None:
            raise ValueError("row_backward: grad_entropy needs the forward's entropy (summary.entropy is None)")
        row_max3, log_sum3 = rows_of(summary.row_max), rows_of(summary.log_sum)
        # The gradient of a chunk is formed in a scratch buffer; zero-signal rows are filled with 0
        # there (NaN logits or not: masked_fill, no read-back) before the copy out.
        scratch = logits.new_empty(rows_max * v, dtype=acc)
        probs_buffer = logits.new_empty(rows_max * v, dtype=acc) if grad_entropy is not None else None
        for bs, ts in chunks:
            z = z3[bs, ts]
            g = grad3[bs, ts].unsqueeze(-1)
            active = g != 0
            label = labels3[bs, ts].unsqueeze(-1)
            has_label = (label >= 0) & (label < v)  # a label outside [0, V) adds no one-hot term
            col = torch.where(has_label, label, 0)
            lp = logprob3[bs, ts].unsqueeze(-1)
            label_grad = -g * torch.expm1(lp)  # g (1 - p_y), accurate for confident tokens
            log_probs = _shifted(z, row_max3[bs, ts].unsqueeze(-1), it, scratch[: z.numel()].view(z.shape))
            log_probs.sub_(log_sum3[bs, ts].unsqueeze(-1))
            if grad_entropy is None:
                grad = log_probs.exp_().mul_(-g * it)  # -g p / tau
            else:
                ge = grad_entropy3[bs, ts].unsqueeze(-1)
                ent = entropy3[bs, ts].unsqueeze(-1)
                active = active | (ge != 0)
                probs = torch.exp(log_probs, out=probs_buffer[: z.numel()].view(z.shape))
                # -(g p + ge p (log p + H)) / tau, with p log p -> 0 at p == 0 (log p clamped finite).
                grad = log_probs.clamp_(min=torch.finfo(acc).min).mul_(probs).mul_(-ge * it)
                grad.addcmul_(probs, -(g + ge * ent) * it)
                p_y = torch.exp(lp)
                label_grad = label_grad - ge * p_y * (torch.where(p_y > 0, lp, 0.0) + ent)
            # The label's entry replaces the column (rows without a label keep column 0 as is).
            grad.scatter_(-1, col, torch.where(has_label, label_grad * it, grad.gather(-1, col)))
            out3[bs, ts].copy_(grad.masked_fill_(~active, 0.0))
        if target is not out:
            out.copy_(target)


# ----------------------------------------------------------------------------- registry

BACKEND_NAMES = ("torch", "triton", "cpu", "cuda")
_MODULES = {"triton": ("triton", "TritonBackend"),
            "cpu": ("cpu", "CpuBackend"), "cuda": ("cuda", "CudaBackend")}
_AUTO_ORDER = {"cuda": ("cuda", "triton", "torch")}
_AUTO_ORDER_DEFAULT = ("cpu", "torch")

# Every backend a call may dispatch to, by key: the built-in ones by name, user instances under a
# key of their own. The custom ops of tpo_kernels.ops take this key (a string) as an argument.
_REGISTRY: Dict[str, Backend] = {"torch": TorchBackend()}


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


__all__ = ["BACKEND_NAMES", "Backend", "TorchBackend", "backend_by_key", "backend_key", "backend_status",
           "get_backend", "resolve_backend_key", "triton_interpreter_enabled"]
