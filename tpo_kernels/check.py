"""Numerical self-check of the TPO losses on this machine: ``tpo_kernels.check(...)`` and
``tpo-kernels check``.

On the chosen device, dtype and shapes, for every backend that runs there (or the ones asked for)
and every public function ("path"), it runs

1. **gradcheck**: float64 ``torch.autograd.gradcheck`` (fast mode) of the path on small shapes;
2. **reference**: the path at the chosen shapes and dtype against :mod:`tpo_kernels.reference`
   evaluated in float64 on the same (rounded) inputs: the loss, token and sequence log-probs,
   entropies, p, q and every gradient;
3. **edge cases**: the numerical edges the kernels are built for (fp32 inputs, small shapes):
   masked (-inf) vocabularies, confident tokens, logits with a large common offset, large logits
   at a low temperature (entropy), long completions, a -inf label logit on-policy, scores of
   extreme spread, exact ties;

and returns a :class:`CheckReport`: one row per quantity with its max absolute and relative error,
the tolerance and pass/fail. ``report.table()`` prints it, ``report.to_json()`` serializes it,
``report.passed`` is the verdict (the command exits non-zero on any failure).

Tolerances, and why (``eps``: unit roundoff of the compute dtype, 2^-24 for fp32 and 2^-53 for
fp64; ``eps_in``: of the input dtype; ``S``: the largest spread ``(max z - min z) / tau`` of a row
of tempered logits; ``V``, ``T``, ``H``: vocabulary, tokens per completion, hidden size):

* **token** (token log-probs, entropies, candidate logits): ``abs <= 16 eps (S + log V + 1)``. A
  log-prob is ``(z_y - max z) / tau - log sum exp(...)``: two terms of magnitude ``<= S`` and
  ``<= log V``, each a few roundings from exact (exp and log within 2 ulp, the V-term sum within
  ~log2 V ulp in the kernels' tree/lane order); 16 ulps of the largest term leave a margin of
  ~10x over what the kernels reach. The fused-linear paths add the logits' own error: the
  matmul's fp32 accumulation (``H eps |h| |W|``) and, for bf16/fp16 inputs, one rounding of each
  logit to the input dtype (``eps_in |z|``), which is what the model's own lm_head does.
* **sequence** (sequence log-probs, p, q, the loss): ``abs <= T * token``: the sum of T token
  errors bounds the error of a sequence log-prob (summed in float64); p and q move by at most the
  spread of those errors and the loss by at most their size.
* **gradient**: elementwise ``|err| <= k * M + w * sequence / tau``, where ``M`` is the magnitude
  the entry is computed from (``|dL/dz|`` for logits gradients; ``|dL/dz| @ |W|`` and friends for
  the hidden, weight and bias gradients of the fused-linear paths, the classical matmul bound),
  ``k = token-relative error (16 eps (S + log V + 1)) + one rounding to the gradient's dtype +
  n eps`` for a sum of n terms, and ``w * sequence / tau`` the error the group coefficient ``p - q``
  passes on (w = 1 / groups for the mean).
* **fp64** inputs use the same formulas with fp64's eps (about 1e-13 here).
* edge cases state their own tolerance (e.g. "1% of the true-class gradient", issue 11's bar, or
  "1e-6 absolute", issue 10's entropy bar) in the row's note.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor

from . import functional as F
from . import reference
from .backends import Backend, backend_status, get_backend, triton_interpreter_enabled

PATHS = ("tpo_loss", "fused_linear_tpo_loss", "token_tpo_loss", "fused_linear_token_tpo_loss",
         "selective_logprobs", "fused_linear_logprobs")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}


def _unit(dtype: torch.dtype) -> float:
    return {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8,
            torch.float16: 2.0 ** -11}[dtype]


@dataclass
class CheckRow:
    """One checked quantity: its worst errors, the tolerance and the verdict."""

    section: str  # "gradcheck", "reference" or "edge"
    backend: str
    path: str
    quantity: str
    max_abs: float
    max_rel: float
    tolerance: str  # the bound, in words and numbers
    passed: bool
    note: str = ""


@dataclass
class CheckReport:
    """What :func:`check` found. ``passed`` is False when any row failed."""

    device: str
    dtype: str
    shapes: Dict[str, int]
    backends: List[str]
    rows: List[CheckRow] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(row.passed for row in self.rows)

    @property
    def failures(self) -> List[CheckRow]:
        return [row for row in self.rows if not row.passed]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["passed"] = self.passed
        out["tolerances"] = TOLERANCE_NOTES
        for row in out["rows"]:  # JSON has no inf / nan
            for key in ("max_abs", "max_rel"):
                if not math.isfinite(row[key]):
                    row[key] = str(row[key])
        return out

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def table(self) -> str:
        head = ("section", "backend", "path", "quantity", "max abs err", "max rel err", "tolerance", "")
        body = [(r.section, r.backend, r.path, r.quantity, _fmt(r.max_abs), _fmt(r.max_rel), r.tolerance,
                 "PASS" if r.passed else "FAIL") for r in self.rows]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
        lines = [f"tpo_kernels check on {self.device}, {self.dtype}, shapes "
                 + ", ".join(f"{k}={v}" for k, v in self.shapes.items())
                 + f"; backends: {', '.join(self.backends)}"]
        for row in [head] + body:
            lines.append("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
        notes = sorted({r.note for r in self.rows if r.note})
        if notes:
            lines.append("notes:")
            lines.extend(f"  {n}" for n in notes)
        lines.append("tolerances:")
        lines.extend(f"  {k}: {v}" for k, v in TOLERANCE_NOTES.items())
        failed = len(self.failures)
        lines.append(f"{len(self.rows)} checks, {failed} failed, {self.seconds:.1f} s: "
                     + ("PASS" if failed == 0 else "FAIL"))
        return "\n".join(lines)


TOLERANCE_NOTES = {
    "token": "abs <= 16 eps (S + log V + 1) [+ the fused matmul's H eps |h||W| and, for bf16/fp16 "
             "inputs, one rounding of each logit eps_in |z|]: a log-prob is two terms of size <= S and "
             "<= log V, each a few roundings from exact",
    "sequence": "abs <= T x token: a sequence log-prob sums T token log-probs (in float64); p, q and "
                "the loss move by at most that",
    "gradient": "|err| <= k M + w sequence / tau elementwise: M the magnitude the entry is computed "
                "from (|dL/dz|, or |dL/dz| @ |W| etc. for the fused paths), k = token-relative error + "
                "one rounding to the gradient dtype + n eps for a sum of n terms",
    "gradcheck": "torch.autograd.gradcheck in float64 (fast mode), its default eps/atol/rtol decide; the "
                 "errors shown are of one random directional derivative (central differences, step 1e-6)",
    "edge": "per case, in its note",
}


def _fmt(x: float) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return f"{x:.2e}"


# ----------------------------------------------------------------------------- comparing


def _errors(actual: Tensor, expected: Tensor):
    """(|a - e| elementwise in float64 on the CPU, max abs, max rel); equal infinities are 0 and
    a NaN where the reference is not counts as inf."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    diff = torch.where(a == e, torch.zeros((), dtype=torch.float64), (a - e).abs())
    diff = torch.where(torch.isnan(a) & ~torch.isnan(e), torch.full((), math.inf, dtype=torch.float64), diff)
    if diff.numel() == 0:
        return diff, 0.0, 0.0
    # Relative to entries above 2^-24 of the largest: smaller ones (exp underflow, cancellation)
    # carry no relative information; the bounds are absolute anyway.
    finite = e[torch.isfinite(e)].abs()
    floor = max(float(finite.max()) * 2.0 ** -24, 1e-300) if finite.numel() else 1e-300
    rel = torch.where(diff == 0, torch.zeros((), dtype=torch.float64), diff / e.abs().clamp_min(floor))
    return diff, float(diff.max()), float(rel.max())


class _Rows:
    """Collects the rows of one (section, backend, path)."""

    def __init__(self, report: CheckReport, section: str, backend: str, path: str):
        self.report, self.section, self.backend, self.path = report, section, backend, path

    def add(self, quantity, max_abs, max_rel, tolerance, passed, note=""):
        self.report.rows.append(CheckRow(self.section, self.backend, self.path, quantity, float(max_abs),
                                         float(max_rel), tolerance, bool(passed), note))

    def abs_bound(self, quantity, actual, expected, atol, note=""):
        diff, max_abs, max_rel = _errors(actual, expected)
        self.add(quantity, max_abs, max_rel, f"abs {atol:.1e}", max_abs <= atol, note)

    def elementwise(self, quantity, actual, expected, bound: Tensor, label: str, note=""):
        """|err| <= bound elementwise; the tolerance column shows the largest bound."""
        diff, max_abs, max_rel = _errors(actual, expected)
        bound = bound.detach().double().cpu().expand_as(diff)
        ok = bool((diff <= bound).all())
        self.add(quantity, max_abs, max_rel, f"{label} <= {float(bound.max()):.1e}", ok, note)

    def error(self, quantity, exc: BaseException):
        self.add(quantity, math.nan, math.nan, "runs", False, f"{type(exc).__name__}: {str(exc)[:160]}")


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


# ----------------------------------------------------------------------------- the reference section


def _sequence_rows(rows: _Rows, backend, inp: _Inputs, fused: bool):
    """tpo_loss / fused_linear_tpo_loss vs reference.tpo_loss in float64."""
    k, tau, eta = inp.group_size, inp.temperature, inp.eta
    kw = dict(group_size=k, temperature=tau, eta=eta, return_aux=True)
    if fused:
        h, w, b = _leaf(inp.hidden), _leaf(inp.weight), _leaf(inp.bias)
        loss, aux = F.fused_linear_tpo_loss(h, w, inp.labels, inp.scores, bias=b, backend=backend, **kw)
        loss.backward()
        h64, w64, b64 = _leaf64(inp.hidden), _leaf64(inp.weight), _leaf64(inp.bias)
        z64 = h64 @ w64.T + b64
        z64.retain_grad()
    else:
        x = _leaf(inp.logits)
        loss, aux = F.tpo_loss(x, inp.labels, inp.scores, backend=backend, inplace_backward=False, **kw)
        loss.backward()
        z64 = _leaf64(inp.logits)
    ref, raux = reference.tpo_loss(z64, inp.labels, inp.scores.double(), **kw)
    ref.backward()
    t_len = inp.labels.shape[1]
    mag = float((inp.hidden.double().abs() @ inp.weight.double().abs().T + inp.bias.double().abs()).max()) if fused else 0.0
    tol = _Tol(inp.logits.dtype if not fused else inp.hidden.dtype, z64.detach(), tau, z64.shape[-1],
               inp.hidden.shape[-1] if fused else 0, mag)
    seq = tol.sequence(t_len)
    rows.abs_bound("loss", loss, ref, 2 * seq)
    rows.abs_bound("token_logprobs", aux["token_logprobs"], raux["token_logprobs"], tol.token)
    rows.abs_bound("seq_logprobs", aux["seq_logprobs"], raux["seq_logprobs"], seq)
    rows.abs_bound("p", aux["p"], raux["p"], seq)
    rows.abs_bound("q", aux["q"], raux["q"], seq)
    groups = inp.logits.shape[0] // k
    coef_err = seq / groups / tau
    if fused:
        dz = z64.grad.abs()
        h_abs, w_abs = inp.hidden.double().abs().reshape(-1, inp.hidden.shape[-1]), inp.weight.double().abs()
        dz2 = dz.reshape(-1, dz.shape[-1])
        vocab, rows_m = w_abs.shape[0], h_abs.shape[0]
        rows.elementwise("grad_hidden", h.grad, h64.grad,
                         (tol.grad_k(vocab) * (dz2 @ w_abs) + coef_err * w_abs.sum(0)).view_as(h64), "gradient")
        rows.elementwise("grad_weight", w.grad, w64.grad,
                         tol.grad_k(rows_m) * (dz2.T @ h_abs) + coef_err * h_abs.sum(0), "gradient")
        rows.elementwise("grad_bias", b.grad, b64.grad, tol.grad_k(rows_m) * dz2.sum(0) + coef_err * rows_m,
                         "gradient")
    else:
        rows.elementwise("grad_logits", x.grad, z64.grad, tol.grad_k() * z64.grad.abs() + coef_err, "gradient")


def _token_rows(rows: _Rows, backend, inp: _Inputs, fused: bool):
    """token_tpo_loss / fused_linear_token_tpo_loss vs reference.token_tpo_loss in float64."""
    tau, eta = inp.temperature, inp.eta
    r = inp.candidates.shape[0]
    kw = dict(temperature=tau, eta=eta, return_aux=True)
    if fused:
        hid = inp.hidden.reshape(r, -1)
        h, w, b = _leaf(hid), _leaf(inp.weight), _leaf(inp.bias)
        loss, aux = F.fused_linear_token_tpo_loss(h, w, inp.candidates, inp.cand_scores, bias=b, backend=backend, **kw)
        loss.backward()
        h64, w64, b64 = _leaf64(hid), _leaf64(inp.weight), _leaf64(inp.bias)
        z64 = h64 @ w64.T + b64
        z64.retain_grad()
    else:
        x = _leaf(inp.logits.reshape(r, -1))
        loss, aux = F.token_tpo_loss(x, inp.candidates, inp.cand_scores, backend=backend, **kw)
        loss.backward()
        z64 = _leaf64(inp.logits.reshape(r, -1))
    ref, raux = reference.token_tpo_loss(z64, inp.candidates, inp.cand_scores.double(), temperature=tau, eta=eta,
                                         return_aux=True)
    ref.backward()
    dtype = inp.hidden.dtype if fused else inp.logits.dtype
    mag = float((hid.double().abs() @ inp.weight.double().abs().T + inp.bias.double().abs()).max()) if fused else 0.0
    cand = z64.detach().gather(1, inp.candidates)
    tol = _Tol(dtype, cand, tau, inp.candidates.shape[1], hid.shape[-1] if fused else 0, mag)
    token = tol.token + _unit(torch.float32) * float(cand.abs().max()) / tau  # one rounding of c = z / tau
    rows.abs_bound("loss", loss, ref, 2 * token)
    rows.abs_bound("candidate_logits", aux["candidate_logits"], raux["candidate_logits"], token)
    rows.abs_bound("p", aux["p"], raux["p"], token)
    rows.abs_bound("q", aux["q"], raux["q"], token)
    coef_err = token / r / tau
    if fused:
        dz = z64.grad.abs()
        w_abs, h_abs = inp.weight.double().abs(), hid.double().abs()
        k = inp.candidates.shape[1]
        rows.elementwise("grad_hidden", h.grad, h64.grad, tol.grad_k(k) * (dz @ w_abs) + coef_err * k * w_abs.max(),
                         "gradient")
        rows.elementwise("grad_weight", w.grad, w64.grad, tol.grad_k(r) * (dz.T @ h_abs) + coef_err * h_abs.sum(0),
                         "gradient")
        rows.elementwise("grad_bias", b.grad, b64.grad, tol.grad_k(r) * dz.sum(0) + coef_err * r, "gradient")
    else:
        rows.elementwise("grad_logits", x.grad, z64.grad, tol.grad_k() * z64.grad.abs() + coef_err, "gradient")


def _logprob_rows(rows: _Rows, backend, inp: _Inputs, fused: bool):
    """selective_logprobs / fused_linear_logprobs (log-probs and entropies, and the gradient of a
    weighted sum of both) vs reference.selective_logprobs in float64."""
    tau = inp.temperature
    gen = torch.Generator().manual_seed(1)
    w_lp = torch.randn(inp.labels.shape, generator=gen, dtype=torch.float64).to(inp.labels.device)
    w_h = torch.randn(inp.labels.shape, generator=gen, dtype=torch.float64).to(inp.labels.device)
    if fused:
        h, w, b = _leaf(inp.hidden), _leaf(inp.weight), _leaf(inp.bias)
        lp, ent = F.fused_linear_logprobs(h, w, inp.labels, bias=b, temperature=tau, return_entropy=True,
                                          backend=backend)
        h64, w64, b64 = _leaf64(inp.hidden), _leaf64(inp.weight), _leaf64(inp.bias)
        z64 = h64 @ w64.T + b64
        z64.retain_grad()
    else:
        x = _leaf(inp.logits)
        lp, ent = F.selective_logprobs(x, inp.labels, temperature=tau, return_entropy=True, backend=backend)
        z64 = _leaf64(inp.logits)
    ((lp.double() * w_lp).sum() + (ent.double() * w_h).sum()).backward()
    r_lp, r_ent = reference.selective_logprobs(z64, inp.labels, temperature=tau, return_entropy=True)
    ((r_lp * w_lp).sum() + (r_ent * w_h).sum()).backward()
    # The magnitude of the terms of dL/dz = (w_lp (onehot - p) - w_h p (log p + H)) / tau: the
    # gradient is their difference, so its error scales with them, not with the (cancelling) sum.
    with torch.no_grad():
        log_p = torch.log_softmax(z64.detach() / tau, dim=-1)
        p = log_p.exp()
        onehot = torch.zeros_like(p).scatter_(-1, inp.labels.clamp(min=0).unsqueeze(-1), 1.0)
        counted = (inp.labels >= 0).unsqueeze(-1)
        safe_log_p = torch.where(p > 0, log_p, torch.zeros_like(log_p)).abs()
        dz_mag = torch.where(counted, w_lp.abs().unsqueeze(-1) * (onehot + p)
                             + w_h.abs().unsqueeze(-1) * p * (safe_log_p + r_ent.detach().abs().unsqueeze(-1)), 0.0) / tau
    mag = float((inp.hidden.double().abs() @ inp.weight.double().abs().T + inp.bias.double().abs()).max()) if fused else 0.0
    tol = _Tol(inp.hidden.dtype if fused else inp.logits.dtype, z64.detach(), tau, z64.shape[-1],
               inp.hidden.shape[-1] if fused else 0, mag)
    rows.abs_bound("logprobs", lp, r_lp, tol.token)
    rows.abs_bound("entropy", ent, r_ent, tol.token * (1 + tol.spread))  # sum of p_v log p_v: log p_v <= S
    k = tol.grad_k() * (1 + tol.spread)  # the entropy gradient scales p_v by log p_v + H
    if fused:
        dz = dz_mag.reshape(-1, z64.shape[-1])
        h_abs, w_abs = inp.hidden.double().abs().reshape(-1, inp.hidden.shape[-1]), inp.weight.double().abs()
        n_v, n_m = w_abs.shape[0], h_abs.shape[0]
        rows.elementwise("grad_hidden", h.grad, h64.grad, ((k + n_v * tol.eps) * (dz @ w_abs)).view_as(h64), "gradient")
        rows.elementwise("grad_weight", w.grad, w64.grad, (k + n_m * tol.eps) * (dz.T @ h_abs), "gradient")
        rows.elementwise("grad_bias", b.grad, b64.grad, (k + n_m * tol.eps) * dz.sum(0), "gradient")
    else:
        rows.elementwise("grad_logits", x.grad, z64.grad, k * dz_mag, "gradient")


_REFERENCE_RUNNERS: Dict[str, Callable] = {
    "tpo_loss": lambda rows, b, inp: _sequence_rows(rows, b, inp, fused=False),
    "fused_linear_tpo_loss": lambda rows, b, inp: _sequence_rows(rows, b, inp, fused=True),
    "token_tpo_loss": lambda rows, b, inp: _token_rows(rows, b, inp, fused=False),
    "fused_linear_token_tpo_loss": lambda rows, b, inp: _token_rows(rows, b, inp, fused=True),
    "selective_logprobs": lambda rows, b, inp: _logprob_rows(rows, b, inp, fused=False),
    "fused_linear_logprobs": lambda rows, b, inp: _logprob_rows(rows, b, inp, fused=True),
}


# ----------------------------------------------------------------------------- gradcheck


def _gradcheck(rows: _Rows, backend, path: str, device):
    """float64 gradcheck (fast mode) on small shapes."""
    inp = _make_inputs(device, torch.float64, 4, 2, 3, 7, 5, 0.8, 0.7, seed=2)
    r = inp.candidates.shape[0]
    # TPO holds q constant; with on-policy p_old = p it would move with the inputs, so the losses
    # get fixed old log-probs (then q is a constant and the loss a smooth function to check).
    old = torch.linspace(-3.0, -1.0, 4, dtype=torch.float64, device=device)
    old_cand = torch.linspace(-2.0, 0.0, r * 2, dtype=torch.float64, device=device).view(r, 2)
    k = dict(backend=backend, temperature=0.8)
    loss_kw = dict(k, eta=0.7)
    cases = {
        "tpo_loss": ((inp.logits,), lambda x: F.tpo_loss(x, inp.labels, inp.scores, group_size=2, old_logprobs=old,
                                                         inplace_backward=False, **loss_kw)),
        "fused_linear_tpo_loss": ((inp.hidden, inp.weight, inp.bias), lambda hh, ww, bb: F.fused_linear_tpo_loss(
            hh, ww, inp.labels, inp.scores, bias=bb, group_size=2, old_logprobs=old, chunk_size=2, **loss_kw)),
        "token_tpo_loss": ((inp.logits.reshape(r, -1),), lambda x: F.token_tpo_loss(
            x, inp.candidates, inp.cand_scores, old_logprobs=old_cand, **loss_kw)),
        "fused_linear_token_tpo_loss": ((inp.hidden.reshape(r, -1), inp.weight, inp.bias),
                                        lambda hh, ww, bb: F.fused_linear_token_tpo_loss(
            hh, ww, inp.candidates, inp.cand_scores, bias=bb, old_logprobs=old_cand, **loss_kw)),
        "selective_logprobs": ((inp.logits,), lambda x: F.selective_logprobs(
            x, inp.labels, return_entropy=True, **k)),
        "fused_linear_logprobs": ((inp.hidden, inp.weight, inp.bias), lambda hh, ww, bb: F.fused_linear_logprobs(
            hh, ww, inp.labels, bias=bb, return_entropy=True, chunk_size=2, **k)),
    }
    tensors, fn = cases[path]
    args = tuple(_leaf(t) for t in tensors)
    try:
        ok = torch.autograd.gradcheck(fn, args, fast_mode=True, raise_exception=True)
        max_abs, max_rel = _directional_error(fn, args)
        rows.add("gradcheck float64", max_abs, max_rel, "gradcheck", ok)
    except Exception as exc:  # GradcheckError or a failure inside the path
        rows.add("gradcheck float64", math.nan, math.nan, "gradcheck", False,
                 f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")


def _directional_error(fn, args, step: float = 1e-6):
    """The numbers behind the verdict: a random weighted sum of the outputs, differentiated along a
    random direction by central differences and by the backward; (|difference|, relative)."""
    gen = torch.Generator().manual_seed(3)
    direction = [torch.randn(a.shape, generator=gen, dtype=a.dtype).to(a.device) for a in args]
    outputs = fn(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    weights = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outputs]

    def scalar(*xs):
        out = fn(*xs)
        out = out if isinstance(out, tuple) else (out,)
        return sum((o * w).sum() for o, w in zip(out, weights))

    grads = torch.autograd.grad(scalar(*args), args)
    analytic = float(sum((g * d).sum() for g, d in zip(grads, direction)))
    with torch.no_grad():
        plus = scalar(*(a + step * d for a, d in zip(args, direction)))
        minus = scalar(*(a - step * d for a, d in zip(args, direction)))
    numeric = float(plus - minus) / (2 * step)
    diff = abs(numeric - analytic)
    return diff, diff / max(abs(analytic), 1e-300)


# ----------------------------------------------------------------------------- edge cases


def _edge_masked_vocab(rows: _Rows, backend, device):
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(4, 64, generator=gen) * 2
    logits[0, 10:30] = float("-inf")
    logits[1, 32:] = float("-inf")
    logits[2, :] = float("-inf")
    logits[2, 5] = 0.7  # only the label is finite
    logits[3, ::2] = float("-inf")
    labels = torch.tensor([3, 1, 5, 7])
    logits, labels = logits.to(device), labels.to(device)
    x = _leaf(logits)
    lp, ent = F.selective_logprobs(x, labels, return_entropy=True, backend=backend)
    (lp.sum() + ent.sum()).backward()
    x64 = _leaf64(logits)
    r_lp, r_ent = reference.selective_logprobs(x64, labels, return_entropy=True)
    (r_lp.sum() + r_ent.sum()).backward()
    note = "masked (-inf) vocabulary, a row with only the label finite: 1e-6 abs (fp32, values <= 10)"
    rows.abs_bound("masked vocab: logprobs", lp, r_lp, 1e-6, note)
    rows.abs_bound("masked vocab: entropy", ent, r_ent, 1e-6, note)
    rows.abs_bound("masked vocab: grad", x.grad, x64.grad, 1e-6, note)
    # The fused-linear path: a -inf bias over a range that covers whole vocabulary blocks.
    hidden = torch.randn(4, 16, generator=gen).to(device)
    weight = (torch.randn(256, 16, generator=gen) * 0.3).to(device)
    bias = torch.zeros(256, device=device)
    bias[64:160] = float("-inf")
    lab = torch.tensor([1, 2, 200, 255], device=device)
    h = _leaf(hidden)
    lp, ent = F.fused_linear_logprobs(h, weight, lab, bias=bias, return_entropy=True, backend=backend, chunk_size=1)
    (lp.sum() + ent.sum()).backward()
    h64 = _leaf64(hidden)
    r_lp, r_ent = reference.selective_logprobs(h64 @ weight.double().T + bias.double(), lab, return_entropy=True)
    (r_lp.sum() + r_ent.sum()).backward()
    note = "-inf bias over whole vocabulary blocks (fused linear): 1e-6 abs; gradient 1e-5 (sums of V terms)"
    rows.abs_bound("masked blocks: logprobs (linear)", lp, r_lp, 1e-6, note)
    rows.abs_bound("masked blocks: entropy (linear)", ent, r_ent, 1e-6, note)
    rows.abs_bound("masked blocks: grad (linear)", h.grad, h64.grad, 1e-5, note)


def _edge_confident(rows: _Rows, backend, device):
    note = "confident token: the true-class gradient 1 - p within 1% of float64 and not 0 (issue 11's bar)"
    v = 64
    for k in (3, 5, 7):
        logits = torch.zeros(1, v)
        logits[0, 0] = math.log((v - 1) * (1 - 10.0 ** -k) / 10.0 ** -k)
        logits, labels = logits.to(device), torch.tensor([0], device=device)
        x64 = _leaf64(logits)
        torch.log_softmax(x64, -1)[0, 0].backward()
        expected = x64.grad[0, 0]
        for path in ("logits", "linear"):
            x = _leaf(logits)
            if path == "logits":
                lp = F.selective_logprobs(x, labels, backend=backend)
            else:
                lp = F.fused_linear_logprobs(x, torch.eye(v, device=device), labels, backend=backend, chunk_size=1)
            lp.sum().backward()
            got = x.grad[0, 0]
            rel = abs(float(got) - float(expected)) / float(expected)
            rows.add(f"confident 1-p=1e-{k}: dz_y ({path})", abs(float(got) - float(expected)), rel, "rel 1.0e-02",
                     rel <= 0.01 and float(got) != 0.0, note)


def _edge_offset(rows: _Rows, backend, device):
    note = "logits 3e4 + N(0, 2): log-probs within 2e-6 of float64 (torch.log_softmax: 5.5e-7)"
    gen = torch.Generator().manual_seed(22)
    logits = (3e4 + 2 * torch.randn(8, 500, generator=gen)).to(device)
    labels = torch.randint(0, 500, (8,), generator=gen).to(device)
    r_lp = reference.selective_logprobs(logits.double(), labels)
    rows.abs_bound("offset 3e4: logprobs", F.selective_logprobs(logits, labels, backend=backend), r_lp, 2e-6, note)
    lp = F.fused_linear_logprobs(logits, torch.eye(500, device=device), labels, backend=backend, chunk_size=1)
    rows.abs_bound("offset 3e4: logprobs (linear)", lp, r_lp, 2e-6, note)


def _edge_entropy(rows: _Rows, backend, device):
    note = "logits 1e3 +- 8 at temperature 0.3: entropy within 1e-6 abs (issue 10's bar)"
    gen = torch.Generator().manual_seed(23)
    logits = (1e3 + 8 * torch.randn(4, 256, generator=gen)).to(device)
    labels = torch.randint(0, 256, (4,), generator=gen).to(device)
    _, r_ent = reference.selective_logprobs(logits.double(), labels, temperature=0.3, return_entropy=True)
    _, ent = F.selective_logprobs(logits, labels, temperature=0.3, return_entropy=True, backend=backend)
    rows.abs_bound("entropy 1e3+-8 T=0.3", ent, r_ent, 1e-6, note)
    _, ent = F.fused_linear_logprobs(logits, torch.eye(256, device=device), labels, temperature=0.3,
                                     return_entropy=True, backend=backend, chunk_size=1)
    rows.abs_bound("entropy 1e3+-8 T=0.3 (linear)", ent, r_ent, 1e-6, note)


def _edge_long(rows: _Rows, backend, device, tokens: int):
    note = f"{tokens}-token completions, O(1) apart: p and q within 1e-6 of float64 (fp32 sums: 1e-3)"
    gen = torch.Generator().manual_seed(24)
    n, v = 4, 16
    logits = (torch.randn(1, tokens, v, generator=gen) * 2).expand(n, tokens, v).contiguous().to(device)
    labels = torch.randint(0, v, (1, tokens), generator=gen).expand(n, tokens).contiguous()
    labels[1:, :3] = torch.randint(0, v, (n - 1, 3), generator=gen)
    labels = labels.to(device)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25], device=device)
    _, aux = F.tpo_loss(logits, labels, scores, group_size=n, backend=backend, return_aux=True)
    _, raux = reference.tpo_loss(logits.double(), labels, scores.double(), group_size=n, return_aux=True)
    rows.abs_bound(f"T={tokens}: p", aux["p"], raux["p"], 1e-6, note)
    rows.abs_bound(f"T={tokens}: q", aux["q"], raux["q"], 1e-6, note)


def _edge_neg_inf_label(rows: _Rows, backend, device):
    note = "on-policy -inf label logit: the finite limit of the loss (q = 0 terms count 0), 1e-6 abs"
    gen = torch.Generator().manual_seed(25)
    logits = torch.randn(4, 3, 11, generator=gen)
    labels = torch.randint(0, 11, (4, 3), generator=gen)
    logits[1, 0, labels[1, 0]] = float("-inf")
    logits, labels = logits.to(device), labels.to(device)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25], device=device)
    x = _leaf(logits)
    loss = F.tpo_loss(x, labels, scores, group_size=4, backend=backend, inplace_backward=False)
    loss.backward()
    x64 = _leaf64(logits)
    ref = reference.tpo_loss(x64, labels, scores.double(), group_size=4)
    ref.backward()
    rows.abs_bound("-inf label: loss", loss, ref, 1e-6, note)
    rows.abs_bound("-inf label: grad", x.grad, x64.grad, 1e-6, note)


def _exact_u(scores: Tensor) -> Tensor:
    values = [Fraction(float(v)) for v in scores]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    if var == 0:
        return torch.zeros(len(values), dtype=torch.float64)
    scale = 10 ** 40
    std = Fraction(math.isqrt(var.numerator * scale ** 2 // var.denominator), scale)
    return torch.tensor([float((v - mean) / std) for v in values], dtype=torch.float64)


def _edge_scores(rows: _Rows, backend, device):
    note = "scores of spread 1e-25 .. 1e20 and float64 scores 1e-12 apart: u within 2e-7 of exact (fp32 output)"
    base = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    gen = torch.Generator().manual_seed(26)
    logits = torch.randn(4, 3, 11, generator=gen).to(device)
    labels = torch.randint(0, 11, (4, 3), generator=gen).to(device)
    for name, scores in (("1e-25", base * 1e-25), ("1e20", base * 1e20), ("fp64 1e-12 apart", 1.0 + base * 1e-12)):
        _, aux = F.tpo_loss(logits, labels, scores.to(device), group_size=4, backend=backend, return_aux=True)
        rows.abs_bound(f"scores {name}: u", aux["u"], _exact_u(scores), 2e-7, note)
    # Exact ties: a tied on-policy group gets p == q bit for bit and no gradient.
    v = 0.45938294312745087
    scores = torch.tensor([v, v, v, 1.0, 0.0, 0.5], dtype=torch.float64, device=device)
    x = _leaf(torch.randn(6, 3, 7, generator=gen).to(device))
    loss, aux = F.tpo_loss(x, torch.randint(0, 7, (6, 3), generator=gen).to(device), scores, group_size=3,
                           backend=backend, return_aux=True)
    loss.backward()
    diff = float((aux["p"][:3] - aux["q"][:3]).abs().max()) + float(x.grad[:3].abs().max())
    rows.add("tied group: p - q and grad", diff, diff, "exact 0", diff == 0.0,
             "a tied on-policy group: p == q bit for bit, zero gradient")


_EDGE_CASES = (_edge_masked_vocab, _edge_confident, _edge_offset, _edge_entropy, _edge_neg_inf_label, _edge_scores)


# ----------------------------------------------------------------------------- entry point


def _resolve(backends, device) -> List[Backend]:
    if backends is None:
        chosen = []
        for name, state in backend_status().items():
            if state != "available":
                continue
            backend = get_backend(name, device) if _runs_on(name, device) else None
            if backend is not None:
                chosen.append(backend)
        return chosen
    if isinstance(backends, (str, Backend)):
        backends = [backends]
    return [get_backend(b, device) for b in backends]


def _runs_on(name: str, device) -> bool:
    try:
        get_backend(name, device)
        return True
    except (RuntimeError, ValueError):
        return False


def check(
    *,
    device: Union[str, torch.device, None] = None,
    dtype: Union[str, torch.dtype] = torch.float32,
    backends: Optional[Sequence[Union[str, Backend]]] = None,
    paths: Optional[Sequence[str]] = None,
    N: int = 8,
    K: int = 4,
    T: int = 16,
    V: int = 256,
    H: int = 64,
    temperature: float = 0.7,
    eta: float = 0.5,
    gradcheck: bool = True,
    edge_cases: bool = True,
    long_tokens: Optional[int] = None,
    seed: int = 0,
) -> CheckReport:
    """Check every backend and path numerically on this machine; see the module docstring.

    Args:
        device: where to run (default: CUDA when present, else CPU).
        dtype: input dtype of the reference section (float32, bfloat16, float16, float64; a name
            works too). Gradcheck runs in float64 and the edge cases in float32 whatever it is.
        backends: names or :class:`~tpo_kernels.backends.Backend` instances (default: every backend
            that runs on ``device``).
        paths: a subset of :data:`PATHS` (default: all six public functions).
        N, K, T, V, H: completions, group size (also candidates per state), tokens per
            completion, vocabulary and hidden size of the reference section (token-level paths use
            ``N * T`` states with K candidates each).
        temperature, eta: the hyper-parameters of the reference section.
        gradcheck, edge_cases: run those sections.
        long_tokens: completion length of the long-completion edge case (default 32768; 1024
            under the Triton interpreter, which runs one Python program per row).
        seed: of the random inputs.
    """
    start = time.perf_counter()
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(set(_DTYPES))}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"dtype must be float32, bfloat16, float16 or float64, got {dtype}")
    paths = tuple(PATHS if paths is None else paths)
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise ValueError(f"paths must be among {PATHS}, got {unknown}")
    for name, value in (("N", N), ("K", K), ("T", T), ("V", V), ("H", H)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if N % K:
        raise ValueError(f"K must divide N (groups of K completions), got N={N}, K={K}")
    chosen = _resolve(backends, device)
    if not chosen:
        raise RuntimeError(f"no backend runs on {device} here: {backend_status()}")
    report = CheckReport(device=str(device), dtype=str(dtype).replace("torch.", ""),
                         shapes=dict(N=N, K=K, T=T, V=V, H=H), backends=[b.name for b in chosen])
    inputs = _make_inputs(device, dtype, N, K, T, V, H, temperature, eta, seed)
    for backend in chosen:
        for path in paths:
            if gradcheck:
                rows = _Rows(report, "gradcheck", backend.name, path)
                _gradcheck(rows, backend, path, device)
            rows = _Rows(report, "reference", backend.name, path)
            try:
                _REFERENCE_RUNNERS[path](rows, backend, inputs)
            except Exception as exc:  # a crash is a failed check, reported like one
                rows.error("runs", exc)
        if edge_cases:
            rows = _Rows(report, "edge", backend.name, "fp32")
            tokens = long_tokens
            if tokens is None:
                tokens = 1024 if backend.name == "triton" and device.type == "cpu" and triton_interpreter_enabled() else 32768
            for case in _EDGE_CASES + (lambda r, b, d: _edge_long(r, b, d, tokens),):
                try:
                    case(rows, backend, device)
                except Exception as exc:
                    rows.error(getattr(case, "__name__", "edge case").replace("_edge_", ""), exc)
    report.seconds = time.perf_counter() - start
    return report


__all__ = ["PATHS", "CheckReport", "CheckRow", "check"]
