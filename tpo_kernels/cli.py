"""Command line: ``tpo-kernels {status,demo,bench}`` (also ``python -m tpo_kernels ...``).

* ``status``: which backends run here, and why the others do not.
* ``demo``:   a tiny end-to-end TPO step (loss, p, q, backward) on whatever device is present,
  checked against the plain-PyTorch reference; takes seconds.
* ``bench``:  the benchmark harness, ``tpo_kernels.bench``; all further arguments go to it
  (``tpo-kernels bench --help``).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _status(args) -> int:
    import torch

    import tpo_kernels

    print(f"tpo_kernels {tpo_kernels.__version__} (torch {torch.__version__}", end="")
    try:
        import triton

        print(f", triton {triton.__version__}", end="")
    except Exception:
        print(", triton not installed", end="")
    cuda = torch.cuda.is_available()
    print(f"; CUDA device: {torch.cuda.get_device_name(0) if cuda else 'none'})")
    status = tpo_kernels.backend_status()
    width = max(len(n) for n in status)
    for name, state in status.items():
        print(f"  {name:{width}s}  {state}")
    try:
        from tpo_kernels.backends import get_backend

        picks = [f"CPU tensors -> {get_backend('auto', torch.device('cpu')).name}"]
        if cuda:
            picks.append(f"CUDA tensors -> {get_backend('auto', torch.device('cuda')).name}")
        print("backend='auto': " + "; ".join(picks))
    except Exception as exc:  # pragma: no cover - informative only
        print(f"backend='auto': could not resolve ({exc})")
    return 0


def _demo(args) -> int:
    import torch

    import tpo_kernels
    from tpo_kernels import reference

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    groups, k, t, v = 2, 4, 6, 50
    n = groups * k
    logits = torch.randn(n, t, v, device=device)
    labels = torch.randint(0, v, (n, t), device=device)
    # group 0: distinct rewards; group 1: every completion scored the same (a zero-signal group)
    scores = torch.cat([torch.tensor([1.0, 0.0, 0.5, 0.0]), torch.full((k,), 1.0)]).to(device)
    print(f"TPO demo on {device}: {groups} groups x {k} completions x {t} tokens, vocab {v}, backend={args.backend!r}")
    print(f"scores: {scores.view(groups, k).tolist()}  (group 1 ties: its targets equal p, so it gets no gradient)")

    x = logits.clone().requires_grad_(True)
    loss, aux = tpo_kernels.tpo_loss(x, labels, scores, group_size=k, backend=args.backend, return_aux=True)
    loss.backward()

    x_ref = logits.double().cpu().requires_grad_(True)
    ref_loss, ref_aux = reference.tpo_loss(x_ref, labels.cpu(), scores.double().cpu(), group_size=k, return_aux=True)
    ref_loss.backward()

    def row(name, values):
        return f"  {name:6s}" + "  ".join(" ".join(f"{float(x):7.4f}" for x in g) + " |" for g in values.view(groups, k).cpu())

    print(f"loss   {float(loss.detach()):.6f}   (reference {float(ref_loss.detach()):.6f})")
    print(row("u", aux["u"]))
    print(row("p", aux["p"]))
    print(row("q", aux["q"]))
    print(row("p - q", aux["p"] - aux["q"]))
    grad = x.grad.double().cpu()
    loss_err = abs(float(loss.detach()) - float(ref_loss.detach()))
    grad_err = float((grad - x_ref.grad).abs().max())
    pq_err = max(float((aux["p"].double().cpu() - ref_aux["p"]).abs().max()), float((aux["q"].double().cpu() - ref_aux["q"]).abs().max()))
    tied_grad = float(grad[k:].abs().max())
    print(f"max |grad| on the tied group's logits: {tied_grad:.1e}")
    ok = loss_err < 1e-5 and grad_err < 1e-6 and pq_err < 1e-5 and tied_grad == 0.0
    print(
        f"check vs tpo_kernels.reference (float64): |loss diff| {loss_err:.1e}, max |p,q diff| {pq_err:.1e}, "
        f"max |grad diff| {grad_err:.1e} -> {'OK' if ok else 'MISMATCH'}"
    )
    return 0 if ok else 1


def _bench(argv: List[str]) -> int:
    from tpo_kernels.bench.run import main as bench_main

    return bench_main(argv)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # everything after "bench" belongs to the harness
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="tpo-kernels", description="Target Policy Optimization (TPO) loss kernels.")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("status", help="which backends run here")
    demo = sub.add_parser("demo", help="a tiny end-to-end TPO step checked against the reference (seconds)")
    demo.add_argument("--device", help="cpu or cuda (default: cuda if present)")
    demo.add_argument("--backend", default="auto", help="auto, torch, cpu, triton, cuda")
    demo.add_argument("--seed", type=int, default=0)
    sub.add_parser("bench", help="benchmarks against eager PyTorch and other baselines (tpo-kernels bench --help)")
    args = parser.parse_args(argv)
    if args.command == "status":
        return _status(args)
    if args.command == "demo":
        return _demo(args)
    parser.print_help()
    return 0 if args.command is None and not argv else 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
