"""The cpu backend under load: each path's slowdown (loaded / idle) beside eager PyTorch's, in one run.

    python -m bench.cpu_load                 # from the repository root: quick-grid shapes, ~1-2 min
    python -m bench.cpu_load --smoke         # tiny shapes, a few seconds (the test runs this)
    python -m bench.cpu_load --json out.json # also write the figures as JSON

Paths, forward + backward each, on fixed seeded inputs:

* ``logits``: ``tpo_loss(logits, ..., backend="cpu")`` (in-place backward) against eager
  PyTorch's ``naive_tpo_logits`` (tpo_kernels/bench/baselines.py: fp32 ``log_softmax``, gather,
  the group math, autograd);
* ``fused``: ``fused_linear_tpo_loss(hidden, weight, ..., backend="cpu")`` against eager
  ``naive_tpo_linear`` (``hidden @ W.T`` then the same);
* ``rowops``: the row ops alone, where the cpu backend's own threads work: the cpu backend's
  ``row_forward`` + ``row_backward`` on ``[G*K*T, V]`` logits against the torch backend's (the
  same contract in eager PyTorch ops), after a torch op on a large tensor (as in a training step,
  torch's threads have just worked when a row op starts).

The load is ``--load-procs`` Python processes (default: one per CPU) each spinning in a busy
loop, started by this script for each loaded phase and killed when it ends (in a ``finally``, so
an error or Ctrl-C never leaves them behind). Phases alternate idle, loaded, idle, loaded ...
(``--rounds`` of each), and inside a phase ours and eager alternate call by call, so that a change
of the machine's other load during the run reaches both alike. Slowdown = median loaded time /
median idle time; the target is ours <= 1.5x eager's (a CPU backend that degrades under load no
worse than PyTorch). "Idle" means without this script's load: the machine's own load average is
printed before and after, for the reader to judge.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

import tpo_kernels
from tpo_kernels.bench import baselines

TARGET = 1.5  # ours' slowdown at most this multiple of eager's
SPIN = "while True:\n    pass\n"

# name -> (G groups, K completions, T tokens, V vocabulary, H hidden); M = G*K*T rows.
SHAPES = {
    # the `tpo-kernels bench --quick` CPU grid's logits and fused-linear shapes
    "default": {"logits": (10, 8, 8, 16384, 0), "fused": (10, 8, 8, 4096, 256), "rowops": (1, 8, 10, 16384, 0)},
    "smoke": {"logits": (2, 4, 4, 512, 0), "fused": (2, 4, 4, 256, 32), "rowops": (1, 4, 8, 2048, 0)},
}


def _loss(out):
    return out[0] if isinstance(out, tuple) else out


def make_calls(path: str, shape: Tuple[int, ...], seed: int = 0) -> Dict[str, Tuple[Callable, Callable]]:
    """{"ours" | "eager": (prepare, run)}: prepare() returns fresh leaf inputs (untimed; the logits
    path's backward overwrites its logits), run(inputs) is one forward + backward."""
    g, k, t, v, h = shape
    n = g * k
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, v, (n, t), generator=gen)
    scores = torch.randn(n, generator=gen)
    if path == "logits":
        logits = torch.randn(n, t, v, generator=gen)

        def prepare():
            return (logits.clone().requires_grad_(),)

        def ours(x):
            _loss(tpo_kernels.tpo_loss(x, labels, scores, group_size=k, backend="cpu")).backward()

        def eager(x):
            baselines.naive_tpo_logits(x, labels, scores, k).backward()
    elif path == "fused":
        hidden = torch.randn(n, t, h, generator=gen)
        weight = torch.randn(v, h, generator=gen) * h ** -0.5

        def prepare():
            return hidden.clone().requires_grad_(), weight.clone().requires_grad_()

        def ours(x, w):
            _loss(tpo_kernels.fused_linear_tpo_loss(x, w, labels, scores, group_size=k, backend="cpu")).backward()

        def eager(x, w):
            baselines.naive_tpo_linear(x, w, labels, scores, k).backward()
    elif path == "rowops":
        from tpo_kernels.backends import get_backend

        logits = torch.randn(n * t, v, generator=gen)
        flat_labels = labels.reshape(-1)
        busy = torch.randn(1 << 22, generator=gen)

        def prepare():
            busy.mul_(1.0)  # untimed: torch's threads have just run when the row ops start
            return ()

        def rows(backend):
            def run():
                summary = backend.row_forward(logits, flat_labels, inv_temperature=1.0, with_entropy=False)
                backend.row_backward(logits, flat_labels, summary, torch.ones_like(summary.label_logprob),
                                     inv_temperature=1.0, out=torch.empty_like(logits))
            return run

        cpu = torch.device("cpu")
        ours, eager = rows(get_backend("cpu", cpu)), rows(get_backend("torch", cpu))
    else:
        raise ValueError(f"path must be 'logits', 'fused' or 'rowops', got {path!r}")
    return {"ours": (prepare, ours), "eager": (prepare, eager)}


def time_alternating(calls: Dict[str, Tuple[Callable, Callable]], budget_s: float, min_reps: int) -> Dict[str, List[float]]:
    """Times the calls in turn (ours, eager, ours, ...) until each has min_reps samples and
    budget_s has passed."""
    samples: Dict[str, List[float]] = {name: [] for name in calls}
    start = time.perf_counter()
    while min(len(s) for s in samples.values()) < min_reps or time.perf_counter() - start < budget_s:
        for name, (prepare, run) in calls.items():
            inputs = prepare()
            t0 = time.perf_counter()
            run(*inputs)
            samples[name].append(time.perf_counter() - t0)
    return samples


class Load:
    """``procs`` busy-loop processes for the duration of a ``with`` block (none when procs=0)."""

    def __init__(self, procs: int):
        self.procs = procs
        self.children: List[subprocess.Popen] = []

    def __enter__(self):
        try:
            for _ in range(self.procs):
                self.children.append(subprocess.Popen([sys.executable, "-c", SPIN]))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        time.sleep(0.2 if self.procs else 0.0)  # let them reach the scheduler's steady state
        return self

    def __exit__(self, *exc):
        for child in self.children:
            child.kill()
        for child in self.children:
            child.wait()
        self.children = []
        return False


def measure(shapes: Dict[str, Tuple[int, ...]], rounds: int, load_procs: int, budget_s: float, min_reps: int) -> dict:
    calls = {path: make_calls(path, shape) for path, shape in shapes.items()}
    for path_calls in calls.values():  # warm-up: first-call costs (extension load, allocator)
        for prepare, run in path_calls.values():
            run(*prepare())
    samples = {path: {name: {"idle": [], "loaded": []} for name in c} for path, c in calls.items()}
    for _ in range(rounds):
        for phase, procs in (("idle", 0), ("loaded", load_procs)):
            with Load(procs):
                for path, path_calls in calls.items():
                    got = time_alternating(path_calls, budget_s, min_reps)
                    for name, times in got.items():
                        samples[path][name][phase].extend(times)
    paths = {}
    for path, by_name in samples.items():
        row = {"shape": dict(zip("GKTVH", shapes[path]))}
        for name, phases in by_name.items():
            idle, loaded = statistics.median(phases["idle"]), statistics.median(phases["loaded"])
            row[name] = {"idle_s": idle, "loaded_s": loaded, "slowdown": loaded / idle,
                         "reps": {p: len(t) for p, t in phases.items()}}
        row["slowdown_vs_eager"] = row["ours"]["slowdown"] / row["eager"]["slowdown"]
        row["meets_target"] = row["slowdown_vs_eager"] <= TARGET
        paths[path] = row
    return paths


def report(result: dict) -> str:
    lines = [
        f"cpu backend under load: {result['load_procs']} busy processes, {result['rounds']} rounds of idle/loaded, "
        f"torch threads {result['threads']}, {result['cpus']} CPUs, load average before "
        f"{result['loadavg_before']} after {result['loadavg_after']}",
        "| path | ours idle ms | ours loaded ms | ours slowdown | eager idle ms | eager loaded ms | eager slowdown "
        f"| ours / eager slowdown (target <= {TARGET}) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for path, row in result["paths"].items():
        o, e = row["ours"], row["eager"]
        verdict = "met" if row["meets_target"] else "MISSED"
        lines.append(
            f"| {path} {row['shape']} | {o['idle_s'] * 1e3:.2f} | {o['loaded_s'] * 1e3:.2f} | {o['slowdown']:.2f}x "
            f"| {e['idle_s'] * 1e3:.2f} | {e['loaded_s'] * 1e3:.2f} | {e['slowdown']:.2f}x "
            f"| {row['slowdown_vs_eager']:.2f} {verdict} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one round, short budgets: seconds")
    p.add_argument("--rounds", type=int, help="idle/loaded alternations (default 3; --smoke 1)")
    p.add_argument("--load-procs", type=int, default=os.cpu_count() or 1,
                   help="busy-loop processes in a loaded phase (default: one per CPU)")
    p.add_argument("--budget", type=float, help="seconds per path per phase (default 2; --smoke 0.2)")
    p.add_argument("--min-reps", type=int, default=3, help="least samples per call per phase")
    p.add_argument("--threads", type=int, help="torch.set_num_threads before measuring")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (1 if args.smoke else 3)
    budget = args.budget if args.budget is not None else (0.2 if args.smoke else 2.0)
    for name, value in (("--rounds", rounds), ("--min-reps", args.min_reps)):
        if value < 1:
            p.error(f"{name} must be >= 1, got {value}")
    if args.load_procs < 0:
        p.error(f"--load-procs must be >= 0, got {args.load_procs}")
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    paths = measure(SHAPES["smoke" if args.smoke else "default"], rounds, args.load_procs, budget, args.min_reps)
    result = {
        "paths": paths, "rounds": rounds, "load_procs": args.load_procs, "budget_s": budget,
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "loadavg_before": loadavg_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()], "target": TARGET,
        "tpo_kernels": os.path.dirname(tpo_kernels.__file__), "torch": torch.__version__,
    }
    print(report(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
