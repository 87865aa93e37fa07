"""Worst errors of every public path at the numerical edges (large logit offsets, confident
tokens, extreme temperatures, long sequences), against float64.

Run from the repository root: ``TRITON_INTERPRET=1 python bench/precision_edges.py [--json out]``.
It uses the public API only, so the same script measures the code before and after a change.
Each line: case, backend/path, worst error (NaN or an exception is reported as such), and the
same error for plain fp32 PyTorch where that is a meaningful baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
# The fp32-head case times matmul-heavy steps on a shared machine: OpenMP threads that spin after a
# matmul would starve the small ops between them (bench.compare's children run the same way).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# This checkout's package, not whatever tpo_kernels is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import tpo_kernels as tk  # noqa: E402
from tpo_kernels import reference  # noqa: E402

BACKENDS = [b for b, s in tk.backend_status().items() if s == "available"]
RESULTS = []


def err(a, b, rel=False):
    a, b = a.double(), b.double()
    if torch.isnan(a).any() and not torch.isnan(b).any():
        return float("nan")
    diff = torch.where(a == b, 0.0, (a - b).abs())  # equal infinities are exact
    if rel:
        diff = diff / b.abs().clamp_min(1e-300)
    return float(diff.max()) if diff.numel() else 0.0


def record(case, where, value, baseline=None):
    detail = ""
    if isinstance(value, dict):  # several named errors: the worst is the case's error
        detail = "  [" + ", ".join(f"{k} {v:.1e}" for k, v in value.items()) + "]"
        parts, value = value, max(value.values(), key=lambda x: float("inf") if math.isnan(x) else x)
    RESULTS.append(dict(case=case, where=where, error=value, torch_fp32=baseline, detail=detail))
    base = "" if baseline is None else f"   (plain fp32 torch {baseline:.2e})"
    shown = value if isinstance(value, str) else f"{value:.2e}"
    print(f"{case:44s} {where:15s} {shown}{detail}{base}", flush=True)


def guarded(case, where, fn, baseline=None):
    try:
        record(case, where, fn(), baseline)
    except Exception as exc:  # report, keep going
        record(case, where, f"{type(exc).__name__}: {str(exc)[:70]}", baseline)


def small(backend):
    return backend == "triton"  # the interpreter is slow: tiny shapes only


# ----------------------------------------------------------------------------- row paths


def logits_path(logits, labels, backend, temperature=1.0, entropy=True, w_ent=1.0):
    x = logits.detach().clone().requires_grad_(True)
    out = tk.selective_logprobs(x, labels, temperature=temperature, return_entropy=entropy, backend=backend)
    lp, ent = out if entropy else (out, None)
    obj = lp.sum() + (w_ent * ent.sum() if entropy else 0)
    (g,) = torch.autograd.grad(obj, x)
    return lp.detach(), None if ent is None else ent.detach(), g


def linear_path(logits, labels, backend, temperature=1.0, entropy=True, w_ent=1.0, chunk_size=1):
    """The fused-linear path on the same logits: hidden = logits rows, weight = identity, so
    dL/dhidden = dL/dlogits; chunk_size=1 cuts the vocabulary into blocks of V/M."""
    m, v = logits.shape
    h = logits.detach().clone().requires_grad_(True)
    w = torch.eye(v, dtype=logits.dtype)
    out = tk.fused_linear_logprobs(h, w, labels, temperature=temperature, return_entropy=entropy,
                                   backend=backend, chunk_size=chunk_size)
    lp, ent = out if entropy else (out, None)
    obj = lp.sum() + (w_ent * ent.sum() if entropy else 0)
    (g,) = torch.autograd.grad(obj, h)
    return lp.detach(), None if ent is None else ent.detach(), g


def ref_path(logits, labels, temperature=1.0, w_ent=1.0):
    x = logits.detach().double().requires_grad_(True)
    lsm = torch.log_softmax(x / temperature, dim=-1)
    lp = lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    probs = lsm.exp()
    ent = -(probs * torch.where(probs > 0, lsm, 0.0)).sum(-1)  # 0 log 0 = 0 at -inf logits
    (g,) = torch.autograd.grad(lp.sum() + w_ent * ent.sum(), x)
    return lp.detach(), ent.detach(), g


def torch_fp32(logits, labels, temperature=1.0):
    x = logits.detach().float().requires_grad_(True)
    lsm = torch.log_softmax(x / temperature, dim=-1)
    lp = lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    probs = lsm.exp()
    ent = -(probs * torch.where(probs > 0, lsm, 0.0)).sum(-1)
    (g,) = torch.autograd.grad(lp.sum() + ent.sum(), x)
    return lp.detach(), ent.detach(), g


def paths(backend):
    return (("logits", logits_path), ("linear", linear_path))


def case_masked_entropy():
    torch.manual_seed(1)
    v = 64
    logits = torch.randn(4, v) * 2
    logits[0, 10:30] = float("-inf")        # some masked entries
    logits[1, 32:] = float("-inf")          # a whole second half (a vocabulary block) masked
    logits[2, :] = float("-inf")
    logits[2, 5] = 0.7                      # only the label is finite
    logits[3, ::2] = float("-inf")
    labels = torch.tensor([3, 1, 5, 7])
    r_lp, r_ent, r_g = ref_path(logits, labels)
    t_lp, t_ent, t_g = torch_fp32(logits, labels)
    base = max(err(t_ent, r_ent), err(t_g, r_g))
    for b in BACKENDS:
        # Logits path only: -inf hidden states times an identity head give NaN (-inf * 0) in the
        # matmul itself; the fused-linear path gets its -inf from a bias in the next case.
        def run():
            lp, ent, g = logits_path(logits, labels, b)
            return dict(lp=err(lp, r_lp), H=err(ent, r_ent), grad=err(g, r_g))
        guarded("1 masked(-inf) vocab: lp,H,grad", f"{b}/logits", run, base)


def case_masked_block_fused():
    """A bias of -inf over a vocabulary range, through hidden @ W.T + b, several vocab blocks."""
    torch.manual_seed(2)
    m, hdim, v = 4, 16, 256
    h = torch.randn(m, hdim)
    w = torch.randn(v, hdim) * 0.3
    bias = torch.zeros(v)
    bias[64:160] = float("-inf")
    labels = torch.tensor([1, 2, 200, 255])
    logits = h @ w.T + bias
    r_lp, r_ent, _ = ref_path(logits, labels)
    for b in BACKENDS:
        def run():
            hh = h.clone().requires_grad_(True)
            lp, ent = tk.fused_linear_logprobs(hh, w, labels, bias=bias, return_entropy=True, backend=b, chunk_size=1)
            (g,) = torch.autograd.grad(lp.sum() + ent.sum(), hh)
            bad = 0.0 if torch.isfinite(g).all() else float("nan")
            return dict(lp=err(lp, r_lp), H=err(ent, r_ent), grad_finite=bad)
        guarded("1 -inf bias over vocab blocks: lp,H", f"{b}/linear", run)


def case_entropy_offsets():
    for center in (60.0, 1e3):
        for temperature in (0.3, 1.0):
            torch.manual_seed(3)
            v = 256
            logits = center + 8 * torch.randn(4, v)
            labels = torch.randint(0, v, (4,))
            _, r_ent, _ = ref_path(logits, labels, temperature)
            _, t_ent, _ = torch_fp32(logits, labels, temperature)
            for b in BACKENDS:
                for name, fn in paths(b):
                    def run():
                        _, ent, _ = fn(logits, labels, b, temperature=temperature)
                        return err(ent, r_ent)
                    guarded(f"1b entropy logits {center:g}+-8 T={temperature}", f"{b}/{name}", run, err(t_ent, r_ent))


def confident_logits(one_minus_p, v=64):
    """One row whose label (id 0) has probability 1 - one_minus_p; the rest share one_minus_p."""
    big = math.log((v - 1) * (1 - one_minus_p) / one_minus_p)
    logits = torch.zeros(1, v)
    logits[0, 0] = big
    return logits, torch.tensor([0])


def case_confident():
    for k in range(3, 8):
        eps = 10.0 ** (-k)
        logits, labels = confident_logits(eps)
        x = logits.double().requires_grad_(True)
        lp = torch.log_softmax(x, -1)[0, 0]
        (r_g,) = torch.autograd.grad(lp, x)
        xf = logits.clone().requires_grad_(True)
        (t_g,) = torch.autograd.grad(torch.log_softmax(xf, -1)[0, 0], xf)
        base = abs(float(t_g[0, 0]) - float(r_g[0, 0])) / float(r_g[0, 0])
        for b in BACKENDS:
            for name, fn in paths(b):
                def run():
                    _, _, g = fn(logits, labels, b, entropy=False)
                    rel = abs(float(g[0, 0]) - float(r_g[0, 0])) / float(r_g[0, 0])
                    row_sum = abs(float(g[0].double().sum()))  # exact: 0
                    return dict(dz_y=rel, row_sum=row_sum / float(r_g[0, 0]))
                guarded(f"2 confident 1-p=1e-{k}: rel err dz_y,sum", f"{b}/{name}", run, base)


def case_offsets():
    torch.manual_seed(4)
    for label, make in (("3e4+N(0,2)", lambda m, v: 3e4 + 2 * torch.randn(m, v)),
                        ("+-1e4 uniform", lambda m, v: (torch.rand(m, v) * 2 - 1) * 1e4),
                        ("N(0,1)*1e4", lambda m, v: torch.randn(m, v) * 1e4)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            m, v = 8, 1000
            logits = make(m, v).to(dtype)
            if not torch.isfinite(logits).all():
                continue
            labels = torch.randint(0, v, (m,))
            r_lp, _, r_g = ref_path(logits, labels, w_ent=0.0)
            scale = r_lp.abs().clamp_min(1.0)
            t_lp, _, _ = torch_fp32(logits, labels)
            base = float(((t_lp.double() - r_lp).abs() / scale).max())
            for b in BACKENDS:
                for name, fn in paths(b):
                    def run():
                        lp, _, g = fn(logits, labels, b, entropy=False)
                        return dict(lp=float(((lp.double() - r_lp).abs() / scale).max()), grad=err(g.float(), r_g))
                    guarded(f"2 logits {label} {str(dtype)[6:]}: lp(rel>1),grad", f"{b}/{name}", run, base)


# ----------------------------------------------------------------------------- group stage


def case_long_completions():
    torch.manual_seed(5)
    for t in (16384, 32768):
        n, v = 4, 16
        # Four copies of one completion with a few labels changed: ell ~ -T * 2.8 for every
        # member, differences O(1), so p is far from one-hot and the fp32 sums show.
        logits = (torch.randn(1, t, v) * 2).expand(n, t, v).contiguous()
        labels = torch.randint(0, v, (1, t)).expand(n, t).contiguous()
        labels[1:, :3] = torch.randint(0, v, (n - 1, 3))
        scores = torch.tensor([1.0, 0.0, 0.5, 0.25])
        _, r_aux = reference.tpo_loss(logits.double(), labels, scores.double(), group_size=n, return_aux=True)
        for b in BACKENDS:
            if small(b):
                continue
            def run():
                _, aux = tk.tpo_loss(logits, labels, scores, group_size=n, backend=b, return_aux=True)
                return dict(p=err(aux["p"], r_aux["p"]), q=err(aux["q"], r_aux["q"]))
            guarded(f"3 T={t} completions: p,q", f"{b}/logits", run)
        # The group op alone on the package's own fp32 token log-probs vs their float64 sum.
        tok = tk.selective_logprobs(logits, labels, backend="cpu" if "cpu" in BACKENDS else "torch")
        ell64 = tok.double().sum(1)
        p64 = torch.softmax(ell64, 0)
        for b in BACKENDS:
            def run_group():
                from tpo_kernels.backends import get_backend
                from tpo_kernels.group_math import build_layout
                layout = build_layout(n * t, torch.device("cpu"), padded_shape=(n, t), cu_seqlens=None,
                                      group_size=n, group_ids=None)
                res = get_backend(b, torch.device("cpu")).group_targets(
                    tok.reshape(-1), layout, scores, old_seq_logprobs=None, eta=1.0, anchor=True)
                return err(res.p, p64)
            guarded(f"3 T={t} group op alone: p", f"{b}/group", run_group)


def case_neg_inf_label():
    torch.manual_seed(6)
    n, t, v = 4, 3, 11
    logits = torch.randn(n, t, v)
    labels = torch.randint(0, v, (n, t))
    logits[1, 0, labels[1, 0]] = float("-inf")
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25])
    for b in BACKENDS:
        def run():
            x = logits.clone().requires_grad_(True)
            loss = tk.tpo_loss(x, labels, scores, group_size=n, backend=b)
            loss.backward()
            bad = 0.0 if torch.isfinite(x.grad).all() else float("nan")
            return max(0.0 if torch.isfinite(loss) else float("nan"), bad)
        guarded("4 on-policy -inf label logit: loss", f"{b}/logits", run)
        def run_token():
            x = torch.randn(3, v)
            cand = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
            x[0, 1] = float("-inf")
            loss = tk.token_tpo_loss(x, cand, torch.randn(3, 3), backend=b)
            return 0.0 if torch.isfinite(loss) else float("nan")
        guarded("4 on-policy -inf candidate logit: loss", f"{b}/token", run_token)


def exact_standardize(scores):
    """u of float64 scores with exact rational mean and variance (only the sqrt rounds)."""
    from fractions import Fraction
    vals = [Fraction(float(v)) for v in scores]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    std = math.sqrt(var.numerator) / math.sqrt(var.denominator)
    return torch.tensor([float((v - mean) / Fraction(std)) for v in vals], dtype=torch.float64)


def case_score_spread():
    torch.manual_seed(7)
    n, t, v = 4, 3, 11
    logits = torch.randn(n, t, v)
    labels = torch.randint(0, v, (n, t))
    base = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    for name, scores in (("spread 1e-25", base * 1e-25), ("spread 1e-30 fp32", (base * 1e-30).float()),
                         ("spread 1e20", base * 1e20), ("spread 1e30 fp32", (base * 1e30).float()),
                         ("fp64 below fp32 res", 1.0 + base * 1e-12)):
        ref_u = exact_standardize(scores.double())
        for b in BACKENDS:
            def run():
                x = logits.clone().requires_grad_(True)
                loss, aux = tk.tpo_loss(x, labels, scores, group_size=n, backend=b, return_aux=True)
                loss.backward()
                bad = 0.0 if torch.isfinite(loss) and torch.isfinite(x.grad).all() else float("nan")
                return max(err(aux["u"], ref_u), bad)
            guarded(f"5 scores {name}: u", f"{b}/logits", run)


def case_tiny_hyper():
    n, t, v = 4, 3, 11
    logits = torch.randn(n, t, v)
    labels = torch.randint(0, v, (n, t))
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25])
    for kw in (dict(eta=1e-300), dict(eta=1e-320), dict(temperature=1e-300), dict(temperature=1e-320)):
        for b in BACKENDS:
            def run():
                loss = tk.tpo_loss(logits, labels, scores, group_size=n, backend=b, **kw)
                return "returned " + str(float(loss))
            guarded(f"6 {kw}", f"{b}/logits", run)


def case_meta():
    x = torch.randn(4, 3, 11, device="meta")
    y = torch.zeros(4, 3, dtype=torch.long, device="meta")
    s = torch.zeros(4, device="meta")
    for name, fn in (("tpo_loss", lambda: tk.tpo_loss(x, y, s, group_size=2)),
                     ("selective_logprobs", lambda: tk.selective_logprobs(x, y)),
                     ("token_tpo_loss", lambda: tk.token_tpo_loss(x[0], y[0, :, None].expand(3, 2), s[:6].view(3, 2) if False else torch.zeros(3, 2, device="meta")))):
        guarded(f"7 meta inputs {name}", "auto", lambda: "returned " + str(fn().shape))


def case_numpy_scalars():
    import numpy as np
    n, t, v = 4, 3, 11
    logits = torch.randn(n, t, v)
    labels = torch.randint(0, v, (n, t))
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25])
    for kw in (dict(group_size=np.int64(2)), dict(group_size=2, eta=np.float32(0.5)),
               dict(group_size=2, temperature=np.float32(0.7)), dict(group_size=2, beta=np.float32(0.0))):
        guarded(f"api numpy scalar {list(kw.items())[-1][0]}", "auto",
                lambda: "ok " + f"{float(tk.tpo_loss(logits, labels, scores, **kw)):.4f}")


FP32_HEAD_SHAPE = dict(M=4096, H=512, V=32768)  # --fp32-head-shape M,H,V
FP32_HEAD_ROUNDS = 3


def _fp32_head_batch(m, h, v, seed=0):
    """A bf16 head and batch with realistic logits: a bulk of std ~3 and each token's label raised
    by 5..22 (confident tokens; the largest logits ~25), as a trained LM gives."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(v, h, generator=g) * (3 / math.sqrt(h))
    labels = torch.randint(0, v, (m,), generator=g)
    hidden = torch.randn(m, h, generator=g)
    boost = 5 + 17 * torch.rand(m, generator=g)
    rows = weight[labels]
    hidden += rows * (boost / rows.pow(2).sum(1)).unsqueeze(1)
    return hidden.bfloat16(), weight.bfloat16(), labels


def _float64_logprobs(hidden, weight, labels, rows=256):
    out = torch.empty(labels.shape[0], dtype=torch.float64)
    w = weight.double()
    for start in range(0, labels.shape[0], rows):
        z = hidden[start:start + rows].double() @ w.t()
        out[start:start + rows] = torch.log_softmax(z, -1).gather(1, labels[start:start + rows, None]).squeeze(1)
    return out


def _head_logprobs(hidden, weight, labels, backend, head_dtype):
    """The fused head's log-probs: ``head_dtype=`` of the public function where it takes one, else
    the ops layer's ``HeadTiles.head_dtype`` (the same op)."""
    try:
        return tk.fused_linear_logprobs(hidden, weight, labels, backend=backend, head_dtype=head_dtype)
    except TypeError:
        from tpo_kernels.ops import HeadTiles, RowRequest, TilePolicy, linear_logprobs
        policy = TilePolicy.for_device(hidden.device)
        tiles = HeadTiles(chunk_size=policy.chunk_size(hidden.shape[0], weight.shape[0]), policy=policy,
                          grad_accum_dtype=torch.float32, head_dtype=head_dtype)
        return linear_logprobs(hidden, weight, None, labels, request=RowRequest(), tiles=tiles,
                               backend=backend).label_logprob


def case_fp32_head():
    """bf16 hidden states and weight: max and mean |log-prob - float64| with the logits formed in
    bf16 (as a bf16 matmul gives them) and in fp32 (``head_dtype=torch.float32``), and the time of a
    forward and backward with the fp32 head over the bf16 one (median of interleaved rounds)."""
    m, h, v = FP32_HEAD_SHAPE["M"], FP32_HEAD_SHAPE["H"], FP32_HEAD_SHAPE["V"]
    hidden, weight, labels = _fp32_head_batch(m, h, v)
    exact = _float64_logprobs(hidden, weight, labels)
    case = f"fp32 head, bf16 M={m} H={h} V={v}"
    for b in [b for b in BACKENDS if b in ("cpu", "torch", "cuda", "triton") and not b.startswith("triton")]:
        for name, head_dtype in (("bf16 logits", None), ("fp32 head", torch.float32)):
            def run():
                with torch.no_grad():
                    lp = _head_logprobs(hidden, weight, labels, b, head_dtype).double()
                diff = (lp - exact).abs()
                return {"max": float(diff.max()), "mean": float(diff.mean())}
            guarded(f"{case}: {name}", f"{b}/linear", run)
        # bf16 head; fp32 head; the route without it: an fp32 copy of the weight (TRL's
        # cast_lm_head_to_fp32), bf16 hidden states, the copy's time included.
        variants = {"bf16": (None, False), "fp32 head": (torch.float32, False), "fp32 weight": (None, True)}
        times = {name: [] for name in variants}
        upstream = torch.randn(m)
        for r in range(FP32_HEAD_ROUNDS + 1):  # the first round warms up, untimed
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                head_dtype, cast_weight = variants[name]
                hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                t = time.perf_counter()
                torch.autograd.backward(_head_logprobs(hh, ww.float() if cast_weight else ww, labels, b, head_dtype),
                                        upstream)
                if r:
                    times[name].append(time.perf_counter() - t)
        for name in ("fp32 head", "fp32 weight"):
            ratios = sorted(a / c for a, c in zip(times[name], times["bf16"]))
            record(f"{case}: time {name} / bf16 (fwd+bwd)", f"{b}/linear",
                   f"{ratios[len(ratios) // 2]:.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios)}; bf16 "
                   f"{sorted(times['bf16'])[len(ratios) // 2]:.2f} s, {torch.get_num_threads()} threads)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--only", default="")
    parser.add_argument("--fp32-head-shape", default=None, help="M,H,V of the fp32-head case (default 4096,512,32768)")
    parser.add_argument("--fp32-head-rounds", type=int, default=3, help="timed rounds of the fp32-head case")
    args = parser.parse_args()
    global FP32_HEAD_ROUNDS
    FP32_HEAD_ROUNDS = args.fp32_head_rounds
    if args.fp32_head_shape:
        FP32_HEAD_SHAPE.update(zip("MHV", (int(x) for x in args.fp32_head_shape.split(","))))
    print(f"tpo_kernels from {os.path.dirname(tk.__file__)}; backends: {BACKENDS}")
    start = time.time()
    for fn in (case_masked_entropy, case_masked_block_fused, case_entropy_offsets, case_confident, case_offsets,
               case_long_completions, case_neg_inf_label, case_score_spread, case_tiny_hyper, case_meta,
               case_numpy_scalars, case_fp32_head):
        if args.only and args.only not in fn.__name__:
            continue
        fn()
    print(f"{time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
