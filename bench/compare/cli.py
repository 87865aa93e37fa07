"""``python -m bench.compare BASE``: the command line and the rounds (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from . import child
from .report import SLOWER_THRESHOLD, summarize, table
from .worktree import CompareError, base_worktree, build, resolve_commit, tree_state

REPOSITORY = Path(__file__).resolve().parents[2]  # the current checkout: the head side

# Shapes (N = G * K completions of T tokens, vocabulary V, hidden size H; token-level TPO: N * T
# states with K candidates). "cpu" keeps the default suite under 10 minutes on 2 cores.
SHAPES = {
    "cpu": {"N": 16, "K": 4, "T": 128, "V": 8192, "H": 256},
    "gpu": {"N": 32, "K": 4, "T": 512, "V": 32768, "H": 1024},
    "interp": {"N": 4, "K": 4, "T": 2, "V": 64, "H": 16},  # the Triton interpreter: the launch path only
}
QUICK = {"N": 8, "K": 4, "T": 16, "V": 512, "H": 64}


def _shapes(args) -> Dict[str, dict]:
    shapes = {key: dict(shape) for key, shape in SHAPES.items()}
    if args.quick:
        shapes["cpu"], shapes["gpu"] = dict(QUICK), dict(QUICK)
    for key in ("cpu", "gpu"):
        for dim in ("T", "V"):
            shapes[key][dim] = max(8, int(round(shapes[key][dim] * args.scale)))
        for item in args.shape or []:
            shapes[key].update(item)
    for key, shape in shapes.items():
        if shape["N"] % shape["K"]:
            raise CompareError(f"--shape: N={shape['N']} is not a multiple of K={shape['K']} ({key} shape)")
    return shapes


def _shape_item(text: str) -> dict:
    try:
        pairs = [part.split("=") for part in text.split(",") if part.strip()]
        item = {k.strip().upper(): int(v) for k, v in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants NAME=INT,... (N, K, T, V, H), got {text!r}") from None
    unknown = set(item) - {"N", "K", "T", "V", "H"}
    if unknown or any(v <= 0 for v in item.values()):
        raise argparse.ArgumentTypeError(f"--shape wants positive N, K, T, V, H, got {text!r}")
    return item


def _positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return value
    return parse


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.compare",
        description="Time the public functions of the current checkout (head) against BASE, built in a "
                    "temporary git worktree, in alternating fresh processes.")
    parser.add_argument("base", metavar="BASE", help="any git ref: a commit, branch or tag (HEAD, main, HEAD~3)")
    parser.add_argument("--rounds", type=_positive(int), default=3,
                        help="rounds (one fresh process per side each; default 3)")
    parser.add_argument("--threads", type=_positive(int), default=2,
                        help="torch.set_num_threads in the children (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per case and process (default 1)")
    parser.add_argument("--repeats", type=_positive(int), default=3,
                        help="timed calls per case and process, more for fast cases; the minimum is kept (default 3)")
    parser.add_argument("--quick", action="store_true", help=f"tiny shapes ({QUICK}): a smoke run")
    parser.add_argument("--scale", type=_positive(float), default=1.0, help="multiply T and V (not the interpreter's)")
    parser.add_argument("--shape", type=_shape_item, action="append", help="override dimensions, e.g. N=32,T=256")
    parser.add_argument("--cases", help="comma-separated globs of case names (default: all)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="compare wall-clock times (default) or the processes' CPU times, which waiting "
                             "for a core on a loaded machine does not inflate (both are in --json)")
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto",
                        help="cpu: leave out the GPU cases even where a GPU is present")
    parser.add_argument("--list", action="store_true", help="list the cases and shapes, build and time nothing")
    parser.add_argument("--json", metavar="PATH", help="also write everything measured to PATH")
    args = parser.parse_args(argv)
    args.case_patterns = [p.strip() for p in args.cases.split(",") if p.strip()] if args.cases else None
    return args


def _gpu_present(args) -> bool:
    if args.device == "cpu":
        return False
    import torch  # noqa: PLC0415 - only the device query; the children import their own tpo_kernels

    return torch.cuda.is_available()


def _under(path: str, tree: Path) -> bool:
    return Path(path).resolve().is_relative_to(tree.resolve())


def omp_wait_policy() -> str:
    """OpenMP's wait policy in the timing processes: the caller's OMP_WAIT_POLICY, else PASSIVE. With
    libgomp's default (spin, then sleep) torch's idle OpenMP threads spin between ops and take the
    cores from the cpu backend's own threads: on a 2-core machine at a load of 3 that made the cpu
    backend's calls 1.7 to 6 times slower, and different from process to process (a 1 ms call took
    1 or 17-19 ms by process)."""
    return os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


def _child_env(tree: Path, other: Path, threads: int, gpu: bool) -> Dict[str, str]:
    """The environment of a side's process: its tree first on PYTHONPATH (neither tree elsewhere on it:
    the command is often run with PYTHONPATH=$PWD), the thread count, OpenMP's wait policy, Triton's
    interpreter without a GPU."""
    trees = {tree.resolve(), other.resolve()}
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                 if p and Path(p).resolve() not in trees]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree)] + inherited), "OMP_NUM_THREADS": str(threads),
           "OMP_WAIT_POLICY": omp_wait_policy()}
    if not gpu:
        env["TRITON_INTERPRET"] = "1"  # read at Triton's import: the interpreter cases
    return env


def run_process(side: str, round_index: int, tree: Path, other: Path, config: dict) -> dict:
    """One fresh ``python -c`` of child.py in ``tree``; its record, with side, round and wall time."""
    source = Path(child.__file__).read_text()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", source, json.dumps(config)], cwd=tree, capture_output=True,
                          text=True, env=_child_env(tree, other, config["threads"], config["gpu"]))
    seconds = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(child.RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        record = {"error": f"the process failed (exit {proc.returncode}): {tail}", "cases": {}}
    else:
        record = json.loads(lines[-1][len(child.RESULT_MARKER):])
        record["imported_own_tree"] = _under(record["package_file"], tree)
    record.update(side=side, round=round_index, tree=str(tree), wall_seconds=seconds)
    return record


def _side_lines(side: str, ref: str, tree: Path, state: dict, processes: List[dict]) -> List[str]:
    ran = [p for p in processes if p["side"] == side and "error" not in p]
    dirty = " (uncommitted changes)" if state["dirty"] else ""
    lines = [f"{side}: {ref} = {state['commit'][:12]}{dirty}, tree {tree}"]
    for info in sorted({(p["build_info"]["commit"], p["build_info"]["dirty"], p["package_file"]) for p in ran}):
        stale = "" if info[0] == state["commit"] else \
            f"  [the build info differs from the tree's {state['commit'][:12]}]"
        lines.append(f"  imported tpo_kernels {info[2]}, built from {info[0][:12]}"
                     f"{' (dirty)' if info[1] else ''}{stale}")
    if any(not p["imported_own_tree"] for p in ran):
        lines.append(f"  WARNING: a {side} process imported tpo_kernels from outside its tree")
    for p in processes:
        if p["side"] == side and "error" in p:
            lines.append(f"  round {p['round'] + 1}: {p['error']}")
    pids = [str(p.get("pid", "-")) for p in processes if p["side"] == side]
    threads = sorted({p["threads"] for p in ran})
    lines.append(f"  processes (pid per round): {', '.join(pids)}; torch threads {threads}")
    return lines


def _children_time(processes: List[dict]) -> str:
    """The timing processes' wall and CPU seconds in all: their CPU time divided by the threads is
    about what they would take on an idle machine."""
    wall = sum(p["wall_seconds"] for p in processes)
    cpu = sum(p.get("process_cpu_seconds", 0.0) for p in processes)
    return f"{len(processes)} timing processes: {wall:.0f} s of wall time, {cpu:.0f} s of CPU time"


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        shapes = _shapes(args)
        gpu = _gpu_present(args)
        names = [case[0] for case in child.suite(gpu, args.case_patterns)]
        if not names:
            raise CompareError(f"--cases {args.cases!r} matches no case (see --list)")
        if args.list:
            print("\n".join(names) + f"\nshapes: {json.dumps(shapes)}")
            return 0
        base_commit = resolve_commit(REPOSITORY, args.base)
        head_state = tree_state(REPOSITORY)
    except CompareError as exc:
        print(f"bench.compare: {exc}", file=sys.stderr)
        return 2
    config = {"gpu": gpu, "threads": args.threads, "warmup": args.warmup, "repeats": args.repeats,
              "shapes": shapes, "cases": args.case_patterns, "omp_wait_policy": omp_wait_policy()}
    processes: List[dict] = []
    try:
        with base_worktree(REPOSITORY, base_commit) as base_tree:
            build_seconds = build(base_tree, with_cuda=gpu)
            print(f"built in {build_seconds:.1f} s", flush=True)
            trees = {"base": base_tree, "head": REPOSITORY}
            for round_index in range(args.rounds):
                # base, head | head, base | ...: neither side always runs first (warmer caches, load drift)
                order = ("base", "head") if round_index % 2 == 0 else ("head", "base")
                for side in order:
                    other = trees["head" if side == "base" else "base"]
                    record = run_process(side, round_index, trees[side], other, config)
                    processes.append(record)
                    status = "failed" if "error" in record else f"pid {record['pid']}"
                    print(f"round {round_index + 1}/{args.rounds} {side}: {record['wall_seconds']:.1f} s ({status})",
                          flush=True)
            base_state = tree_state(base_tree)
    except CompareError as exc:
        print(f"bench.compare: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench.compare: interrupted; the base worktree was removed", file=sys.stderr)
        return 130
    cases = summarize(names, processes, args.clock)
    wall = time.perf_counter() - started
    lines = [""] + _side_lines("base", args.base, base_tree, base_state, processes) \
        + _side_lines("head", "current checkout", REPOSITORY, head_state, processes)
    lines += [f"shapes: {', '.join(f'{k} ' + ','.join(f'{d}={v}' for d, v in s.items()) for k, s in shapes.items())}"
              f"; {args.rounds} rounds, {args.warmup} warm-up + {args.repeats} timed calls per case and process "
              f"(min; {args.clock} clock); OMP_WAIT_POLICY={omp_wait_policy()}",
              f"build of the base: {build_seconds:.1f} s; wall time {wall:.0f} s; {_children_time(processes)}", ""]
    lines += table(cases)
    slower = [c["case"] for c in cases if c["slower"]]
    lines += ["", f"{len(slower)} case(s) slower by more than {(SLOWER_THRESHOLD - 1) * 100:.0f}%: "
              f"{', '.join(slower) if slower else 'none'}"]
    print("\n".join(lines), flush=True)
    if args.json:
        result = {"base": {"ref": args.base, "tree": str(base_tree), **base_state},
                  "head": {"tree": str(REPOSITORY), **head_state},
                  "settings": {**config, "rounds": args.rounds, "clock": args.clock}, "build_seconds": build_seconds,
                  "wall_seconds": wall, "processes": processes, "cases": cases}
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
