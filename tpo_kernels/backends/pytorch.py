"""Portable PyTorch row ops (backend "torch"): the fallback on any device.

Works on row chunks so that at most ``_CHUNK_ELEMENTS`` fp32 temporaries exist at once, never a
full ``[M, V]`` fp32 copy of the logits.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._dtypes import compute_dtype
from .interface import Backend

_CHUNK_ELEMENTS = 1 << 24  # 64 MiB of fp32 per temporary


def _row_chunks(selected: Tensor, vocab: int):
    """Row selections of at most ``_CHUNK_ELEMENTS // vocab`` rows covering the ``selected`` rows:
    slices when every row is selected (no gather), index tensors otherwise."""
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    if bool(selected.all()):
        return [slice(start, start + step) for start in range(0, selected.numel(), step)]
    return torch.nonzero(selected).squeeze(1).split(step)


def _read_rows(logits: Tensor, chunk) -> Tensor:
    return logits[chunk] if isinstance(chunk, slice) else logits.index_select(0, chunk)


class TorchBackend(Backend):
    name = "torch"

    def supports_device(self, device: torch.device) -> bool:
        return True

    def row_forward(
        self, logits: Tensor, labels: Tensor, *, inv_temperature: float, with_entropy: bool
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        m, v = logits.shape
        acc = compute_dtype(logits.dtype)
        stats = logits.new_zeros(2, m, dtype=acc)
        logprob = logits.new_zeros(m, dtype=acc)
        entropy = logits.new_zeros(m, dtype=acc) if with_entropy else None
        for chunk in _row_chunks(labels >= 0, v):  # skipped rows are never read
            z = _read_rows(logits, chunk).to(acc)  # may be the logits themselves: not modified
            row_max = z.amax(dim=1)
            # d = (z - max) * it <= 0; an all -inf row shifts by 0 (no -inf - -inf).
            shift = torch.where(row_max == float("-inf"), 0.0, row_max).unsqueeze(1)
            d = (z - shift).mul_(inv_temperature)
            e = torch.exp(d)
            label = labels[chunk].unsqueeze(1)
            d_y = d.gather(1, label).squeeze(1)
            e_y = e.gather(1, label).squeeze(1)
            if with_entropy:  # t = sum e d, with 0 (not 0 * -inf) where e == 0
                t = (e * torch.where(e > 0, d, 0.0)).sum(dim=1)
            rest = e.scatter_(1, label, 0.0).sum(dim=1)  # the mass without the label
            total = rest + e_y
            log_sum = torch.log(total)
            # log(e_y / (e_y + rest)): -log1p(rest / e_y) keeps 1 - p exact-ish for confident tokens.
            logprob[chunk] = torch.where(rest < e_y, -torch.log1p(rest / e_y), d_y - log_sum)
            stats[0, chunk] = row_max
            stats[1, chunk] = log_sum
            if with_entropy:
                entropy[chunk] = log_sum - t / total
        return stats, logprob, entropy

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
        m, v = logits.shape
        acc = compute_dtype(logits.dtype)
        active = grad_logprob != 0
        if grad_entropy is not None:
            active = active | (grad_entropy != 0)
        out[~active] = 0  # zero-signal rows: written, never read
        for chunk in _row_chunks(active, v):
            z = _read_rows(logits, chunk).to(acc)  # may be the logits themselves: not modified
            log_probs = (z - stats[0, chunk].unsqueeze(1)).mul_(inv_temperature).sub_(stats[1, chunk].unsqueeze(1))
            probs = torch.exp(log_probs)
            g = grad_logprob[chunk].unsqueeze(1)
            grad = -g * probs
            label = labels[chunk].unsqueeze(1)
            has_label = label >= 0
            lp = logprob[chunk].unsqueeze(1)
            label_grad = -g * torch.expm1(lp)  # g (1 - p_y), accurate for confident tokens
            if grad_entropy is not None:
                ge = grad_entropy[chunk].unsqueeze(1)
                ent = entropy[chunk].unsqueeze(1)
                safe = torch.where(probs > 0, log_probs, 0.0)  # p log p -> 0 at p == 0
                grad = grad - ge * probs * (safe + ent)
                p_y = torch.exp(lp)
                label_grad = label_grad - ge * p_y * (torch.where(p_y > 0, lp, 0.0) + ent)
            # The label's entry replaces the column (rows without a label keep column 0 as is).
            col = label.clamp(min=0)
            grad.scatter_(1, col, torch.where(has_label, label_grad, grad.gather(1, col)))
            out[chunk] = (grad * inv_temperature).to(out.dtype)
