"""What the experiments of bench/ share, held once: the settings the learning experiments
(``bench.reverse_copy``, ``bench.trl_rlvr``) both use, their common command-line options, the
summary statistics of an error curve, the results files (``results.json``, ``results.md``, a PNG),
the error-curve plot; and, for every tool that starts ``python -m bench.<name>`` in a child process
(the TRL runs, the trainer-step workers, the kernel report's Triton workers), its environment.

Both experiments train the same task (reverse a random binary string, reward 1 only for the exact
reversal) with the same policy size; a run records ``curves["error"]``, one exact-match error per
episode (or TRL step), and the reports summarize and plot that curve.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
from typing import Callable, Dict, List, Optional, Sequence

# ---------------------------------------------------------------------------- the shared settings

# The policy of both tasks: a small causal transformer (width, layers, attention heads).
MODEL_WIDTH, MODEL_LAYERS, MODEL_HEADS = 64, 2, 4
THRESHOLD = 0.10  # "first episode (step) at or below this error"
FINAL_WINDOW = 20  # final error = mean error over the last this many episodes (steps)
LOG_EVERY = 25  # a progress line every this many episodes (steps)
# One color per method in every plot: TPO brown, GRPO cyan, whichever experiment drew it.
COLORS = {"tpo": "tab:brown", "grpo": "tab:cyan", "tpo_ref": "tab:olive", "tpo_token": "tab:purple"}
# The Hugging Face hub is never reached: the models and tokenizers are built locally.
OFFLINE_HUB = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def offline_hub() -> None:
    """Keep transformers / TRL off the network (set before they are imported; explicit settings win)."""
    for name, value in OFFLINE_HUB.items():
        os.environ.setdefault(name, value)


REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder that holds bench/


def child_env(**extra: str) -> Dict[str, str]:
    """The environment of a child ``python -m bench.<name>``: PYTHONPATH starts with the folder of the
    tpo_kernels imported here (so the child runs the same package) and then the repository root
    (where ``bench`` is, which no installation carries)."""
    import tpo_kernels

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(tpo_kernels.__file__)))
    paths = [package_parent, REPOSITORY] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    unique = list(dict.fromkeys(paths))
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(unique)}


@contextlib.contextmanager
def bench_importable_in_children():
    """While inside, child processes started with the inherited environment find ``bench``
    (for launchers that take no environment of their own)."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def csv(text: str) -> List[str]:
    """``"a, b,"`` -> ``["a", "b"]``."""
    return [t.strip() for t in str(text).split(",") if t.strip()]


def command_line(module: str, argv: Sequence[str]) -> str:
    """The command that reproduces a run, as the results' Markdown records it."""
    return " ".join([f"python -m bench.{module}", *argv])


def machine() -> dict:
    """The machine a run used: platform, versions, CPU count and the load average now."""
    import torch

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "loadavg": load, "muon": hasattr(torch.optim, "Muon")}


# ---------------------------------------------------------------------------- statistics of a run


def final_error(run: dict, window: int) -> float:
    """Mean of the last ``window`` points of the run's error curve."""
    errs = run["curves"]["error"]
    tail = errs[-min(window, len(errs)):]
    return sum(tail) / len(tail)


def first_at_or_below(run: dict, threshold: float) -> Optional[int]:
    """The first episode (step), counted from 1, whose error is at most ``threshold``; None if none."""
    for i, e in enumerate(run["curves"]["error"], start=1):
        if e <= threshold:
            return i
    return None


def median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def median_curve(curves: Sequence[Sequence[float]]) -> List[float]:
    """Pointwise median of several curves, over their common length."""
    n = min(len(c) for c in curves)
    return [median([c[i] for c in curves]) for i in range(n)]


def pct(x: Optional[float]) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


def load_text(values) -> str:
    """A load average as the reports print it."""
    return "?" if not values else ", ".join(f"{v:.2f}" for v in values)


# ---------------------------------------------------------------------------- the command line


def add_output_options(parser: argparse.ArgumentParser, out: str, unit: str) -> None:
    """The options every learning experiment takes: progress, summary and output (``unit``:
    "episode" or "step", what one point of the error curve is)."""
    parser.add_argument("--log-every", type=int, default=LOG_EVERY, help=f"progress line every N {unit}s")
    parser.add_argument("--final-window", type=int, default=FINAL_WINDOW,
                        help=f"final error = mean sampled error over the last N {unit}s")
    parser.add_argument("--threshold", type=float, default=THRESHOLD, help=f"error threshold for 'first {unit} at'")
    parser.add_argument("--out", default=out, help="output folder")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--report", metavar="DIR", help="only rebuild results.md and the PNG from DIR/results.json")


def rebuild_report(folder: str, write_outputs: Callable[..., List[str]], plot: bool) -> int:
    """``--report DIR``: results.md and the PNG again from ``DIR/results.json`` alone."""
    with open(os.path.join(folder, "results.json")) as f:
        results = json.load(f)
    for path in write_outputs(results, folder, plot=plot):
        print(f"wrote {path}")
    return 0


def print_finished(table: str, paths: Sequence[str], *lines: str) -> None:
    """The end of a run: the results table, any further lines, the files written."""
    print()
    print(table)
    for line in lines:
        print(line)
    for path in paths:
        print(f"wrote {path}")


# ---------------------------------------------------------------------------- results files


def _rounded(obj, digits: int = 6):
    """Floats to ``digits`` significant digits (curves are noisy far above that), recursively."""
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: _rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v, digits) for v in obj]
    return obj


def dump_json(results: dict, f) -> None:
    """``results.json``: floats to 6 significant digits, one line per run (compact, still diffable)."""
    results = _rounded(results)
    head = {k: v for k, v in results.items() if k != "runs"}
    text = json.dumps(head, indent=1)[:-2]  # drop the closing brace, append the runs
    runs = ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in results.get("runs", []))
    f.write(text + (',\n "runs": [\n  ' + runs + "\n ]\n}\n"))


def write_report(results: dict, out: str, report, png_name: str, plot: bool = True) -> List[str]:
    """results.json, results.md (``report.markdown``) and, with matplotlib, ``report.plot``'s
    ``png_name`` in ``out``: the outputs of every learning experiment."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, "results.json"), os.path.join(out, "results.md")]
    with open(paths[0], "w") as f:
        dump_json(results, f)
    with open(paths[1], "w") as f:
        f.write(report.markdown(results))
    if plot:
        png = report.plot(results, os.path.join(out, png_name))
        if png:
            paths.append(png)
    return paths


# ---------------------------------------------------------------------------- the error plot


def pyplot():
    """matplotlib's pyplot on the file-only backend, or None (with a note) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the plot (pip install matplotlib)")
        return None
    return plt


def plot_seed_curves(ax, curves: Sequence[Sequence[float]], color: Optional[str], label: str) -> None:
    """One thin line per seed and the median over the seeds, thick, labelled."""
    for err in curves:
        ax.plot(range(1, len(err) + 1), err, color=color, alpha=0.35, lw=0.8)
    med = median_curve(curves)
    ax.plot(range(1, len(med) + 1), med, color=color, lw=2.2, label=f"{label}: median of {len(curves)} seeds")


def finish_error_axes(ax, threshold: float, xlabel: str, legend_size: int = 8) -> None:
    """Error axis from 0 to 1, the threshold dotted, grid and legend."""
    ax.axhline(threshold, color="gray", lw=0.6, ls=":")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size, loc="lower left")


def save_figure(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def runs_of(results: dict, **fields) -> List[dict]:
    """The runs whose fields equal ``fields``, by seed."""
    return sorted((r for r in results["runs"] if all(r.get(k) == v for k, v in fields.items())),
                  key=lambda r: r["seed"])


def summary_row(runs: Sequence[dict], finals: Sequence[float], threshold: float, unit: str) -> Dict[str, object]:
    """The per-(method, ...) fields both experiments' tables report: seeds, the median and per-seed
    final errors, and the first ``unit`` at the threshold per seed."""
    return {"seeds": [r["seed"] for r in runs], "median_final_error": median(finals), "final_error": list(finals),
            f"first_{unit}_at_threshold": [first_at_or_below(r, threshold) for r in runs]}
