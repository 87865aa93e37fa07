"""Every public path against reference.py, and float64 gradcheck."""

from __future__ import annotations

import math
from typing import Callable, Dict

import torch

from .. import functional as F
from .. import reference
from .report import _Rows, _unit
from .inputs import _Inputs, _Tol, _leaf, _leaf64, _make_inputs


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
