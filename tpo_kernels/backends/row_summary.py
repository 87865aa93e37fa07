"""The per-row summary of a vocabulary range: what every backend's ``row_forward`` returns, what
its ``row_backward`` takes back, and the one exact merge of two ranges; and the compute dtype its
fields (and every reduction of the package) are in.

A row op over the ``[M, V]`` logits (or a ``[B, T, V]`` view, ``M = B T``) gives, per row, the raw
max of its logits and the log-sum of ``exp((z - max) / tau)`` (the row statistics), the label's
log-prob, on request the entropy, and whether the label lies in the range it read. A range of the
vocabulary (a block of the fused-linear tiles, or one rank's vocabulary shard) gives the same
summary over its part; :meth:`RowSummary.merge` combines two disjoint ranges exactly. Both the
fused-linear tiles and the vocabulary shards merge through it, and everything that carries a
summary (the custom ops' outputs and saved tensors through :meth:`RowSummary.to_op` /
:meth:`RowSummary.from_op`, row selections, the vocabulary-parallel gather) walks its fields by
name, so a new per-row quantity lands in the kernels and this record only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # the dtypes the package accepts


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64 (for gradcheck), every other dtype uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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


__all__ = ["FIELD_NAMES", "FLOAT_DTYPES", "OPTIONAL_FIELDS", "RowSummary", "compute_dtype", "op_outputs", "row_flags"]
