"""Command line: ``tpo-kernels {status,demo,bench,check}`` (also ``python -m tpo_kernels ...``).

* ``status``: which backends run here, and why the others do not.
* ``check``:  numerical self-check of every backend and path on this device, dtype and shapes
  (:mod:`tpo_kernels.selfcheck`): progress as it goes, a table of errors against tolerances, JSON
  on request; exit status 1 on a numerical failure, 2 on a usage error.
* ``demo``:   a tiny end-to-end TPO step (loss, p, q, backward) on whatever device is present,
  checked against the plain-PyTorch reference; takes seconds.
* ``bench``:  the benchmark harness, ``tpo_kernels.bench``; all further arguments go to it
  (``tpo-kernels bench --help``).

Parsing and ``--help`` import nothing heavy: torch is imported by the subcommand that runs.

Usage errors (a bad option or value, a device or backend that is not there, an output path that
cannot be written) are found before any work and end the command with one line on stderr,
``tpo-kernels <command>: error: ...``, and exit status 2: :class:`tpo_kernels.usage.UsageError`,
also raised by the parsers (:class:`tpo_kernels.usage.OneLineParser`). ``bench`` shares them
through that leaf module and never imports this one: the imports run one way, cli -> bench.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from .usage import OneLineParser, UsageError, writable_file_problem


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

    from tpo_kernels.backends import get_backend

    from tpo_kernels.bench.plan import resolve_device

    device = resolve_device(args.device, prog="tpo-kernels demo")
    try:
        get_backend(args.backend, device)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise UsageError(f"--backend: {exc}", "tpo-kernels demo") from None
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


# check()'s arguments as ``tpo-kernels check`` spells them
_CHECK_OPTIONS = {name: f"-{name}" for name in "NKTVH"}


def _check(args) -> int:
    prog = "tpo-kernels check"
    if args.json and args.json != "-":
        problem = writable_file_problem(args.json)
        if problem:
            raise UsageError(f"--json: {problem}", prog)
    from tpo_kernels import selfcheck

    def split(value):
        return [x.strip() for x in value.split(",") if x.strip()] if value else None

    try:
        checked = selfcheck.check_arguments(
            device=args.device, dtype=args.dtype, backends=split(args.backends), paths=split(args.paths), N=args.N,
            K=args.K, T=args.T, V=args.V, H=args.H, temperature=args.temperature, eta=args.eta,
            logit_scale=args.logit_scale, logit_softcap=args.logit_softcap, long_tokens=args.long_tokens,
            seed=args.seed)
    except selfcheck.ArgumentError as exc:
        option = _CHECK_OPTIONS.get(exc.argument, "--" + exc.argument.replace("_", "-"))
        raise UsageError(f"{option}: {exc}", prog) from None

    def progress(line):  # stderr: stdout carries the table (or the JSON with --json -)
        print(line, file=sys.stderr, flush=True)

    # check() prints a line at least every PROGRESS_INTERVAL_S seconds (selfcheck.heartbeat)
    report = selfcheck.check(
        device=checked.device, dtype=checked.dtype, backends=checked.backends, paths=checked.paths, N=checked.N,
        K=checked.K, T=checked.T, V=checked.V, H=checked.H, temperature=checked.temperature, eta=checked.eta,
        logit_scale=checked.logit_scale, logit_softcap=checked.logit_softcap, gradcheck=not args.no_gradcheck,
        edge_cases=not args.no_edge_cases, long_tokens=checked.long_tokens, seed=checked.seed, progress=progress)
    if args.json == "-":
        print(report.to_json(indent=1))
    else:
        print(report.table())
        if args.json:
            try:
                with open(args.json, "w") as f:
                    f.write(report.to_json(indent=1))
            except OSError as exc:
                print(f"{prog}: error: --json: could not write {args.json}: {exc}", file=sys.stderr)
                return 2
    return 0 if report.passed else 1


def _add_check_parser(sub) -> None:
    chk = sub.add_parser(
        "check", help="numerical self-check of every backend and path here (exit 1 on a failure)",
        description="Numerical self-check: every public function on every backend that runs here, as float64 "
                    "gradcheck, against the float64 reference at your shapes and dtype, and on numerical edge "
                    "cases. Prints progress to stderr and a table to stdout. Exit status: 0 all passed, 1 a "
                    "numerical failure, 2 a usage error.")
    chk.add_argument("--device", help="cpu or cuda (default: cuda if present)")
    chk.add_argument("--dtype", default="float32", help="input dtype: float32, bfloat16, float16, float64")
    chk.add_argument("--backends", help="comma-separated backends (default: every one that runs here)")
    chk.add_argument("--paths", help="comma-separated public functions (default: all seven)")
    chk.add_argument("-N", type=int, default=8, help="completions (default 8)")
    chk.add_argument("-K", type=int, default=4, help="group size, also candidates per state (default 4)")
    chk.add_argument("-T", type=int, default=16, help="tokens per completion (default 16)")
    chk.add_argument("-V", type=int, default=256, help="vocabulary size (default 256)")
    chk.add_argument("-H", type=int, default=64, help="hidden size of the fused-linear paths (default 64)")
    chk.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    chk.add_argument("--eta", type=float, default=0.5, help="TPO target temperature (default 0.5)")
    chk.add_argument("--logit-scale", type=float, default=1.0, help="logit_scale of every path (default 1)")
    chk.add_argument("--logit-softcap", type=float, help="logit_softcap of every path (default: none)")
    chk.add_argument("--no-gradcheck", action="store_true", help="skip the float64 gradcheck section")
    chk.add_argument("--no-edge-cases", action="store_true", help="skip the edge-case section")
    chk.add_argument("--long-tokens", type=int, help="length of the long-completion edge case (default 32768)")
    chk.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH ('-': print JSON only)")
    chk.add_argument("--seed", type=int, default=0)


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``tpo-kernels`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status. A usage
    error prints one line to stderr and raises :class:`UsageError` (SystemExit with status 2)."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except UsageError as exc:
        exc.report()
        raise


def _main(argv: List[str]) -> int:
    if argv and argv[0] == "bench":  # everything after "bench" belongs to the harness
        return _bench(argv[1:])
    parser = OneLineParser(prog="tpo-kernels", description="Target Policy Optimization (TPO) loss kernels.")
    sub = parser.add_subparsers(dest="command")  # subparsers are OneLineParsers too (argparse's default)
    sub.add_parser("status", help="which backends run here")
    demo = sub.add_parser("demo", help="a tiny end-to-end TPO step checked against the reference (seconds)")
    demo.add_argument("--device", help="cpu or cuda (default: cuda if present)")
    demo.add_argument("--backend", default="auto", help="auto, torch, cpu, triton, cuda")
    demo.add_argument("--seed", type=int, default=0)
    sub.add_parser("bench", help="benchmarks against eager PyTorch and other baselines (tpo-kernels bench --help)")
    _add_check_parser(sub)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        prog = "tpo-kernels" + (f" {args.command}" if args.command else "")
        raise UsageError(f"unrecognized arguments: {' '.join(unknown)} (see {prog} --help)", prog)
    if args.command == "check":
        return _check(args)
    if args.command == "status":
        return _status(args)
    if args.command == "demo":
        return _demo(args)
    parser.print_help()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
