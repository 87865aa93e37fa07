"""The row stage's records: what a row op is asked (:class:`RowRequest`, with the logit transform
it applies around the kernels) and what it gives back (:class:`RowSummary`, with the one exact
merge of two vocabulary ranges); the compute dtype of its fields (and of every reduction of the
package); and the row layouts the kernels may read and write in place.

A row op over the ``[M, V]`` logits (or a ``[B, T, V]`` view, ``M = B T``) gives, per row, the raw
max of its logits and the log-sum of ``exp((z - max) / tau)`` (the row statistics), the label's
log-prob, on request the entropy, and whether the label lies in the range it read. A range of the
vocabulary (a block of the fused-linear tiles, or one rank's vocabulary shard) gives the same
summary over its part; :meth:`RowSummary.merge` combines two disjoint ranges exactly. Both the
fused-linear tiles and the vocabulary shards merge through it, and everything that carries a
summary (the custom ops' outputs and saved tensors through :meth:`RowSummary.to_op` /
:meth:`RowSummary.from_op`, row selections, the vocabulary-parallel gather) walks its fields by
name, so a new per-row quantity lands in the kernels and this record only. Both records cross the
``torch.library`` boundary whole, flattened by their ``to_op``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # the dtypes the package accepts


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64 (for gradcheck), every other dtype uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- what a row op is asked

# Logit scaling and soft-capping, applied by the orchestration layer around unchanged row ops.
#
# Models transform their lm_head output before the softmax: Cohere multiplies it by
# ``logit_scale``, Granite divides it by ``logits_scaling`` (``logit_scale = 1 / logits_scaling``),
# Gemma 2/3 soft-cap it, ``c * tanh(z / c)`` (``final_logit_softcapping``). The log-probs are those of
#
#     z' = softcap(scale * z) / temperature,        softcap(x) = c * tanh(x / c)
#
# Without a cap the scale folds exactly into the row ops' ``inv_temperature`` (no extra pass). With
# one, each chunk (logits path) or tile (fused-linear path) of raw logits is capped into a buffer in
# the compute dtype, the row op runs on it, and the backward recomputes the chunk, runs the row
# backward on it and applies the chain rule ``dz = dz' * scale * sech^2(scale * z / c)``. sech^2 is
# ``4 t / (1 + t)^2`` with ``t = exp(-2 |x|)`` in (0, 1]: a few ulp where ``1 - tanh^2`` would
# cancel, never overflowing, and 0 at +-inf logits.
#
# Chunk boundaries move with the logits' layout (a strided ``[B, T, V]`` view is walked one leading
# index at a time, its contiguous copy in chunks of the flat ``[M, V]`` rows), so the transform uses
# only ops whose every element gets the same bits wherever it sits in a chunk: IEEE arithmetic and
# the functions PyTorch's CPU kernels evaluate with one vector routine up to the last element
# (``tanh``, ``exp``). ``cosh`` is not one of them: its CPU kernel computes a chunk's tail with the
# scalar libm ``cosh``, one ulp off the vector one, which made the capped gradient of a view differ
# from its copy's.


@dataclass(frozen=True)
class LogitTransform:
    """``z -> softcap * tanh(scale * z / softcap)``, on chunks of raw logits."""

    scale: float
    softcap: float

    def cap(self, z: Tensor, buffer: Tensor) -> Tensor:
        """``softcap(scale * z)`` in a view of the flat ``buffer`` (its dtype: the compute dtype)."""
        out = _view_like(buffer, z).copy_(z)
        return out.mul_(self.scale / self.softcap).tanh_().mul_(self.softcap)

    def derivative(self, z: Tensor, buffer: Tensor, scratch: Tensor) -> Tensor:
        """``d softcap(scale * z) / dz = scale * sech^2(x)``, ``x = scale * z / softcap``, in a view of
        ``buffer`` (``scratch``: a buffer of the same size, overwritten). ``sech^2(x) = 4 t / (1 + t)^2``
        with ``t = exp(-2 |x|)``."""
        t = _view_like(buffer, z).copy_(z).mul_(self.scale / self.softcap).abs_().mul_(-2.0).exp_()
        denominator = _view_like(scratch, z).copy_(t).add_(1.0).square_()
        return t.mul_(4.0).div_(denominator).mul_(self.scale)

    def differentiable(self, z: Tensor) -> Tensor:
        """The transform in plain autograd, for the few gathered logits of token-level TPO."""
        return torch.tanh(z * (self.scale / self.softcap)) * self.softcap


def _view_like(buffer: Tensor, like: Tensor) -> Tensor:
    return buffer[: like.numel()].view(like.shape)


def row_transform(inv_temperature: float, logit_scale: float,
                  logit_softcap: Optional[float]) -> Tuple[float, Optional[LogitTransform]]:
    """``(factor, transform)``: the factor the row ops multiply the (capped) logits by, and the
    transform they cannot fold into it. Without a cap the scale folds in: ``(scale / temperature,
    None)``; with one the cap applies the scale: ``(1 / temperature, the transform)``."""
    if logit_softcap is None:
        return inv_temperature * logit_scale, None
    return inv_temperature, LogitTransform(logit_scale, logit_softcap)


@dataclass(frozen=True)
class RowRequest:
    """What a row op computes: the logit transform and temperature, and the optional per-token
    fields of its :class:`RowSummary` asked for (``token_fields``, a sorted tuple of names from
    :data:`OPTIONAL_FIELDS`, e.g. ``("entropy",)``). Built once by the plan and carried whole to
    the ``torch.library`` boundary, where :meth:`to_op` flattens it into the ops' ``float[]``
    argument; a new field travels without another edit on the way."""

    inv_temperature: float = 1.0
    logit_scale: float = 1.0
    logit_softcap: Optional[float] = None  # None: no cap
    token_fields: Tuple[str, ...] = ()

    def wants(self, name: str) -> bool:
        return name in self.token_fields

    def row_flags(self) -> dict:
        """The keywords of a backend's ``row_forward`` asking for the requested fields."""
        return row_flags(self.token_fields)

    def transform(self) -> Tuple[float, Optional["LogitTransform"]]:
        """:func:`row_transform` of this request."""
        return row_transform(self.inv_temperature, self.logit_scale, self.logit_softcap)

    def folded(self) -> "RowRequest":
        """The same request with the scale folded into ``inv_temperature`` (no cap): what a
        vocabulary shard's row ops take."""
        factor, _ = row_transform(self.inv_temperature, self.logit_scale, None)
        return RowRequest(inv_temperature=factor, token_fields=self.token_fields)

    def to_op(self) -> List[float]:
        """``[inv_temperature, logit_scale, logit_softcap (0: none), one 0/1 per optional field]``."""
        flags = [float(name in self.token_fields) for name in OPTIONAL_FIELDS]
        return [float(self.inv_temperature), float(self.logit_scale), float(self.logit_softcap or 0.0), *flags]

    @staticmethod
    def from_op(values: List[float]) -> "RowRequest":
        inv_temperature, scale, softcap, *flags = values
        return RowRequest(inv_temperature=inv_temperature, logit_scale=scale, logit_softcap=softcap or None,
                          token_fields=tuple(name for name, flag in zip(OPTIONAL_FIELDS, flags) if flag))



# ----------------------------------------------------------------------------- what it gives back

@dataclass
class RowSummary:
    """Per-row summary of one vocabulary range: ``[M]`` tensors, in the compute dtype (float64
    for float64 logits, float32 otherwise) but for the bool ``has_label``.

    ``has_label`` says whether the row's label lies in the range the summary covers. For a whole
    row (a backend's ``row_forward``) that range is ``[0, V)``: False for a skipped row (negative
    label, its other fields 0) and for a label ``>= V`` (its other fields NaN). A caller that
    reads a row with a stand-in label (a block or shard that does not hold the label, read for
    its statistics) replaces it with its own test (:func:`dataclasses.replace`); the merge takes
    the label's log-prob from the range that has it.
    """

    row_max: Tensor  # max_v z_v, untempered
    log_sum: Tensor  # log sum_v exp((z_v - row_max) * inv_t)
    label_logprob: Tensor  # log softmax(z * inv_t)[label]; meaningful where has_label
    entropy: Optional[Tensor]  # -sum_v p_v log p_v of the tempered softmax; None unless requested
    has_label: Tensor  # bool: the label lies in this range

    # ------------------------------------------------------------------ fields by name

    def items(self) -> Iterator[Tuple[str, Optional[Tensor]]]:
        """``(name, tensor | None)`` of every field, in declaration order."""
        return ((name, getattr(self, name)) for name in FIELD_NAMES)

    def map(self, fn: Callable[[Tensor], Tensor]) -> "RowSummary":
        """``fn`` applied to every present field (an absent one stays None)."""
        return RowSummary(**{name: None if value is None else fn(value) for name, value in self.items()})

    def masked_fill(self, mask: Tensor, value: float) -> "RowSummary":
        """``value`` in the floating-point fields of the rows where ``mask`` holds (the others,
        ``has_label`` among them, as they are)."""
        return self.map(lambda field: field.masked_fill(mask, value) if field.is_floating_point() else field)

    def select(self, rows: Union[slice, Tensor]) -> "RowSummary":
        """The summary of the ``rows`` (a slice or an index / mask tensor) of this one."""
        return self.map(lambda value: value[rows])

    def assign(self, rows: Union[slice, Tensor], part: "RowSummary") -> None:
        """Write ``part`` (a summary of as many rows) into this summary's ``rows``, field by field."""
        for name, value in self.items():
            if value is not None:
                value[rows] = getattr(part, name)

    @staticmethod
    def zeros(rows: int, *, dtype: torch.dtype, device: torch.device, fields: Iterable[str] = ()) -> "RowSummary":
        """A summary of ``rows`` rows that do not count (every value 0, no label), in ``dtype``
        (the compute dtype); of the optional fields (:data:`OPTIONAL_FIELDS`) only ``fields``."""

        def zero(field_dtype: torch.dtype = dtype) -> Tensor:
            return torch.zeros(rows, dtype=field_dtype, device=device)

        return RowSummary(**{name: (None if name in OPTIONAL_FIELDS and name not in fields
                                    else zero(torch.bool if name == "has_label" else dtype)) for name in FIELD_NAMES})

    # ------------------------------------------------------------------ through a custom op

    def to_op(self) -> Tuple[Tensor, ...]:
        """The fields as the tensors a ``torch.library`` custom op returns or takes (a ``Tensor[]``
        argument), in declaration order; an absent field is an empty tensor of the compute dtype.
        :meth:`from_op` reads them back; :func:`op_outputs` is the return annotation."""
        # One empty tensor per absent field: a custom op's outputs may not alias each other.
        return tuple(self.log_sum.new_empty(0) if value is None else value for _, value in self.items())

    @staticmethod
    def from_op(tensors: Sequence[Optional[Tensor]], *, fields: Iterable[str] = ()) -> "RowSummary":
        """The summary :meth:`to_op` flattened (or, field by field, the gradients of those tensors,
        None where none arrived); ``fields`` says which optional fields are present (an empty
        tensor cannot: a batch of no rows has one)."""
        values = dict(zip(FIELD_NAMES, tensors))
        for name in OPTIONAL_FIELDS:
            if name not in fields:
                values[name] = None
        return RowSummary(**values)

    # ------------------------------------------------------------------ the merge

    def merge(self, other: "RowSummary", inv_temperature: float) -> "RowSummary":
        """The summary of the union of two disjoint ranges.

        With ``c = (row_max - m) * it + log_sum`` each range's log-mass relative to the common max
        ``m``, the merged ``log_sum`` is ``logaddexp(c_a, c_b)``, the label's log-prob moves by
        ``-softplus(c_other - c_own)`` (both terms <= 0: no cancellation, and ``1 - p`` of a
        confident token keeps its relative accuracy), and the entropy is the mixture's, ``sum_k
        w_k (H_k - log w_k)`` with ``w_k = exp(c_k - log_sum)``: non-negative terms only (the ``lse -
        sum p z`` form cancels catastrophically for large logits). A range of only ``-inf`` logits
        (``row_max == -inf``, e.g. a masked block) adds nothing; a label inside it has log-prob
        ``-inf``.

        Built from ``exp``, ``log1p``, ``maximum`` and ``where`` only (:func:`_log_add_exp`,
        :func:`_softplus`): on the CPU, ``torch.logaddexp`` and ``F.softplus`` give other bits in a
        vector's scalar tail than in its body, so a row's merged summary would depend on its
        position in the batch; these ops do not (batch-invariant log-probs)."""
        neg_inf = float("-inf")
        empty_a, empty_b = self.row_max == neg_inf, other.row_max == neg_inf
        m = torch.maximum(self.row_max, other.row_max)
        shift = torch.where(m == neg_inf, 0.0, m)
        c_a = torch.where(empty_a, neg_inf, (self.row_max - shift) * inv_temperature + self.log_sum)
        c_b = torch.where(empty_b, neg_inf, (other.row_max - shift) * inv_temperature + other.log_sum)
        log_sum = _log_add_exp(c_a, c_b)
        lp_a = torch.where(empty_a, neg_inf, self.label_logprob)
        lp_b = torch.where(empty_b, neg_inf, other.label_logprob)
        log_w_a = -_softplus(c_b - c_a)  # log of range a's share of the mass
        log_w_b = -_softplus(c_a - c_b)
        logprob = torch.where(other.has_label, lp_b + log_w_b, lp_a + log_w_a)
        entropy = None
        if self.entropy is not None:
            mixed = torch.exp(log_w_a) * (self.entropy - log_w_a) + torch.exp(log_w_b) * (other.entropy - log_w_b)
            entropy = torch.where(empty_b, self.entropy, torch.where(empty_a, other.entropy, mixed))
        return RowSummary(row_max=m, log_sum=log_sum, label_logprob=logprob, entropy=entropy,
                          has_label=self.has_label | other.has_label)


def _log_add_exp(a: Tensor, b: Tensor) -> Tensor:
    """``log(exp(a) + exp(b)) = max + log1p(exp(-|a - b|))``, ``-inf`` when both are (the gap is
    then taken as ``inf``: no ``-inf - -inf``)."""
    high, low = torch.maximum(a, b), torch.minimum(a, b)
    gap = torch.where(low == float("-inf"), float("inf"), high - low)
    return high + torch.log1p(torch.exp(-gap))


def _softplus(x: Tensor) -> Tensor:
    """``log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|))`` (``inf`` at ``inf``, 0 at ``-inf``)."""
    return torch.clamp(x, min=0.0) + torch.log1p(torch.exp(-torch.abs(x)))


FIELD_NAMES: Tuple[str, ...] = tuple(field.name for field in dataclasses.fields(RowSummary))
# The per-token fields a row op computes only on request (``RowRequest.token_fields``): the optional ones.
OPTIONAL_FIELDS: Tuple[str, ...] = tuple(field.name for field in dataclasses.fields(RowSummary)
                                         if "Optional" in str(field.type))


def row_flags(fields: Iterable[str]) -> Dict[str, bool]:
    """The keywords of a backend's ``row_forward`` that ask for the optional ``fields``:
    ``with_<name>`` for each optional field."""
    return {f"with_{name}": name in fields for name in OPTIONAL_FIELDS}


def op_outputs(extra: int = 0):
    """The return annotation of a custom op that returns :meth:`RowSummary.to_op` followed by
    ``extra`` more tensors (the schema follows the record's fields)."""
    return Tuple[(Tensor,) * (len(FIELD_NAMES) + extra)]


def row_gradients(counted: Tensor, summary: RowSummary, grad_logprobs: Optional[Tensor],
                  grad_entropy: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """The incoming gradients of a summary's log-probs and entropies (None where none arrived)
    as a row backward takes them: zero on rows that do not count (they were never read), in the
    compute dtype; ``(grad_logprobs, grad_entropy)``, the second None when the summary has no
    entropy or no entropy gradient arrives."""
    logprobs = summary.label_logprob
    grad_logprobs = torch.zeros_like(logprobs) if grad_logprobs is None else grad_logprobs
    grad_logprobs = torch.where(counted, grad_logprobs.to(logprobs.dtype), 0.0)
    if summary.entropy is None or grad_entropy is None:
        return grad_logprobs, None
    return grad_logprobs, torch.where(counted, grad_entropy.to(logprobs.dtype), 0.0)


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


__all__ = ["FIELD_NAMES", "FLOAT_DTYPES", "OPTIONAL_FIELDS", "LogitTransform", "RowRequest", "RowSummary", "compute_dtype",
           "gradient_buffer", "op_outputs", "row_flags", "row_gradients", "row_transform", "rows_in_place"]
