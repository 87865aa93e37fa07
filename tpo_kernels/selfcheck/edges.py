"""The numerical edge cases: masked vocabularies, confident tokens, offsets, long completions."""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from torch import Tensor

from .. import functional as F
from .. import reference
from .report import _Rows
from .inputs import _leaf, _leaf64


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
    note = "confident token: the true-class gradient 1 - p within 1% of float64 and not 0"
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
    note = "logits 1e3 +- 8 at temperature 0.3: entropy within 1e-6 abs"
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
    note = ("scores of spread 1e-25 .. 1e20 and float64 scores 1e-12 apart, standardized exactly (score_eps=0): "
            "u within 2e-7 of exact (fp32 output)")
    base = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    gen = torch.Generator().manual_seed(26)
    logits = torch.randn(4, 3, 11, generator=gen).to(device)
    labels = torch.randint(0, 11, (4, 3), generator=gen).to(device)
    for name, scores in (("1e-25", base * 1e-25), ("1e20", base * 1e20), ("fp64 1e-12 apart", 1.0 + base * 1e-12)):
        _, aux = F.tpo_loss(logits, labels, scores.to(device), group_size=4, backend=backend, return_aux=True,
                            score_eps=0.0)
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
