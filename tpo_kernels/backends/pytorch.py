"""Portable PyTorch row ops (backend "torch"): the fallback on any device.

Works on chunks of consecutive rows (of a ``[M, V]`` matrix, or whole entries / row ranges of a
``[B, T, V]`` view such as ``logits[:, :-1]``, read in place), each pass over a chunk one
vectorized PyTorch op into a reused buffer of at most ``_CHUNK_ELEMENTS`` compute-dtype values,
never a full ``[M, V]`` fp32 copy of the logits. The chunk size trades op count (each op a
parallel region) against memory.

Every row is computed and the rows to skip (negative label forward, zero gradient backward)
are then set to 0 (``torch.where`` on per-row results; a zero row in the backward's copy out):
the results are those of never reading them, and no count or index of rows is read back to the
host, so the ops are sync-free (CUDA-graph capturable).

Ids follow the contract of DESIGN.md ("Ids outside the vocabulary") with the same ``torch.where``
technique: a label ``>= V`` is read as column 0 and its row's outputs are then replaced by NaN, and
the backward adds no one-hot term for it (no index error, no device-side assert).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .row_summary import RowSummary, compute_dtype
from . import Backend, gradient_buffer

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
