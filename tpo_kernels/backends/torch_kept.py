"""PyTorch kept-set ops (sampling-mask replay): the defaults of every backend (see the kept-set
contract in :mod:`tpo_kernels.backends`).

Everything here is ``[P]``-sized (one entry per (row, id) pair) or ``[M]``-sized, except the dense
logits gradient the logits path returns and the weight gradient. Per-row sums are
``embedding_bag(mode="sum")`` bags, which sum each bag sequentially in index order on CPU and CUDA,
so that a row's result depends on its own pairs only: batch-invariant by construction, and no
float atomics. Elementwise math uses exp / log / log1p / expm1 only (functions whose CPU kernels
give an element the same bits wherever it sits in a vector; softplus and logaddexp do not).

Ids: a negative id is a hole (no entry: gathered as ``-inf``, never written); an id ``>= V`` is
outside the vocabulary (gathered as NaN, never written, adds nothing to ``dH``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .kept_sets import KeptSets
from .rows import RowSummary, compute_dtype

# Elements of one [pairs, H] temporary of the linear forward, or of one [rows, V] accumulator of the
# scatter: 8 MiB of fp32.
_CHUNK_ELEMENTS = 1 << 21


def _pair_ids(kept: KeptSets, vocab: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(safe ids, hole, outside)``: ids clamped into ``[0, V)`` for reading, and the two masks."""
    hole = kept.ids < 0
    outside = kept.ids >= vocab
    return torch.where(hole | outside, 0, kept.ids), hole, outside


def _mark(values: Tensor, hole: Tensor, outside: Tensor) -> Tensor:
    return torch.where(hole, float("-inf"), torch.where(outside, float("nan"), values))


def _segment_sums(values: Tensor, offsets: Tensor) -> Tensor:
    """``[M, C]`` sums of the ``[P, C]`` ``values`` over each row's pairs, in pair order."""
    index = torch.arange(values.shape[0], device=values.device)
    return F.embedding_bag(index, values, offsets[:-1], mode="sum")


def kept_gather(logits: Tensor, kept: KeptSets) -> Tensor:
    """``[P]`` raw logits ``logits[row, id]`` in the compute dtype, from ``[M, V]`` or a ``[B, T, V]``
    view (read in place); a hole gives ``-inf``, an id ``>= V`` NaN."""
    vocab = logits.shape[-1]
    ids, hole, outside = _pair_ids(kept, vocab)
    if logits.dim() == 3:
        per_batch = logits.shape[1]
        values = logits[torch.div(kept.rows, per_batch, rounding_mode="floor"), kept.rows % per_batch, ids]
    else:
        values = logits[kept.rows, ids]
    return _mark(values.to(compute_dtype(logits.dtype)), hole, outside)


def _row_index(rows: Tensor, t: Tensor) -> Tuple[Tensor, ...]:
    """The index of rows ``rows`` of ``t``: ``[M, V]``, or row ``b T + t`` of a ``[B, T, V]`` view."""
    if t.dim() == 3:
        per_batch = t.shape[1]
        return torch.div(rows, per_batch, rounding_mode="floor"), rows % per_batch
    return (rows,)


def kept_scatter(grad: Tensor, kept: KeptSets, *, out: Tensor) -> None:
    """``out`` (the logits' shape and dtype) becomes 0 except ``out[row, id]``, the sum of that row's
    pairs in ascending order (``index_put_`` accumulates duplicates in index order: serially on the
    CPU, after a stable sort on CUDA); holes and ids outside ``[0, V)`` are never written (they add an
    exact +0.0 to column 0 of their row, which starts at +0.0). A lower-precision ``out`` of the
    padded form (token-level candidates: duplicate ids) gets its sums from a ``grad``-dtype
    accumulator of one chunk of rows at a time (8 MiB), rounded once; a CSR (replay: a set holds no
    id twice) is added into ``out`` directly."""
    vocab = out.shape[-1]
    ids, hole, outside = _pair_ids(kept, vocab)
    values = torch.where(hole | outside, 0.0, grad)
    width = kept.width
    if width is None or out.dtype == values.dtype or kept.num_rows == 0:
        out.zero_()
        out.index_put_(_row_index(kept.rows, out) + (ids,), values.to(out.dtype), accumulate=True)
        return
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, kept.num_rows, step):
        stop = min(start + step, kept.num_rows)
        pairs = slice(start * width, stop * width)
        acc = values.new_zeros(stop - start, vocab)
        acc.index_put_((kept.rows[pairs] - start, ids[pairs]), values[pairs], accumulate=True)
        out[_row_index(torch.arange(start, stop, device=out.device), out)] = acc.to(out.dtype)


def kept_linear_forward(hidden: Tensor, weight: Tensor, kept: KeptSets, *, bias: Optional[Tensor] = None) -> Tensor:
    """``[P]`` raw dot products ``hidden[row] . weight[id] + bias[id]`` in the compute dtype, as
    per-pair reductions over H (not a batched matmul, whose blocking depends on the batch)."""
    acc = compute_dtype(hidden.dtype)
    ids, hole, outside = _pair_ids(kept, weight.shape[0])
    num_pairs, hidden_size = kept.num_pairs, weight.shape[1]
    out = torch.empty(num_pairs, dtype=acc, device=hidden.device)
    width = kept.width
    if width:  # uniform rows (the padded form, candidates): row r's pairs read hidden[r] uncopied
        step = max(1, _CHUNK_ELEMENTS // max(width * hidden_size, 1))
        hidden = hidden.reshape(-1, hidden_size)
        for start in range(0, kept.num_rows, step):
            rows = slice(start, min(start + step, kept.num_rows))
            pairs = slice(rows.start * width, rows.stop * width)
            w = weight.index_select(0, ids[pairs]).to(acc).view(-1, width, hidden_size)
            out[pairs] = w.mul_(hidden[rows].to(acc).unsqueeze(1)).sum(-1).view(-1)
    else:
        step = max(1, _CHUNK_ELEMENTS // max(hidden_size, 1))
        for start in range(0, num_pairs, step):
            pairs = slice(start, min(start + step, num_pairs))
            w = weight.index_select(0, ids[pairs]).to(acc)
            h = hidden.index_select(0, kept.rows[pairs]).to(acc)
            out[pairs] = w.mul_(h).sum(-1)
    if bias is not None:
        out += bias[ids].to(acc)
    return _mark(out, hole, outside)


def kept_linear_backward(
    grad: Tensor,
    hidden: Tensor,
    weight: Tensor,
    kept: KeptSets,
    *,
    runs: Optional[Tuple[Tensor, Tensor, Tensor]],
    with_hidden: bool,
    with_weight: bool,
    with_bias: bool,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(dH, dW, db)`` for ``grad [P]`` = dLoss/d(raw kept logit); ``runs`` is
    :func:`tpo_kernels.group_math.pair_runs` of ``kept.ids`` (needed for dW / db). Sums run in
    ``grad.dtype`` (the compute dtype), each in a fixed order; results take the input dtypes."""
    acc = grad.dtype
    vocab = weight.shape[0]
    ids, hole, outside = _pair_ids(kept, vocab)
    dhidden = dweight = dbias = None
    if with_hidden:
        grad_h = torch.where(hole | outside, 0.0, grad)
        if weight.dtype == acc:
            dhidden = F.embedding_bag(ids, weight, kept.offsets[:-1], per_sample_weights=grad_h, mode="sum")
        else:  # low-precision weight: the rows gathered (P x H in acc) and bagged per row
            rows_w = weight.index_select(0, ids).to(acc)
            index = torch.arange(ids.numel(), device=ids.device)
            dhidden = F.embedding_bag(index, rows_w, kept.offsets[:-1], per_sample_weights=grad_h, mode="sum")
        dhidden = dhidden.to(hidden.dtype)
    if with_weight or with_bias:
        order, tokens, run_offsets = runs
        pair_grad = grad[order]
        targets = _RunTargets.of(tokens, vocab)  # runs of holes (< 0) and of ids >= V are not written
        if with_weight:
            sums = F.embedding_bag(kept.rows[order], hidden.to(acc), run_offsets[:-1], mode="sum",
                                   per_sample_weights=pair_grad)
            dweight = torch.zeros_like(weight)
            targets.write(dweight, sums)
        if with_bias:
            sums = F.embedding_bag(order, grad.reshape(-1, 1), run_offsets[:-1], mode="sum").squeeze(1)
            dbias = torch.zeros(vocab, dtype=weight.dtype, device=weight.device)
            targets.write(dbias, sums)
    return dhidden, dweight, dbias


@dataclass
class _RunTargets:
    """Where the runs' sums go: ``out[tokens[i]] = sums[i]`` for every run whose token is in
    ``[0, V)``, nothing for the others, as plain (non-accumulating) writes of distinct rows.

    The runs' tokens are distinct and sorted, so clamping them to ``[0, V - 1]`` sends the runs
    below 0 to row 0 and those at or above V to row V - 1, and only those two rows can receive
    more than one run (in no defined order). Each of the two is then written once more, with the
    run of its own token (found by a binary search of the sorted tokens) or 0 when that token has
    no run: two rows of work, no pass over ``[runs, H]`` and no read-back.
    """

    slots: Tensor  # [runs]: the row each run is written to, its token clamped to [0, V - 1]
    edge_rows: Tensor  # [2]: rows 0 and V - 1
    edge_runs: Tensor  # [2]: the run holding each edge row's token, if any
    edge_present: Tensor  # [2]: whether that run's token is the edge row's

    @staticmethod
    def of(tokens: Tensor, vocab: int) -> "_RunTargets":
        tokens = tokens.to(torch.int64)  # index_copy_ takes int64 rows
        last_row = max(vocab - 1, 0)
        # [0, V - 1] made on the device: a host tensor's copy would wait for the device's queue.
        edge_rows = torch.arange(2, device=tokens.device) * last_row
        edge_runs = torch.searchsorted(tokens, edge_rows).clamp_(max=max(tokens.numel() - 1, 0))
        return _RunTargets(
            slots=tokens.clamp(0, last_row),
            edge_rows=edge_rows,
            edge_runs=edge_runs,
            edge_present=tokens[edge_runs] == edge_rows if tokens.numel() else edge_rows < 0,
        )

    def write(self, out: Tensor, sums: Tensor) -> None:
        """Write the in-vocabulary runs' ``sums`` (``[runs]`` or ``[runs, H]``) into the
        zero-filled ``out`` (``[V]`` or ``[V, H]``); every other row stays 0."""
        if self.slots.numel() == 0 or out.shape[0] == 0:
            return
        out.index_copy_(0, self.slots, sums.to(out.dtype))
        present = self.edge_present.view(-1, *([1] * (sums.dim() - 1)))
        edges = torch.where(present, sums.index_select(0, self.edge_runs), 0.0)
        out.index_copy_(0, self.edge_rows, edges.to(out.dtype))


def _label_values(values: Tensor, kept: KeptSets) -> Tuple[Tensor, Tensor]:
    """``(values at each row's label slot, whether it has one)``: ``[M]``, 0 where none."""
    has_label = kept.label_slot >= 0
    return values[kept.label_slot.clamp(min=0)] if values.numel() else values.new_zeros(has_label.shape), has_label


def ragged_row_forward(kept_logits: Tensor, kept: KeptSets, *, inv_temperature: float,
                       with_entropy: bool) -> RowSummary:
    """The row-op contract over ragged rows ``kept_logits[offsets[r]:offsets[r + 1]]`` (raw, compute
    dtype) with the label at ``label_slot[r] - offsets[r]``: NOT_COUNTED rows give 0, LABEL_OUTSIDE
    rows their statistics and a NaN label log-prob."""
    z = kept_logits
    dtype = z.dtype
    num_rows = kept.num_rows
    counted = kept.label_slot != -1
    neg_inf = torch.full((num_rows,), float("-inf"), dtype=dtype, device=z.device)
    row_max = neg_inf.scatter_reduce(0, kept.rows, z, reduce="amax")  # max is exact in any order
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    d = (z - shift[kept.rows]) * inv_temperature
    e = torch.exp(d)
    pair_index = torch.arange(z.numel(), device=z.device)
    rest = torch.where(pair_index == kept.label_slot[kept.rows], 0.0, e)
    columns = [rest]
    if with_entropy:
        columns.append(torch.where(e == 0, 0.0, e * d))  # 0 log 0 = 0 at -inf logits
    sums = _segment_sums(torch.stack(columns, 1) if with_entropy else rest.unsqueeze(1), kept.offsets)
    r = sums[:, 0]
    d_y, has_label = _label_values(d, kept)
    e_y = torch.where(has_label, torch.exp(d_y), 0.0)
    total = e_y + r
    log_sum = torch.log(total)
    # -log1p(r / e_y) keeps 1 - p of a confident label; d_y - log_sum otherwise.
    logprob = torch.where(r < e_y, -torch.log1p(r / e_y), d_y - log_sum)
    empty = row_max == float("-inf")
    nan = float("nan")
    logprob = torch.where(has_label & ~empty, logprob, nan)
    entropy = None
    if with_entropy:
        entropy = torch.where(empty, nan, log_sum - sums[:, 1] / total)
    summary = RowSummary(row_max=row_max, log_sum=log_sum, label_logprob=logprob, entropy=entropy,
                         has_label=has_label)
    summary = summary.map(lambda f: torch.where(counted, f, torch.zeros((), dtype=f.dtype, device=f.device)))
    return summary


def ragged_row_backward(kept_logits: Tensor, kept: KeptSets, summary: RowSummary, grad_logprob: Tensor, *,
                        grad_entropy: Optional[Tensor] = None, inv_temperature: float, out: Tensor) -> None:
    """``out [P]`` = the row-op backward over the ragged rows: ``inv_t (g (1[j = y] - p_j) - ge p_j
    (log p_j + H))`` on each row's pairs, the label's ``1 - p`` as ``-expm1(label_logprob)``; 0 on
    holes, on rows that do not count and on rows with ``g == ge == 0``."""
    z = kept_logits
    rows = kept.rows
    it = inv_temperature
    log_p = (z - summary.row_max[rows]) * it - summary.log_sum[rows]
    p = torch.exp(log_p)
    g = grad_logprob[rows]
    dz = -g * p
    if grad_entropy is not None:
        ent = torch.where(grad_entropy != 0, summary.entropy, 0.0)
        dz = dz - grad_entropy[rows] * torch.where(p == 0, 0.0, p * (log_p + ent[rows]))
    label_at = torch.arange(z.numel(), device=z.device) == kept.label_slot[rows]
    lp = summary.label_logprob[rows]
    label_term = -g * torch.expm1(lp)
    if grad_entropy is not None:
        label_term = label_term - grad_entropy[rows] * torch.exp(lp) * (lp + ent[rows])
    dz = torch.where(label_at, label_term, dz) * it
    quiet = (grad_logprob == 0) if grad_entropy is None else (grad_logprob == 0) & (grad_entropy == 0)
    silent = (quiet | (kept.label_slot == -1))[rows] | (kept.ids < 0)
    out.copy_(torch.where(silent, 0.0, dz))


__all__ = ["kept_gather", "kept_linear_backward", "kept_linear_forward", "kept_scatter", "ragged_row_backward",
           "ragged_row_forward"]
