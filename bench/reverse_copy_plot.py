"""Report of the reverse-copy benchmark (:mod:`bench.reverse_copy`): the Markdown table
and the PNG of exact-match error against episode (median over seeds and per-seed lines, one panel
per optimizer). Both are built from ``results.json`` alone, so ``--report DIR`` can rebuild them."""

from __future__ import annotations

from typing import Optional

from . import experiment as ex

LABELS = {"tpo": "TPO (tpo_kernels fused-linear)", "grpo": "GRPO (clip + k3 KL)",
          "tpo_ref": "TPO (plain PyTorch reference)", "tpo_token": "token-level TPO (fused-linear)"}


def _reward(cfg: dict) -> str:
    return f"{cfg.get('reward', 'terminal')} reward"


def markdown(results: dict) -> str:
    """The results table (and the settings it was run with) as Markdown."""
    from .reverse_copy import summarize  # here: reverse_copy imports this module

    cfg, machine = results["config"], results.get("machine", {})
    rows = results.get("summary") or summarize(results)
    window, threshold = cfg["final_window"], cfg["threshold"]
    spe = [r["seconds_per_episode"] for r in results["runs"]]
    cpe = [r["cpu_seconds_per_episode"] for r in results["runs"] if r.get("cpu_seconds_per_episode")]
    lines = [
        f"# Reverse copy, {_reward(cfg)}: H={cfg['horizon']}, B={cfg['batch']}, K={cfg['group']}, "
        f"{cfg['epochs']} epochs/batch, {cfg['episodes']} episodes",
        "",
        f"Final error: mean sampled exact-match error (% of the B*K completions with any wrong token) over "
        f"the last {window} episodes. First ep ≤{100 * threshold:.0f}%: first episode whose sampled error is "
        f"at most {100 * threshold:.0f}% (— never). Greedy: exact-match error of greedy decoding, on fixed "
        f"evaluation prompts, by the rollout policy of the last episode.",
        "",
        "| optimizer (lr) | method | median final error % | per-seed final error % | first ep ≤"
        f"{100 * threshold:.0f}% per seed | greedy error % per seed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        per_seed = ", ".join(ex.pct(x) for x in r["final_error"])
        firsts = ", ".join("—" if x is None else str(x) for x in r["first_episode_at_threshold"])
        greedy = ", ".join(ex.pct(x) for x in r["greedy_final_error"])
        lines.append(f"| {r['optimizer']} ({r['lr']:g}) | {r['method']} | **{ex.pct(r['median_final_error'])}** | "
                     f"{per_seed} | {firsts} | {greedy} |")
    lines += [
        "",
        f"Seeds {cfg['seeds']} (a seed fixes the initial weights, prompts and sampling stream; the same "
        f"seed gives both methods the same initial model). TPO: eta {cfg['eta']}, anchored. "
        f"GRPO: clip {cfg['clip_eps']}, k3 KL beta {cfg['beta']} to the rollout snapshot.",
    ]
    if cfg.get("muon_adamw_lr") is not None:
        lines.append(f"Muon runs: AdamW lr {cfg['muon_adamw_lr']:g} on the non-2-D parameters.")
    if spe:
        lines.append(
            f"Time: {min(spe):.3f}–{max(spe):.3f} s per episode per run, wall"
            + (f" ({min(cpe):.3f}–{max(cpe):.3f} s of process CPU time)" if cpe else "")
            + f"; {cfg['jobs']} runs in parallel, "
            f"{cfg['threads']} thread(s) each; {machine.get('cpu_count')} CPUs, load average "
            f"{ex.load_text(machine.get('loadavg'))} at the start, {ex.load_text(machine.get('loadavg_end'))} at the end; "
            f"total wall {results.get('wall_seconds', 0):.0f} s.")
    lines.append(f"Command: `{ex.command_line('reverse_copy', cfg.get('argv', []))}`")
    if results.get("note"):
        lines.append(f"Note: {results['note']}.")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> Optional[str]:
    """Exact-match error against episode: one panel per optimizer, per-seed lines (thin) and the
    median over seeds (thick) per method. Returns the path, or None without matplotlib."""
    plt = ex.pyplot()
    if plt is None:
        return None
    cfg = results["config"]
    optimizers = cfg["optimizers"]
    fig, axes = plt.subplots(1, len(optimizers), figsize=(6.2 * len(optimizers), 4.3), squeeze=False,
                             sharey=True)
    for ax, optimizer in zip(axes[0], optimizers):
        for method in cfg["methods"]:
            runs = ex.runs_of(results, method=method, optimizer=optimizer)
            if runs:
                ex.plot_seed_curves(ax, [r["curves"]["error"] for r in runs], ex.COLORS.get(method),
                                 LABELS.get(method, method))
        ax.set_title(f"{optimizer} (lr {cfg['lrs'][optimizer]:g})")
        ex.finish_error_axes(ax, cfg["threshold"], "episode")
    axes[0][0].set_ylabel("exact-match error (sampled)")
    fig.suptitle(f"Reverse copy, {_reward(cfg)}: H={cfg['horizon']}, B={cfg['batch']}, K={cfg['group']}, "
                 f"{cfg['epochs']} epochs per batch\n(thin: one line per seed, thick: median over seeds)", fontsize=10)
    return ex.save_figure(plt, fig, path)
