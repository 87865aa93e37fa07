"""PyTorch candidate ops for token-level TPO: the defaults of every backend (see the candidate-op
contract in :mod:`tpo_kernels.backends`). Backends with their own kernels override them.

Nothing here forms an ``[R, V]`` tensor except the dense logits gradient the logits path must
return; every sum runs in a fixed order (no float atomics).

Ids follow the contract of DESIGN.md ("Ids outside the vocabulary"), without a read-back: an id
outside ``[0, V)`` is read as id 0 (or adds an exact 0 to column 0) and its result replaced, so a
candidate outside the vocabulary has a NaN candidate logit, is not written by the backward and adds
nothing to ``dH`` (no index error, no device-side assert). The masks act on the id-sized tensors
(``[R, K]``, one entry per run); nothing of size H or V is masked per id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .rows import compute_dtype

# Elements of one [states, K, H] temporary of the PyTorch fused-linear ops: 8 MiB of fp32, small
# enough to stay in cache and to be reused by the allocator from chunk to chunk.
_CHUNK_ELEMENTS = 1 << 21


def _in_vocab(ids: Tensor, vocab: int) -> Tensor:
    return (ids >= 0) & (ids < vocab)


def candidate_forward(logits: Tensor, candidates: Tensor, *, inv_temperature: float) -> Tensor:
    """``logits[r, candidates[r, k]] * inv_t`` in the compute dtype; NaN for an id outside ``[0, V)``."""
    valid = _in_vocab(candidates, logits.shape[1])
    cand = logits.gather(1, torch.where(valid, candidates, 0)).to(compute_dtype(logits.dtype)) * inv_temperature
    return torch.where(valid, cand, float("nan"))


def candidate_backward(grad_cand: Tensor, candidates: Tensor, *, inv_temperature: float, out: Tensor) -> None:
    """``out`` = 0 except ``out[r, candidates[r, k]] += grad_cand[r, k] * inv_t``, summed in
    ``grad_cand``'s dtype and rounded to ``out``'s once. A lower-precision ``out`` gets its sums
    from a compute-dtype accumulator of one chunk of states at a time (8 MiB), never ``[R, V]``."""
    out.zero_()
    if out.dtype == grad_cand.dtype:
        _scatter_columns(out, candidates, grad_cand, inv_temperature)
        return
    for states in _state_chunks(candidates.shape[0], out.shape[1]):
        acc = out.new_zeros((states.stop - states.start, out.shape[1]), dtype=grad_cand.dtype)
        _scatter_columns(acc, candidates[states], grad_cand[states], inv_temperature)
        out[states] = acc


def _scatter_columns(acc: Tensor, candidates: Tensor, grad_cand: Tensor, inv_temperature: float) -> None:
    # An id outside [0, V) adds an exact +0.0 to column 0 instead: no write of its own, and no
    # change to column 0 (x + 0.0 == x; a column holding -0.0 cannot occur, sums start at +0.0).
    valid = _in_vocab(candidates, acc.shape[1])
    ids = torch.where(valid, candidates, 0)
    values = torch.where(valid, grad_cand * inv_temperature, 0.0)
    for k in range(candidates.shape[1]):  # one column at a time: no index collisions, ascending k
        acc.scatter_add_(1, ids[:, k : k + 1], values[:, k : k + 1])


def _state_chunks(num_states: int, per_state: int):
    step = max(1, _CHUNK_ELEMENTS // max(per_state, 1))
    for start in range(0, num_states, step):
        yield slice(start, min(start + step, num_states))


def _gather_rows(weight: Tensor, ids: Tensor, acc: torch.dtype) -> Tensor:
    """``weight[ids]`` for ``ids`` [n, K] in ``[0, V)`` as an ``[n, K, H]`` tensor in ``acc``."""
    return weight.index_select(0, ids.reshape(-1)).view(*ids.shape, weight.shape[1]).to(acc)


def candidate_linear_forward(
    hidden: Tensor, weight: Tensor, candidates: Tensor, *, bias: Optional[Tensor] = None, inv_temperature: float
) -> Tensor:
    """``(h[r] . W[y[r, k]] + b[y[r, k]]) * inv_t`` in the compute dtype, chunked over states."""
    acc = compute_dtype(hidden.dtype)
    num_states, num_cand = candidates.shape
    out = torch.empty(num_states, num_cand, dtype=acc, device=hidden.device)
    for rows in _state_chunks(num_states, num_cand * hidden.shape[1]):
        valid = _in_vocab(candidates[rows], weight.shape[0])
        ids = torch.where(valid, candidates[rows], 0)
        dots = torch.bmm(_gather_rows(weight, ids, acc), hidden[rows].to(acc).unsqueeze(2)).squeeze(2)
        if bias is not None:
            dots = dots + bias[ids].to(acc)
        out[rows] = torch.where(valid, dots * inv_temperature, float("nan"))
    return out


def candidate_linear_backward(
    grad: Tensor,
    hidden: Tensor,
    weight: Tensor,
    candidates: Tensor,
    *,
    runs: Optional[Tuple[Tensor, Tensor, Tensor]],
    with_hidden: bool,
    with_weight: bool,
    with_bias: bool,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(dH, dW, db)`` for ``grad[r, k]`` = dLoss/d(untempered candidate logit), as in
    the Triton kernels; ``runs`` is :func:`tpo_kernels.group_math.pair_runs` (needed
    for dW / db). Sums run in the compute dtype ``grad.dtype``; results take the input dtypes.

    All three are weighted bag sums, so they use ``embedding_bag(mode="sum")``, whose forward sums
    each bag sequentially in index order on CPU and CUDA (deterministic, no atomics):
    dH bags the K candidate rows of W per state; dW bags, per distinct token, the rows of h of its
    (r, k) pairs in ascending order, weighted by grad; db bags the grads themselves.
    """
    acc = grad.dtype
    vocab, hidden_size = weight.shape
    dhidden = dweight = dbias = None
    if with_hidden:
        # An id outside [0, V) reads row 0 with weight exactly 0: no contribution (its grad, NaN or not, unused).
        valid = _in_vocab(candidates, vocab)
        candidates, grad_h = torch.where(valid, candidates, 0), torch.where(valid, grad, 0.0)
        if weight.dtype == acc:
            dhidden = F.embedding_bag(candidates, weight, per_sample_weights=grad_h, mode="sum")
        else:  # low-precision weight: gather the candidate rows chunk by chunk and sum in acc
            dhidden = torch.empty(hidden.shape, dtype=acc, device=hidden.device)
            for rows in _state_chunks(candidates.shape[0], candidates.shape[1] * hidden_size):
                w = _gather_rows(weight, candidates[rows], acc)
                dhidden[rows] = torch.bmm(grad_h[rows].unsqueeze(1), w).squeeze(1)
        dhidden = dhidden.to(hidden.dtype)
    if with_weight or with_bias:
        order, tokens, offsets = runs
        pair_grad = grad.reshape(-1)[order]
        targets = _RunTargets.of(tokens, vocab)
        if with_weight:
            states = torch.div(order, candidates.shape[1], rounding_mode="floor")
            rows = F.embedding_bag(
                states, hidden.to(acc), offsets[:-1], mode="sum", per_sample_weights=pair_grad
            )
            dweight = torch.zeros_like(weight)
            targets.write(dweight, rows)
        if with_bias:
            sums = F.embedding_bag(order, grad.reshape(-1, 1), offsets[:-1], mode="sum").squeeze(1)
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
