"""The report table, the verdict, and the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Sequence, Tuple
from .parse import DEFAULT_ARCHS, DEFAULT_DTYPES, DEFAULT_VOCABS, OPS, KernelRow, ReportError, op_of_kernel
from .tools import triton_tool
from .triton import _triton_worker, run_triton_workers
from .cuda import collect_cuda
from .progress import PROGRESS_EVERY_S, Progress


# --------------------------------------------------------------------------- the table


def _widths(counts: Dict[int, int]) -> str:
    return " ".join(f"{w}x{n}" for w, n in sorted(counts.items(), key=lambda kv: -kv[0])) or "-"


def _spill_text(row: KernelRow) -> str:
    if not row.spilled:
        return "0"
    if row.spill_stores is not None:  # ptxas -v: exact spill traffic
        text = f"st {row.spill_stores}B ld {row.spill_loads}B"
    else:  # cuobjdump: the local-memory frame
        text = f"{row.spill_bytes}B local"
    text += f" {row.local_insts} LDL/STL" if row.local_insts else ""
    return text + (f" (known, {row.known})" if row.known else "" if row.fails else " (fp64)")


def _per_element_text(row: KernelRow) -> str:
    return "/".join(f"{x:.2f}" for x in row.loop_insts_per_element) or "-"


def format_table(rows: Sequence[KernelRow]) -> str:
    header = ("kernel", "arch", "dtype", "specialization", "regs", "spill", "smem", "loads (bits x LDG)", "stores (STG)",
              "insts/elem", "launched for")
    lines = []
    for r in rows:
        smem = f"{r.smem_static}+{r.smem_dynamic}" if r.smem_dynamic else str(r.smem_static)
        lines.append((r.kernel, r.arch, r.dtype, r.spec, str(r.regs), _spill_text(r), smem, _widths(r.loads),
                      _widths(r.stores), _per_element_text(r), "; ".join(r.used_by)))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    widths[-1] = 0  # the last column is not padded
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    out = [fmt.format(*header).rstrip(), fmt.format(*("-" * max(w, 3) for w in widths)).rstrip()]
    out += [fmt.format(*line).rstrip() for line in lines]
    return "\n".join(out)


def verdict(rows: Sequence[KernelRow]) -> Tuple[int, str]:
    """``(exit status, text)``: 1 when a fp32/bf16/fp16 (or unknown-dtype) kernel spills."""
    failing = [r for r in rows if r.fails]
    known = [r for r in rows if r.known]
    fp64 = [r for r in rows if r.spilled and not r.fails and not r.known]
    text = [f"{len(rows)} kernel specializations checked ({sum(r.source == 'triton' for r in rows)} Triton, "
            f"{sum(r.source == 'cuda' for r in rows)} CUDA)."]
    if known:
        text.append("Known local memory of one Triton release's code generation (reported, allowed; see "
                    "KNOWN_TRITON_LOCAL_MEMORY):")
        text += [f"  {r.kernel} {r.arch} {r.dtype} {r.spec}: {_spill_text(r)}" for r in known]
    if fp64:
        text.append("fp64 kernels with local memory (reported, allowed): "
                    + ", ".join(sorted({f'{r.kernel} {r.spec} {r.arch}'.replace('  ', ' ') for r in fp64})))
    if failing:
        text.append("SPILLS in fp32/bf16/fp16 kernels (fails):")
        text += [f"  {r.source} {r.kernel} {r.arch} {r.dtype} {r.spec}: {_spill_text(r)}" for r in failing]
        return 1, "\n".join(text)
    text.append("No spills in fp32, bf16 or fp16 kernels" + (" beyond the known local memory above." if known else "."))
    return 0, "\n".join(text)


# --------------------------------------------------------------------------- command line


def _csv(text: str) -> List[str]:
    return [p.strip() for p in str(text).replace(";", ",").split(",") if p.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.kernel_report", description="Registers, spills, shared memory and load widths of every kernel, without a GPU",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default=",".join(DEFAULT_ARCHS), help="compute capabilities, e.g. 80,90 (default)")
    p.add_argument("--vocab", default=",".join(map(str, DEFAULT_VOCABS)), help="vocabularies of the Triton calls")
    p.add_argument("--dtype", default=",".join(DEFAULT_DTYPES), help="dtypes of the Triton calls")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size of the candidate-linear calls")
    p.add_argument("--ops", default=",".join(OPS), help="which kernels, by the op they serve: row, candidate, group "
                   "(comma-separated; default all), e.g. --ops row for the row kernels alone")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--triton-only", action="store_true")
    which.add_argument("--cuda-only", action="store_true")
    p.add_argument("--cuda-from-source", action="store_true", help="compile csrc/cuda even when a built extension exists")
    p.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)), help="parallel nvcc runs")
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--progress-every", type=float, default=PROGRESS_EVERY_S, metavar="SECONDS",
                   help="seconds between the progress lines printed to stderr while the kernels compile")
    p.add_argument("--triton-worker", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.vocab = [int(v) for v in _csv(args.vocab)]
    args.dtype = _csv(args.dtype)
    unknown = [d for d in args.dtype if d not in DEFAULT_DTYPES]
    if unknown:
        print(f"kernel_report: unknown dtype(s) {unknown}; use {','.join(DEFAULT_DTYPES)}", file=sys.stderr)
        return 2
    args.ops = _csv(args.ops)
    unknown = [o for o in args.ops if o not in OPS]
    if unknown or not args.ops:
        print(f"kernel_report: unknown op(s) {unknown or args.ops}; use {','.join(OPS)}", file=sys.stderr)
        return 2
    if args.triton_worker:
        return _triton_worker(args)
    if not args.progress_every > 0:
        print(f"kernel_report: --progress-every must be a positive number of seconds, got {args.progress_every}",
              file=sys.stderr)
        return 2
    archs = [a.replace("sm_", "").replace(".", "") for a in _csv(args.arch)]
    t0 = time.perf_counter()
    rows: List[KernelRow] = []
    notes: List[str] = []
    try:
        import concurrent.futures

        cuda_rows: List[KernelRow] = []
        with Progress(args.progress_every) as progress, \
                concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            triton_future = None
            if not args.cuda_only:  # Triton workers (one process per arch) run beside the CUDA part
                import triton

                notes.append(f"Triton {triton.__version__}: kernels compiled as the launchers specialize them "
                             f"(ops {','.join(args.ops)}, V in {args.vocab}, dtypes {','.join(args.dtype)}, H={args.hidden}); ptxas "
                             f"{triton_tool('ptxas') or '(Triton default)'}")
                progress.update("Triton", "starting the workers")
                triton_future = pool.submit(run_triton_workers, archs, args, lambda text: progress.update("Triton", text))
            if not args.triton_only:
                progress.update("CUDA", "looking for the built extension and the tools")
                cuda_rows, cuda_notes = collect_cuda(archs, from_source=args.cuda_from_source, jobs=args.jobs,
                                                     progress=lambda text: progress.update("CUDA", text))
                progress.finish("CUDA")
                notes += cuda_notes
            if triton_future is not None:
                rows += triton_future.result()
                progress.finish("Triton")
        rows += [r for r in cuda_rows if op_of_kernel(r.kernel) in args.ops]
    except ReportError as exc:
        print(f"kernel_report: {exc}", file=sys.stderr)
        return 2
    print(f"tpo_kernels kernel report: {', '.join('sm_' + a for a in archs)}, no GPU needed ({time.perf_counter() - t0:.0f} s)")
    for note in notes:
        print(f"  {note}")
    for source in ("triton", "cuda"):
        part = [r for r in rows if r.source == source]
        if part:
            print(f"\n{'Triton' if source == 'triton' else 'CUDA'} kernels\n")
            print(format_table(part))
    status, text = verdict(rows)
    print("\n" + text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"archs": archs, "notes": notes, "status": status, "rows": [r.to_json() for r in rows]}, f, indent=1)
    return status

