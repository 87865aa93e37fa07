"""Logit scaling and soft-capping, applied by the orchestration layer around unchanged row ops.

Models transform their lm_head output before the softmax: Cohere multiplies it by
``logit_scale``, Granite divides it by ``logits_scaling`` (``logit_scale = 1 / logits_scaling``),
Gemma 2/3 soft-cap it, ``c * tanh(z / c)`` (``final_logit_softcapping``). The log-probs are those of

    z' = softcap(scale * z) / temperature,        softcap(x) = c * tanh(x / c)

Without a cap the scale folds exactly into the row ops' ``inv_temperature`` (no extra pass). With
one, each chunk (logits path) or tile (fused-linear path) of raw logits is capped into a buffer in
the compute dtype, the row op runs on it, and the backward recomputes the chunk, runs the row
backward on it and applies the chain rule ``dz = dz' * scale * sech^2(scale * z / c)``. sech^2 is
``1 / cosh^2``, exact to the last bits where ``1 - tanh^2`` would cancel, and 0 at +-inf logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .tiles import TilePolicy


@dataclass(frozen=True)
class LogitTransform:
    """``z -> softcap * tanh(scale * z / softcap)``, on chunks of raw logits."""

    scale: float
    softcap: float

    @staticmethod
    def of(logit_scale: float, logit_softcap: Optional[float]) -> Optional["LogitTransform"]:
        """The transform the row ops cannot fold into ``inv_temperature``; None without a cap."""
        return None if logit_softcap is None else LogitTransform(logit_scale, logit_softcap)

    def cap(self, z: Tensor, buffer: Tensor) -> Tensor:
        """``softcap(scale * z)`` in a view of the flat ``buffer`` (its dtype: the compute dtype)."""
        out = _view_like(buffer, z).copy_(z)
        return out.mul_(self.scale / self.softcap).tanh_().mul_(self.softcap)

    def derivative(self, z: Tensor, buffer: Tensor) -> Tensor:
        """``d softcap(scale * z) / dz = scale / cosh^2(scale * z / softcap)`` in a view of ``buffer``."""
        out = _view_like(buffer, z).copy_(z)
        return out.mul_(self.scale / self.softcap).cosh_().square_().reciprocal_().mul_(self.scale)

    def differentiable(self, z: Tensor) -> Tensor:
        """The transform in plain autograd, for the few gathered logits of token-level TPO."""
        return torch.tanh(z * (self.scale / self.softcap)) * self.softcap


def _view_like(buffer: Tensor, like: Tensor) -> Tensor:
    return buffer[: like.numel()].view(like.shape)


def folded_inv_temperature(inv_temperature: float, logit_scale: float, logit_softcap: Optional[float]) -> float:
    """The factor the row ops multiply the (capped) logits by: ``scale / temperature`` without a
    cap (the scale folds in), ``1 / temperature`` with one (the cap applied the scale)."""
    return inv_temperature if logit_softcap is not None else inv_temperature * logit_scale


def row_chunk(num_rows: int, vocab_size: int, device: torch.device) -> int:
    """Rows per chunk of the capped logits path: the device's fused-linear tile budget."""
    return TilePolicy.for_device(device).chunk_size(num_rows, vocab_size)
