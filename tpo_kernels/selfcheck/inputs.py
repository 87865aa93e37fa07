"""The check's inputs at the user's shapes, the float64 reference one chunk of rows at a time, and
the tolerances."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import reference
from .report import _unit

# float64 entries of one [rows, V] chunk of the reference (16 MiB). The reference's autograd keeps
# a few such tensors per chunk, so its memory is bounded whatever the user's shapes.
CHUNK_ELEMENTS = 1 << 21


# ----------------------------------------------------------------------------- inputs


@dataclass
class _Inputs:
    logits: Tensor  # [N, T, V]
    labels: Tensor  # [N, T]
    scores: Tensor  # [N]
    token_logprobs: Tensor  # [N, T], the input of tpo_loss_from_logprobs
    hidden: Tensor  # [N, T, H]
    weight: Tensor  # [V, H]
    bias: Tensor  # [V]
    candidates: Tensor  # [R, K]
    cand_scores: Tensor  # [R, K]
    group_size: int
    temperature: float
    eta: float
    logit_scale: float = 1.0
    logit_softcap: Optional[float] = None
    heads: Dict[bool, "_Head"] = field(default_factory=dict)  # the reference's pass 1, per head

    @property
    def transform(self) -> dict:
        """The keywords of the softmax's input, as every logits-taking function spells them."""
        return dict(temperature=self.temperature, logit_scale=self.logit_scale, logit_softcap=self.logit_softcap)

    def head(self, fused: bool) -> "_Head":
        """The float64 logits source of the logits paths (fused=False) or the fused-linear ones,
        with its pass-1 statistics, computed once and shared by every backend and path."""
        if fused not in self.heads:
            self.heads[fused] = _Head(self, fused)
        return self.heads[fused]


def _make_inputs(device, dtype, shape: Tuple[int, int, int, int, int], *, temperature, eta, seed, logit_scale=1.0,
                 logit_softcap=None) -> _Inputs:
    """Random inputs of ``shape = (N, K, T, V, H)``, generated in the input dtype one chunk of rows
    at a time (never a float64 copy of the logits)."""
    n, k, t, v, h = shape
    gen = torch.Generator().manual_seed(seed)

    def put(x, as_dtype=dtype):
        return x.to(as_dtype).to(device)

    logits = torch.empty(n * t, v, dtype=dtype, device=device)
    for rows in row_chunks(n * t, v):
        logits[rows] = put(torch.randn(rows.stop - rows.start, v, generator=gen) * 2)
    labels = torch.randint(0, v, (n, t), generator=gen)
    if t >= 4:
        labels[1::2, t - t // 4:] = -100  # padding at the end of every other completion
    scores = torch.randn(n, generator=gen, dtype=torch.float64)
    if n // k >= 2:
        scores[:k] = 0.5  # a tied group: on-policy it has p == q and no gradient
    token_logprobs = -4 * torch.rand(n, t, generator=gen)
    hidden = torch.randn(n, t, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * (2.0 / math.sqrt(h))
    bias = torch.randn(v, generator=gen) * 0.5
    r = n * t
    candidates = torch.randint(0, v, (r, k), generator=gen)
    cand_scores = torch.randn(r, k, generator=gen, dtype=torch.float64)
    cand_scores[::3] = 1.0  # tied states
    return _Inputs(logits=logits.view(n, t, v), labels=labels.to(device), scores=put(scores, torch.float32),
                   token_logprobs=put(token_logprobs), hidden=put(hidden), weight=put(weight), bias=put(bias),
                   candidates=candidates.to(device), cand_scores=put(cand_scores, torch.float32), group_size=k,
                   temperature=temperature, eta=eta, logit_scale=logit_scale, logit_softcap=logit_softcap)


def row_chunks(rows: int, width: int) -> List[slice]:
    """Slices of ``rows`` rows of ``width`` entries, CHUNK_ELEMENTS entries each at most."""
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def _leaf(x: Tensor) -> Tensor:
    return x.detach().clone().requires_grad_(True)


def _leaf64(x: Tensor) -> Tensor:
    return x.detach().double().requires_grad_(True)


# ----------------------------------------------------------------------------- the float64 head


class _Head:
    """Where the reference's logits come from, in float64, one chunk of flat rows at a time: the
    logits tensor itself or ``hidden @ weight.T + bias`` (the fused paths).

    Pass 1 (here, without autograd) gives what every path needs before its gradients: the
    reference token log-probs and entropies of every row, the largest spread ``S`` of a row of
    tempered logits, the largest tempered logit, and for the fused head the matmul magnitude
    ``max (|h| @ |W|.T + |b|)`` of the tolerances."""

    def __init__(self, inp: _Inputs, fused: bool):
        self.inp, self.fused = inp, fused
        vocab = inp.logits.shape[-1]
        self.rows = inp.labels.numel()
        self.vocab = vocab
        self.flat_labels = inp.labels.reshape(-1)
        if fused:
            self.hidden = inp.hidden.reshape(self.rows, -1)
            self.w_abs = inp.weight.double().abs()
            self.b_abs = inp.bias.double().abs()
        self.logprobs = torch.empty(self.rows, dtype=torch.float64, device=inp.labels.device)
        self.entropy = torch.empty_like(self.logprobs)
        self.spread = self.max_tempered = self.magnitude = 0.0
        with torch.no_grad():
            weight64 = inp.weight.double() if fused else None
            for rows in self.chunks():
                z = self._logits(rows, weight64, inp.bias.double() if fused else None)
                tempered = reference.tempered_logits(z, **inp.transform)
                self.spread = max(self.spread, _max_spread(tempered))
                finite = tempered[torch.isfinite(tempered)]
                if finite.numel():
                    self.max_tempered = max(self.max_tempered, float(finite.abs().max()))
                lp, ent = reference.selective_logprobs(z, self.flat_labels[rows], return_entropy=True,
                                                       **inp.transform)
                self.logprobs[rows], self.entropy[rows] = lp, ent
                if fused:
                    mag = self.hidden[rows].double().abs() @ self.w_abs.T + self.b_abs
                    self.magnitude = max(self.magnitude, float(mag.max()))

    def chunks(self) -> List[slice]:
        return row_chunks(self.rows, self.vocab)

    def _logits(self, rows: slice, weight64, bias64, hidden64=None) -> Tensor:
        if not self.fused:
            return self.inp.logits.reshape(self.rows, -1)[rows].double()
        hidden64 = self.hidden[rows].double() if hidden64 is None else hidden64
        return hidden64 @ weight64.T + bias64

    def leaves(self):
        """Float64 leaf copies of the weight and bias (None, None for the logits head)."""
        return (_leaf64(self.inp.weight), _leaf64(self.inp.bias)) if self.fused else (None, None)

    def chunk_with_grad(self, rows: slice, weight64, bias64):
        """(z, x): the float64 logits of ``rows`` with their gradient retained, and the leaf the
        chunk's input gradient lands in (the logits chunk itself, or the hidden-state chunk)."""
        if self.fused:
            x = _leaf64(self.hidden[rows])
            z = self._logits(rows, weight64, bias64, x)
            z.retain_grad()
            return z, x
        z = _leaf64(self.inp.logits.reshape(self.rows, -1)[rows])
        return z, z

    def tolerance(self, dtype: torch.dtype, vocab: Optional[int] = None, spread: Optional[float] = None,
                  max_tempered: Optional[float] = None) -> "_Tol":
        return _Tol(dtype, self.spread if spread is None else spread, self.vocab if vocab is None else vocab,
                    self.hidden.shape[-1] if self.fused else 0, self.magnitude,
                    self.max_tempered if max_tempered is None else max_tempered, self.inp)


def _max_spread(tempered: Tensor) -> float:
    """The largest ``max - min`` over the finite entries of a row."""
    finite = torch.isfinite(tempered)
    high = torch.where(finite, tempered, float("-inf")).amax(-1)
    low = torch.where(finite, tempered, float("inf")).amin(-1)
    spread = (high - low)[finite.any(-1)]
    return float(spread.max()) if spread.numel() else 0.0


# ----------------------------------------------------------------------------- tolerances


class _Tol:
    """The tolerance formulas of the module docstring for one set of inputs."""

    def __init__(self, dtype: torch.dtype, spread: float, vocab: int, hidden: int, matmul_mag: float,
                 max_tempered: float, inp: _Inputs):
        self.dtype = dtype
        self.eps = _unit(torch.float64 if dtype == torch.float64 else torch.float32)
        self.eps_out = _unit(dtype)
        self.spread = spread  # of tempered logits
        self.rel = 16 * self.eps * (self.spread + math.log(vocab) + 1)  # token error, relative to p
        if inp.logit_scale != 1.0 or inp.logit_softcap is not None:
            # the transform rounds each tempered logit once more (the scale, tanh): a few eps of it
            self.rel += 4 * self.eps * max_tempered
        logits_err = 0.0
        if hidden:  # the fused paths' own logits: fp32 accumulation of H terms, one input rounding
            rounding = _unit(dtype) if dtype not in (torch.float32, torch.float64) else 0.0
            logits_err = (hidden * self.eps + rounding) * matmul_mag * abs(inp.logit_scale) / inp.temperature
        self.logits_err = 2 * logits_err  # moves a log-prob by at most twice the largest logit error
        self.token = self.rel + self.logits_err

    def sequence(self, tokens: int) -> float:
        return max(tokens, 1) * self.token

    def grad_k(self, terms: int = 1) -> float:
        return self.rel + self.logits_err + 2 * self.eps_out + terms * self.eps
