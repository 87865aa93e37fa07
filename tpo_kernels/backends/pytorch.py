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
        lse = logits.new_zeros(m, dtype=acc)
        target = logits.new_zeros(m, dtype=acc)
        entropy = logits.new_zeros(m, dtype=acc) if with_entropy else None
        for chunk in _row_chunks(labels >= 0, v):  # skipped rows are never read
            z = _read_rows(logits, chunk).to(acc) * inv_temperature
            chunk_lse = torch.logsumexp(z, dim=1)
            lse[chunk] = chunk_lse
            target[chunk] = z.gather(1, labels[chunk].unsqueeze(1)).squeeze(1)
            if with_entropy:
                # H = lse - sum_v p_v z_v, with p = exp(z - lse)
                probs = torch.exp(z - chunk_lse.unsqueeze(1))
                entropy[chunk] = chunk_lse - (probs * z).sum(dim=1)
        return lse, target, entropy

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
        m, v = logits.shape
        acc = compute_dtype(logits.dtype)
        active = grad_logprob != 0
        if grad_entropy is not None:
            active = active | (grad_entropy != 0)
        out[~active] = 0  # zero-signal rows: written, never read
        for chunk in _row_chunks(active, v):
            z = _read_rows(logits, chunk).to(acc) * inv_temperature
            log_probs = z - lse[chunk].unsqueeze(1)
            probs = torch.exp(log_probs)
            g = grad_logprob[chunk].unsqueeze(1)
            grad = -g * probs
            label = labels[chunk].unsqueeze(1)
            # g * onehot(label); rows without a label (label < 0) add 0 at column 0.
            grad.scatter_add_(1, label.clamp(min=0), torch.where(label >= 0, g, 0.0))
            if grad_entropy is not None:
                ge = grad_entropy[chunk].unsqueeze(1)
                grad = grad - ge * probs * (log_probs + entropy[chunk].unsqueeze(1))
            out[chunk] = (grad * inv_temperature).to(out.dtype)
