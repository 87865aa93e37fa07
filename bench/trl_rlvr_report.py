"""Report of the TRL RLVR benchmark (:mod:`bench.trl_rlvr`): the Markdown table and the
PNG of exact-match error against step (per-seed lines, the median over seeds, and the runs under
several processes dashed on top). Both come from ``results.json`` alone (``--report DIR``)."""

from __future__ import annotations

from typing import Optional

from . import experiment as ex

LABELS = {"tpo": "TargetPOTrainer (TPO)", "grpo": "TRL GRPOTrainer"}
SMOOTH = 10  # steps: the curves are running means (one step's error is a mean of only prompts x K samples)


def _smooth(values, window: int = SMOOTH):
    """Running mean over the last ``window`` points (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _seconds(values) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def markdown(results: dict) -> str:
    from .trl_rlvr import summarize

    cfg, machine = results["config"], results.get("machine", {})
    rows = results.get("summary") or summarize(results)
    at = f"{100 * cfg['threshold']:.0f}%"
    lines = [
        f"# Reverse copy through TRL, terminal reward: H={cfg['horizon']}, {cfg['prompts']} prompts x "
        f"K={cfg['group']} per step, {cfg['steps']} steps, lr {cfg['lr']:g}, num_iterations {cfg['num_iterations']}",
        "",
        f"Final error: mean sampled exact-match error (1 - TRL's logged mean reward) over the last "
        f"{cfg['final_window']} steps. First step ≤{at}: first step whose sampled error is at most {at} "
        f"(— never). Greedy: exact-match error of greedy decoding on all 2^H prompts after training. "
        f"Time: wall and process CPU seconds per optimizer step (generation included; under torchrun, of the rank-0 process), per seed.",
        "",
        f"| method | processes | median final error % | per-seed final error % | first step ≤{at} | "
        "greedy error % | s/step wall | s/step CPU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        firsts = ", ".join("—" if x is None else str(x) for x in r["first_step_at_threshold"])
        lines.append(
            f"| {r['method']} | {r['processes']} | **{ex.pct(r['median_final_error'])}** | "
            f"{', '.join(ex.pct(x) for x in r['final_error'])} | {firsts} | "
            f"{', '.join(ex.pct(x) for x in r['greedy_final_error'])} | {_seconds(r['seconds_per_step'])} | "
            f"{_seconds(r['cpu_seconds_per_step'])} |")
    lines += [
        "",
        f"Seeds 0..{cfg['seeds'] - 1} (a seed fixes the initial model, the prompt stream and TRL's seed: both "
        f"methods start from the same model). Runs under several processes: seed 0, torchrun (gloo), the "
        f"step's prompts split over the processes. At most {cfg['jobs']} training processes at a time, "
        f"{cfg['threads']} thread(s) per process; {machine.get('cpu_count')} CPUs, load average {ex.load_text(machine.get('loadavg'))} at the "
        "start" + (f"; total wall {results['wall_seconds']:.0f} s." if results.get("wall_seconds") else "."),
        f"Command: `{ex.command_line('trl_rlvr', cfg.get('argv', []))}`",
    ]
    if results.get("note"):
        lines.append(f"Note: {results['note']}.")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> Optional[str]:
    """Exact-match error against step; returns the path, or None without matplotlib."""
    plt = ex.pyplot()
    if plt is None:
        return None
    cfg = results["config"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for method in cfg["methods"]:
        color = ex.COLORS.get(method)
        one = ex.runs_of(results, method=method, processes=1)
        if one:
            ex.plot_seed_curves(ax, [_smooth(r["curves"]["error"]) for r in one], color, f"{LABELS[method]} (1 process)")
        for r in results["runs"]:
            if r["method"] == method and r["processes"] > 1:
                err = _smooth(r["curves"]["error"])
                ax.plot(range(1, len(err) + 1), err, color=color, lw=1.2, ls="--",
                        label=f"{LABELS[method]}: seed {r['seed']}, {r['processes']} processes")
    ex.finish_error_axes(ax, cfg["threshold"], "optimizer step (one TRL generation each)", legend_size=7)
    ax.set_ylabel(f"exact-match error (sampled, running mean of {SMOOTH} steps)")
    ax.set_title(f"Reverse copy through TRL: H={cfg['horizon']}, {cfg['prompts']} prompts x K={cfg['group']} "
                 f"per step, lr {cfg['lr']:g}\n(thin: one line per seed, thick: median, dashed: torchrun)",
                 fontsize=9)
    return ex.save_figure(plt, fig, path)
