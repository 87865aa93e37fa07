"""Every public path against reference.py, and float64 gradcheck.

The path runs once at the user's shapes and dtype. Its float64 reference runs one chunk of rows at
a time (:data:`~.inputs.CHUNK_ELEMENTS` entries of ``[rows, V]``): pass 1 (shared, see
:class:`~.inputs._Head`) gives the reference token log-probs; the sequence-level group stage runs
on them in float64 (``reference.tpo_loss_from_logprobs``, the second half of
``reference.tpo_loss``); pass 2 back-propagates its gradient into each chunk's logits by autograd
of ``reference.token_logprobs`` and compares the chunk's gradients. Token-level TPO is per state,
so its reference (``reference.token_tpo_loss``) runs chunk by chunk in one pass.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import functional as F
from .. import reference
from .inputs import _Inputs, _leaf, _leaf64, _make_inputs, _max_spread, row_chunks
from .report import _Accumulated, _Rows, _unit


# ----------------------------------------------------------------------------- the reference section


def _add_magnitudes(sums: Optional[Tuple[Tensor, Tensor, Tensor]], dz: Tensor, h_abs: Tensor):
    """The running ``(|dz|^T |h|, sum |dz|, sum |h|)`` of a fused path's weight and bias bounds,
    accumulated in place: the first is a float64 ``[V, H]``, and an out-of-place sum would hold
    two more of them at once."""
    if sums is None:
        return dz.T @ h_abs, dz.sum(0), h_abs.sum(0)
    weight_mag, bias_mag, hidden_abs_sum = sums
    weight_mag.addmm_(dz.T, h_abs)
    bias_mag.add_(dz.sum(0))
    hidden_abs_sum.add_(h_abs.sum(0))
    return sums


def _sequence_rows(rows: _Rows, backend, inp: _Inputs, fused: bool):
    """tpo_loss / fused_linear_tpo_loss vs reference.tpo_loss in float64."""
    k, tau, eta = inp.group_size, inp.temperature, inp.eta
    kw = dict(group_size=k, eta=eta, return_aux=True, **inp.transform)
    if fused:
        h, w, b = _leaf(inp.hidden), _leaf(inp.weight), _leaf(inp.bias)
        loss, aux = F.fused_linear_tpo_loss(h, w, inp.labels, inp.scores, bias=b, backend=backend, **kw)
    else:
        x = _leaf(inp.logits)
        loss, aux = F.tpo_loss(x, inp.labels, inp.scores, backend=backend, inplace_backward=False, **kw)
    loss.backward()
    head = inp.head(fused)
    n, t_len = inp.labels.shape
    lp64 = head.logprobs.view(n, t_len).clone().requires_grad_(True)
    mask = inp.labels != -100
    ref, raux = reference.tpo_loss_from_logprobs(lp64, inp.scores.double(), mask=mask, group_size=k, eta=eta,
                                                 return_aux=True)
    ref.backward()
    grad_lp = lp64.grad.reshape(-1)  # dL / d(token log-prob): the group coefficient on counted tokens
    tol = head.tolerance(inp.hidden.dtype if fused else inp.logits.dtype)
    seq = tol.sequence(t_len)
    rows.abs_bound("loss", loss, ref, 2 * seq)
    rows.abs_bound("token_logprobs", aux["token_logprobs"], raux["token_logprobs"], tol.token)
    rows.abs_bound("seq_logprobs", aux["seq_logprobs"], raux["seq_logprobs"], seq)
    rows.abs_bound("p", aux["p"], raux["p"], seq)
    rows.abs_bound("q", aux["q"], raux["q"], seq)
    coef_err = seq / (n // k) * abs(inp.logit_scale) / tau
    w64, b64 = head.leaves()
    grads = {name: _Accumulated() for name in (("grad_hidden",) if fused else ("grad_logits",))}
    magnitudes = None
    for chunk in head.chunks():
        z, xin = head.chunk_with_grad(chunk, w64, b64)
        reference.token_logprobs(z, head.flat_labels[chunk], **inp.transform).backward(grad_lp[chunk])
        dz = z.grad.abs()
        if fused:
            h_abs = head.hidden[chunk].double().abs()
            grads["grad_hidden"].add(h.grad.reshape(head.rows, -1)[chunk], xin.grad,
                                     tol.grad_k(head.vocab) * (dz @ head.w_abs) + coef_err * head.w_abs.sum(0))
            magnitudes = _add_magnitudes(magnitudes, dz, h_abs)
        else:
            grads["grad_logits"].add(x.grad.reshape(head.rows, -1)[chunk], z.grad, tol.grad_k() * dz + coef_err)
    if fused:
        weight_mag, bias_mag, hidden_abs_sum = magnitudes
        grads["grad_weight"], grads["grad_bias"] = _Accumulated(), _Accumulated()
        grads["grad_weight"].add(w.grad, w64.grad, weight_mag.mul_(tol.grad_k(head.rows)).add_(coef_err * hidden_abs_sum))
        grads["grad_bias"].add(b.grad, b64.grad, tol.grad_k(head.rows) * bias_mag + coef_err * head.rows)
    for name, acc in grads.items():
        rows.accumulated(name, acc)


def _from_logprobs_rows(rows: _Rows, backend, inp: _Inputs):
    """tpo_loss_from_logprobs vs reference.tpo_loss_from_logprobs in float64."""
    k, eta = inp.group_size, inp.eta
    mask = inp.labels != -100
    kw = dict(mask=mask, group_size=k, eta=eta, return_aux=True)
    lp = _leaf(inp.token_logprobs)
    loss, aux = F.tpo_loss_from_logprobs(lp, inp.scores, backend=backend, **kw)
    loss.backward()
    lp64 = _leaf64(inp.token_logprobs)
    ref, raux = reference.tpo_loss_from_logprobs(lp64, inp.scores.double(), **kw)
    ref.backward()
    # The inputs are exact in the compute dtype and summed in float64: what is left is the group
    # math and the rounding of the outputs, a few eps of the largest sequence log-prob.
    eps = _unit(torch.float64 if lp.dtype == torch.float64 else torch.float32)
    seq = 16 * eps * (float(raux["seq_logprobs"].abs().max()) + 1)
    rows.abs_bound("loss", loss, ref, 2 * seq)
    rows.abs_bound("seq_logprobs", aux["seq_logprobs"], raux["seq_logprobs"], seq)
    rows.abs_bound("p", aux["p"], raux["p"], seq)
    rows.abs_bound("q", aux["q"], raux["q"], seq)
    bound = (2 * _unit(lp.dtype) + 16 * eps) * lp64.grad.abs() + seq / (lp.shape[0] // k)
    rows.elementwise("grad_logprobs", lp.grad, lp64.grad, bound, "gradient")


def _token_rows(rows: _Rows, backend, inp: _Inputs, fused: bool):
    """token_tpo_loss / fused_linear_token_tpo_loss vs reference.token_tpo_loss in float64."""
    tau, eta = inp.temperature, inp.eta
    r, kc = inp.candidates.shape
    kw = dict(eta=eta, return_aux=True, **inp.transform)
    if fused:
        hid = inp.hidden.reshape(r, -1)
        h, w, b = _leaf(hid), _leaf(inp.weight), _leaf(inp.bias)
        loss, aux = F.fused_linear_token_tpo_loss(h, w, inp.candidates, inp.cand_scores, bias=b, backend=backend, **kw)
    else:
        x = _leaf(inp.logits.reshape(r, -1))
        loss, aux = F.token_tpo_loss(x, inp.candidates, inp.cand_scores, backend=backend, **kw)
    loss.backward()
    head = inp.head(fused)
    w64, b64 = head.leaves()
    # The tolerance needs the tempered candidate logits first: K per state, cheap to form.
    spread = max_tempered = 0.0
    with torch.no_grad():
        for chunk in row_chunks(r, kc * (hid.shape[-1] if fused else 1)):
            cand = inp.candidates[chunk]
            if fused:
                z = torch.einsum("rh,rkh->rk", hid[chunk].double(), inp.weight.double()[cand]) + inp.bias.double()[cand]
            else:
                z = inp.logits.reshape(r, -1)[chunk].gather(1, cand).double()  # gather first: [rows, K], not [rows, V]
            tempered = reference.tempered_logits(z, **inp.transform)
            spread, max_tempered = max(spread, _max_spread(tempered)), max(max_tempered, float(tempered.abs().max()))
    tol = head.tolerance(inp.hidden.dtype if fused else inp.logits.dtype, vocab=kc, spread=spread,
                         max_tempered=max_tempered)
    token = tol.token + _unit(torch.float32) * max_tempered  # one rounding of c = z / tau
    coef_err = token / r * abs(inp.logit_scale) / tau
    outputs = {name: _Accumulated("abs") for name in ("candidate_logits", "p", "q")}
    grads = {name: _Accumulated() for name in (("grad_hidden",) if fused else ("grad_logits",))}
    ref_loss = 0.0
    magnitudes = None
    for chunk in head.chunks():
        z, xin = head.chunk_with_grad(chunk, w64, b64)
        part, raux = reference.token_tpo_loss(z, inp.candidates[chunk], inp.cand_scores[chunk].double(),
                                              reduction="sum", **kw)
        (part / r).backward()
        ref_loss += float(part.detach()) / r
        for name, acc in outputs.items():
            acc.add(aux[name][chunk], raux[name], token)
        dz = z.grad.abs()
        if fused:
            h_abs = hid[chunk].double().abs()
            grads["grad_hidden"].add(h.grad[chunk], xin.grad,
                                     tol.grad_k(kc) * (dz @ head.w_abs) + coef_err * kc * head.w_abs.max())
            magnitudes = _add_magnitudes(magnitudes, dz, h_abs)
        else:
            grads["grad_logits"].add(x.grad[chunk], z.grad, tol.grad_k() * dz + coef_err)
    rows.abs_bound("loss", loss, torch.tensor(ref_loss, dtype=torch.float64), 2 * token)
    for name, acc in outputs.items():
        rows.accumulated(name, acc)
    if fused:
        weight_mag, bias_mag, hidden_abs_sum = magnitudes
        grads["grad_weight"], grads["grad_bias"] = _Accumulated(), _Accumulated()
        grads["grad_weight"].add(w.grad, w64.grad, weight_mag.mul_(tol.grad_k(r)).add_(coef_err * hidden_abs_sum))
        grads["grad_bias"].add(b.grad, b64.grad, tol.grad_k(r) * bias_mag + coef_err * r)
    for name, acc in grads.items():
        rows.accumulated(name, acc)


def _logprob_rows(rows: _Rows, backend, inp: _Inputs, fused: bool):
    """selective_logprobs / fused_linear_logprobs (log-probs and entropies, and the gradient of a
    weighted sum of both) vs reference.selective_logprobs in float64."""
    tau = inp.temperature
    gen = torch.Generator().manual_seed(1)
    w_lp = torch.randn(inp.labels.shape, generator=gen, dtype=torch.float64).to(inp.labels.device)
    w_h = torch.randn(inp.labels.shape, generator=gen, dtype=torch.float64).to(inp.labels.device)
    if fused:
        h, w, b = _leaf(inp.hidden), _leaf(inp.weight), _leaf(inp.bias)
        lp, ent = F.fused_linear_logprobs(h, w, inp.labels, bias=b, return_entropy=True, backend=backend,
                                          **inp.transform)
    else:
        x = _leaf(inp.logits)
        lp, ent = F.selective_logprobs(x, inp.labels, return_entropy=True, backend=backend, **inp.transform)
    ((lp.double() * w_lp).sum() + (ent.double() * w_h).sum()).backward()
    head = inp.head(fused)
    tol = head.tolerance(inp.hidden.dtype if fused else inp.logits.dtype)
    rows.abs_bound("logprobs", lp, head.logprobs.view_as(lp), tol.token)
    rows.abs_bound("entropy", ent, head.entropy.view_as(ent), tol.token * (1 + tol.spread))  # p_v log p_v: log p_v <= S
    k = tol.grad_k() * (1 + tol.spread)  # the entropy gradient scales p_v by log p_v + H
    w64, b64 = head.leaves()
    w_lp, w_h = w_lp.reshape(-1), w_h.reshape(-1)
    grads = {name: _Accumulated() for name in (("grad_hidden",) if fused else ("grad_logits",))}
    magnitudes = None
    for chunk in head.chunks():
        z, xin = head.chunk_with_grad(chunk, w64, b64)
        labels = head.flat_labels[chunk]
        r_lp, r_ent = reference.selective_logprobs(z, labels, return_entropy=True, **inp.transform)
        ((r_lp * w_lp[chunk]).sum() + (r_ent * w_h[chunk]).sum()).backward()
        # The magnitude of the terms of dL/dz = (w_lp (onehot - p) - w_h p (log p + H)) dz'/dz
        # (dz'/dz <= logit_scale / tau, also under a soft cap): the gradient is their difference,
        # so its error scales with them, not with the (cancelling) sum.
        with torch.no_grad():
            log_p = torch.log_softmax(reference.tempered_logits(z.detach(), **inp.transform), dim=-1)
            p = log_p.exp()
            onehot = torch.zeros_like(p).scatter_(-1, labels.clamp(min=0).unsqueeze(-1), 1.0)
            counted = (labels >= 0).unsqueeze(-1)
            safe_log_p = torch.where(p > 0, log_p, torch.zeros_like(log_p)).abs()
            dz_mag = torch.where(counted, w_lp[chunk].abs().unsqueeze(-1) * (onehot + p)
                                 + w_h[chunk].abs().unsqueeze(-1) * p * (safe_log_p + r_ent.abs().unsqueeze(-1)),
                                 0.0) * (abs(inp.logit_scale) / tau)
        if fused:
            h_abs = head.hidden[chunk].double().abs()
            grads["grad_hidden"].add(h.grad.reshape(head.rows, -1)[chunk], xin.grad,
                                     (k + head.vocab * tol.eps) * (dz_mag @ head.w_abs))
            magnitudes = _add_magnitudes(magnitudes, dz_mag, h_abs)
        else:
            grads["grad_logits"].add(x.grad.reshape(head.rows, -1)[chunk], z.grad, k * dz_mag)
    if fused:
        weight_mag, bias_mag, _ = magnitudes
        grads["grad_weight"], grads["grad_bias"] = _Accumulated(), _Accumulated()
        grads["grad_weight"].add(w.grad, w64.grad, weight_mag.mul_(k + head.rows * tol.eps))
        grads["grad_bias"].add(b.grad, b64.grad, (k + head.rows * tol.eps) * bias_mag)
    for name, acc in grads.items():
        rows.accumulated(name, acc)


_REFERENCE_RUNNERS: Dict[str, Callable] = {
    "tpo_loss": lambda rows, b, inp: _sequence_rows(rows, b, inp, fused=False),
    "fused_linear_tpo_loss": lambda rows, b, inp: _sequence_rows(rows, b, inp, fused=True),
    "tpo_loss_from_logprobs": _from_logprobs_rows,
    "token_tpo_loss": lambda rows, b, inp: _token_rows(rows, b, inp, fused=False),
    "fused_linear_token_tpo_loss": lambda rows, b, inp: _token_rows(rows, b, inp, fused=True),
    "selective_logprobs": lambda rows, b, inp: _logprob_rows(rows, b, inp, fused=False),
    "fused_linear_logprobs": lambda rows, b, inp: _logprob_rows(rows, b, inp, fused=True),
}


# ----------------------------------------------------------------------------- gradcheck

# The logit transforms gradcheck runs every logits-taking path with, besides the plain softmax.
GRADCHECK_TRANSFORM = dict(logit_scale=0.5, logit_softcap=2.0)


def _gradcheck(rows: _Rows, backend, path: str, device):
    """float64 gradcheck (fast mode) on small shapes: plain, and with a logit scale and soft cap
    (every path but tpo_loss_from_logprobs, which takes log-probs)."""
    inp = _make_inputs(device, torch.float64, (4, 2, 3, 7, 5), temperature=0.8, eta=0.7, seed=2)
    r = inp.candidates.shape[0]
    # TPO holds q constant; with on-policy p_old = p it would move with the inputs, so the losses
    # get fixed old log-probs (then q is a constant and the loss a smooth function to check).
    old = torch.linspace(-3.0, -1.0, 4, dtype=torch.float64, device=device)
    old_cand = torch.linspace(-2.0, 0.0, r * 2, dtype=torch.float64, device=device).view(r, 2)
    if path == "tpo_loss_from_logprobs":
        mask = inp.labels != -100
        cases = {"": ((inp.token_logprobs,), lambda lp: F.tpo_loss_from_logprobs(
            lp, inp.scores, mask=mask, group_size=2, old_logprobs=old, eta=0.7, backend=backend))}
    else:
        cases = {"": _transformed_case(path, inp, old, old_cand, backend, {})}
        label = ", ".join(f"{k.replace('logit_', '')} {v}" for k, v in GRADCHECK_TRANSFORM.items())
        cases[f", {label}"] = _transformed_case(path, inp, old, old_cand, backend, GRADCHECK_TRANSFORM)
    for label, (tensors, fn) in cases.items():
        args = tuple(_leaf(t) for t in tensors)
        try:
            ok = torch.autograd.gradcheck(fn, args, fast_mode=True, raise_exception=True)
            max_abs, max_rel = _directional_error(fn, args)
            rows.add(f"gradcheck float64{label}", max_abs, max_rel, "gradcheck", ok)
        except Exception as exc:  # GradcheckError or a failure inside the path
            rows.add(f"gradcheck float64{label}", math.nan, math.nan, "gradcheck", False,
                     f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")


def _transformed_case(path, inp, old, old_cand, backend, transform):
    """(the tensors to differentiate, the function of them) of one logits-taking path."""
    r = inp.candidates.shape[0]
    k = dict(backend=backend, temperature=0.8, **transform)
    loss_kw = dict(k, eta=0.7)
    cases = {
        "tpo_loss": lambda: ((inp.logits,), lambda x: F.tpo_loss(
            x, inp.labels, inp.scores, group_size=2, old_logprobs=old, inplace_backward=False, **loss_kw)),
        "fused_linear_tpo_loss": lambda: ((inp.hidden, inp.weight, inp.bias), lambda hh, ww, bb: F.fused_linear_tpo_loss(
            hh, ww, inp.labels, inp.scores, bias=bb, group_size=2, old_logprobs=old, chunk_size=2, **loss_kw)),
        "token_tpo_loss": lambda: ((inp.logits.reshape(r, -1),), lambda x: F.token_tpo_loss(
            x, inp.candidates, inp.cand_scores, old_logprobs=old_cand, **loss_kw)),
        "fused_linear_token_tpo_loss": lambda: ((inp.hidden.reshape(r, -1), inp.weight, inp.bias),
                                                lambda hh, ww, bb: F.fused_linear_token_tpo_loss(
            hh, ww, inp.candidates, inp.cand_scores, bias=bb, old_logprobs=old_cand, **loss_kw)),
        "selective_logprobs": lambda: ((inp.logits,), lambda x: F.selective_logprobs(
            x, inp.labels, return_entropy=True, **k)),
        "fused_linear_logprobs": lambda: ((inp.hidden, inp.weight, inp.bias), lambda hh, ww, bb: F.fused_linear_logprobs(
            hh, ww, inp.labels, bias=bb, return_entropy=True, chunk_size=2, **k)),
    }
    return cases[path]()


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
