"""The check's inputs at the user's shapes, and the tolerances."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .report import _unit


# ----------------------------------------------------------------------------- inputs


@dataclass
class _Inputs:
    logits: Tensor  # [N, T, V]
    labels: Tensor  # [N, T]
    scores: Tensor  # [N]
    hidden: Tensor  # [N, T, H]
    weight: Tensor  # [V, H]
    bias: Tensor  # [V]
    candidates: Tensor  # [R, K]
    cand_scores: Tensor  # [R, K]
    group_size: int
    temperature: float
    eta: float


def _make_inputs(device, dtype, n, k, t, v, h, temperature, eta, seed) -> _Inputs:
    gen = torch.Generator().manual_seed(seed)

    def put(x, as_dtype=dtype):
        return x.to(as_dtype).to(device)

    logits = torch.randn(n, t, v, generator=gen, dtype=torch.float64) * 2
    labels = torch.randint(0, v, (n, t), generator=gen)
    if t >= 4:
        labels[1::2, t - t // 4:] = -100  # padding at the end of every other completion
    scores = torch.randn(n, generator=gen, dtype=torch.float64)
    if n // k >= 2:
        scores[:k] = 0.5  # a tied group: on-policy it has p == q and no gradient
    hidden = torch.randn(n, t, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) * (2.0 / math.sqrt(h))
    bias = torch.randn(v, generator=gen, dtype=torch.float64) * 0.5
    r = n * t
    candidates = torch.randint(0, v, (r, k), generator=gen)
    cand_scores = torch.randn(r, k, generator=gen, dtype=torch.float64)
    cand_scores[::3] = 1.0  # tied states
    return _Inputs(put(logits), labels.to(device), put(scores, torch.float32), put(hidden), put(weight), put(bias),
                   candidates.to(device), put(cand_scores, torch.float32), k, temperature, eta)


def _leaf(x: Tensor) -> Tensor:
    return x.detach().clone().requires_grad_(True)


def _leaf64(x: Tensor) -> Tensor:
    return x.detach().double().requires_grad_(True)


# ----------------------------------------------------------------------------- tolerances


class _Tol:
    """The tolerance formulas of the module docstring for one set of inputs."""

    def __init__(self, dtype: torch.dtype, z: Tensor, tau: float, vocab: int, hidden: int = 0,
                 matmul_mag: float = 0.0):
        self.dtype = dtype
        self.eps = _unit(torch.float64 if dtype == torch.float64 else torch.float32)
        self.eps_out = _unit(dtype)
        finite = torch.where(torch.isfinite(z), z, torch.nan)
        spread = finite.nan_to_num(nan=float("-inf")).amax(-1) - finite.nan_to_num(nan=float("inf")).amin(-1)
        spread = spread[torch.isfinite(spread)]
        self.spread = float(spread.max()) / tau if spread.numel() else 0.0
        self.rel = 16 * self.eps * (self.spread + math.log(vocab) + 1)  # token error, relative to p
        logits_err = 0.0
        if hidden:  # the fused paths' own logits: fp32 accumulation of H terms, one input rounding
            rounding = _unit(dtype) if dtype not in (torch.float32, torch.float64) else 0.0
            logits_err = (hidden * self.eps + rounding) * matmul_mag / tau
        self.logits_err = 2 * logits_err  # moves a log-prob by at most twice the largest logit error
        self.token = self.rel + self.logits_err

    def sequence(self, tokens: int) -> float:
        return max(tokens, 1) * self.token

    def grad_k(self, terms: int = 1) -> float:
        return self.rel + self.logits_err + 2 * self.eps_out + terms * self.eps
