"""Derived numbers (throughput, ratios, correctness checks, preset targets) and the outputs:
``results.json``, ``results.md`` and PNG plots."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import statistics
from collections import OrderedDict, defaultdict
from typing import TYPE_CHECKING, Dict, List, Optional

from . import cases as C
from .calibrate import calibration_text, clocks_text

if TYPE_CHECKING:  # pragma: no cover
    from .presets import Target

MiB = float(1 << 20)
_COMPARE_ROLES = ("reference", "baseline", "floor")
_ROLE_ORDER = {"ours": 0, "floor": 1, "reference": 2, "baseline": 3}
_TOL = {"fp32": (1e-3, 1e-5), "fp64": (1e-6, 1e-9), "bf16": (3e-2, 1e-3), "fp16": (3e-2, 1e-3)}


def _key(r: dict, with_mode=True):
    k = (r["case"], json.dumps(r["shape"], sort_keys=True), r["dtype"], r["variant"])
    return k + (r["mode"],) if with_mode else k


def copy_gbps(calibration: Optional[dict]) -> Optional[float]:
    """The measured copy bandwidth of the run (GB/s), or None."""
    return ((calibration or {}).get("copy") or {}).get("gbps")


def derive(results: List[dict], calibration: Optional[dict] = None) -> None:
    """Add throughput, tokens/s, ratios against every baseline of the same run and the check
    against the reference provider (in place). With a copy-bandwidth calibration, bandwidths
    also get ``vs_copy`` (the fraction of the measured copy bandwidth); kernel-only stage times
    (``kernel``) get their forward+backward bandwidth."""
    copy = copy_gbps(calibration)
    by_key: Dict[tuple, List[dict]] = defaultdict(list)
    for r in results:
        if r.get("status") == "ok":
            by_key[_key(r)].append(r)
            case = C.CASES[r["case"]]
            t = r["time_s"]["median"]
            r["tokens_per_s"] = case.tokens(r["shape"]) / t
            if case.throughput is not None:
                value, unit = case.throughput(case.full_shape(r["shape"]), r["dtype"], r["mode"], t)
                r["throughput"] = {"value": value, "unit": unit}
                if copy and unit == "GB/s":
                    r["throughput"]["vs_copy"] = value / copy
            kernel = r.get("kernel")
            if kernel and kernel.get("total_s") and case.throughput is not None:
                value, unit = case.throughput(case.full_shape(r["shape"]), r["dtype"], "full", kernel["total_s"])
                kernel["throughput"] = {"value": value, "unit": unit}
                if copy and unit == "GB/s":
                    kernel["throughput"]["vs_copy"] = value / copy
    for rows in by_key.values():
        for r in rows:
            vs = OrderedDict()
            for b in rows:
                if b is r or b.get("role") not in _COMPARE_ROLES:
                    continue
                vs[b["provider"]] = {
                    "speedup": b["time_s"]["median"] / r["time_s"]["median"],
                    "memory": (r["peak_bytes"] / b["peak_bytes"]) if b["peak_bytes"] > 0 else None,
                }
            r["vs"] = vs
    # correctness: compare each provider's check (loss, gradient norms) with the reference's
    checks: Dict[tuple, dict] = {}
    for r in results:
        if r.get("status") == "ok" and r.get("check") and r.get("role") == "reference":
            checks[_key(r, with_mode=False)] = r["check"]
    for r in results:
        if r.get("status") != "ok" or not r.get("check") or r.get("role") == "reference":
            continue
        ref = checks.get(_key(r, with_mode=False))
        if ref is None:
            continue
        rtol, atol = _TOL.get(r["dtype"], (1e-3, 1e-5))
        diffs = {"loss": _rel(r["check"]["loss"], ref["loss"])}
        ok = _close(r["check"]["loss"], ref["loss"], rtol, atol)
        for name, value in r["check"]["grad_norms"].items():
            if name in ref["grad_norms"]:
                diffs[f"|d{name}|"] = _rel(value, ref["grad_norms"][name])
                ok = ok and _close(value, ref["grad_norms"][name], rtol, atol)
        r["check_vs_reference"] = {"ok": ok, "rel_diff": diffs, "rtol": rtol}


def merge_rounds(by_round: List[List[dict]]) -> List[dict]:
    """The results of interleaved rounds of one plan as one list: per measurement the median of
    the rounds' median times (min and max over all repetitions, each round's median kept as
    ``round_medians``) and the largest peak memory; rounds that failed are counted in
    ``rounds_failed``. One round is returned as it is."""
    if len(by_round) == 1:
        return by_round[0]
    groups: Dict[tuple, List[dict]] = OrderedDict()
    for results in by_round:
        for r in results:
            groups.setdefault(_key(r) + (r["provider"],), []).append(r)
    merged = []
    for rows in groups.values():
        ok = [r for r in rows if r.get("status") == "ok"]
        if not ok:
            merged.append(rows[0])
            continue
        r = dict(ok[0])
        medians = [x["time_s"]["median"] for x in ok]
        r["time_s"] = {"median": statistics.median(medians), "min": min(x["time_s"]["min"] for x in ok),
                       "max": max(x["time_s"]["max"] for x in ok), "mean": statistics.fmean(medians)}
        r["round_medians"], r["reps"] = medians, sum(x["reps"] for x in ok)
        r["peak_bytes"] = max(x["peak_bytes"] for x in ok)
        r["extra_bytes"] = r["peak_bytes"] - r["input_bytes"] - r["kept_grad_bytes"]
        if len(ok) < len(rows):
            r["rounds_failed"] = len(rows) - len(ok)
        merged.append(r)
    return merged


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def _close(a, b, rtol, atol):
    return math.isfinite(a) and abs(a - b) <= atol + rtol * abs(b)


# --------------------------------------------------------------------------- targets


def evaluate_targets(targets: List["Target"], results: List[dict], calibration: Optional[dict] = None) -> List[dict]:
    """Each target's verdict for every provider it concerns. A target with ``relative="copy"``
    divides the measured value by the run's copy bandwidth (``calibration``); without one it is
    'not measured'."""
    out = []
    ok_rows = [r for r in results if r.get("status") == "ok"]
    copy = copy_gbps(calibration)

    def metric(r, name):
        if name == "time":
            return r["time_s"]["median"]
        if name == "peak":
            return r["peak_bytes"]
        if name == "extra":
            return r["extra_bytes"]
        if name == "extra_beyond_cache":  # extra memory beyond the logits cache budget the call was given
            cache = r.get("logits_cache_bytes")
            return None if cache is None else r["extra_bytes"] - cache
        if name == "over_grads":  # peak beyond the inputs, in units of the gradients' own bytes
            return (r["peak_bytes"] - r["input_bytes"]) / r["kept_grad_bytes"] if r.get("kept_grad_bytes") else None
        if name == "throughput":
            return r.get("throughput", {}).get("value")
        if name == "kernel_throughput":
            return ((r.get("kernel") or {}).get("throughput") or {}).get("value")
        raise ValueError(name)

    for t in targets:
        rows = [r for r in ok_rows if r["case"] == t.case and r["variant"] == t.variant and r["mode"] == t.mode]
        nums = [r for r in rows if (r["role"] == "ours" if t.num == "ours" else fnmatch.fnmatchcase(r["provider"], t.num))]
        entry_base = {"preset": t.preset, "target": t.text, "case": t.case, "variant": t.variant, "op": t.op, "threshold": t.threshold, "unit": t.unit}
        if not nums:
            out.append(dict(entry_base, provider=t.num, status="not measured", value=None))
            continue
        for n in nums:
            den = None
            if t.den is not None:
                den = next((r for r in rows if r["provider"] == t.den and r["shape"] == n["shape"] and r["dtype"] == n["dtype"]), None)
                if den is None:
                    out.append(dict(entry_base, provider=n["provider"], against=t.den, status=f"baseline {t.den} not measured", value=None))
                    continue
            if t.kind == "ratio":
                value = metric(n, t.metric) / metric(den, t.metric)
                formula = f"{t.metric}({n['provider']}) / {t.metric}({t.den})"
            elif t.kind == "speedup":
                value = metric(den, t.metric) / metric(n, t.metric)
                formula = f"{t.metric}({t.den}) / {t.metric}({n['provider']})"
            elif getattr(t, "relative", None) == "copy":
                raw = metric(n, t.metric)
                value = None if raw is None or not copy else raw / copy
                formula = f"{t.metric}({n['provider']}) / measured copy bandwidth" + (f" ({copy:.0f} GB/s)" if copy else "")
            else:
                raw = metric(n, t.metric)
                value = None if raw is None else raw / t.scale
                formula = f"{t.metric}({n['provider']})" + (f" in {t.unit}" if t.unit else "")
                if t.metric == "extra_beyond_cache" and n.get("logits_cache_bytes") is not None:
                    formula = (f"extra({n['provider']}) - its logits cache budget "
                               f"({n['logits_cache_bytes'] / t.scale:.3g}{' ' + t.unit if t.unit else ''})"
                               + (f" in {t.unit}" if t.unit else ""))
            if value is None:
                status = "not measured"
                if getattr(t, "relative", None) == "copy" and not copy:
                    status = "not measured (no copy-bandwidth calibration in this run)"
                elif t.metric == "kernel_throughput":
                    status = "not measured (no kernel-only times)"
                elif t.metric == "extra_beyond_cache":
                    status = "not measured (no logits cache budget recorded)"
            else:
                passed = {"<=": value <= t.threshold, "<": value < t.threshold, ">=": value >= t.threshold}[t.op]
                status = "PASS" if passed else "FAIL"
            out.append(dict(entry_base, provider=n["provider"], against=t.den, formula=formula, value=value, status=status))
    return out


def targets_text(evaluated: List[dict]) -> str:
    lines = []
    for e in evaluated:
        v = "n/a" if e["value"] is None else f"{e['value']:.3g}"
        unit = f" {e['unit']}" if e.get("unit") else ""
        lines.append(
            f"[{e['status']}] {e.get('preset', '')} ({e['variant']}): {e['target']}: "
            f"{e.get('formula', e['provider'])} = {v}{unit} (target {e['op']} {e['threshold']:g}{unit})"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- markdown


def _fmt_ms(s):
    ms = s * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _fmt_mib(b):
    return f"{b / MiB:.0f}" if abs(b) >= 10 * MiB else f"{b / MiB:.1f}"


def _vs(r, field, fmt):
    parts = []
    for name, d in (r.get("vs") or {}).items():
        if d.get(field) is None:
            continue
        parts.append(f"{name} {d[field]:{fmt}}x")
    return ", ".join(parts) or "-"


def _check(r):
    c = r.get("check_vs_reference")
    if c is None:
        text = "ref" if r.get("role") == "reference" and r.get("check") else "-"
    else:
        worst = max(c["rel_diff"].values()) if c["rel_diff"] else 0.0
        text = f"ok ({worst:.0e})" if c["ok"] else f"MISMATCH ({worst:.1e})"
    fp64 = r.get("check_fp64")
    if fp64 is not None:
        text += "; fp64 n/a" if "error" in fp64 else f"; fp64 {fp64['max_rel_diff']:.0e}"
    return text


def markdown(run: dict) -> str:
    meta, results = run["meta"], run["results"]
    out = [f"# tpo_kernels benchmark: {meta.get('title', 'run')}", ""]
    out.append(f"- machine: {meta['machine']}")
    out.append(f"- software: {meta['software']}")
    out.append(f"- command: `{meta['command']}`")
    if meta.get("backend_status"):
        out.append("- backends: " + ", ".join(f"{k}: {v}" for k, v in meta["backend_status"].items()))
    out.append(f"- timing: {meta['timing']}")
    if meta.get("load_average_start") is not None:
        out.append(
            f"- load average (1, 5, 15 min) at start {meta['load_average_start']}, at end {meta.get('load_average_end')}"
            f" (other processes on the machine slow CPU timings; each result in the JSON carries the load at its end)"
        )
    out.append(f"- memory: {meta['memory']}")
    if "calibration" in run:
        out.append(f"- copy-bandwidth calibration (same run, same device): {calibration_text(run.get('calibration'))}")
    if "clocks" in run:
        out.append(f"- GPU clocks and power during the run: {clocks_text(run.get('clocks'))}")
    out.append(
        "- columns: median time of the timed region; `peak` = peak memory over a baseline taken before the inputs "
        "existed (inputs included); `extra` = peak minus the inputs and the gradients a caller keeps (dH, dW); "
        "throughput: logits paths 3 passes over [M,V] (forward read, backward read + write), i.e. 6*M*V bytes in bf16, "
        "fused-linear 2*M*V*H flops per matmul (1 forward, 3 backward), and beside ours (dense) the bytes the pass reads and "
        "writes beyond its matmuls, from the tile plan (tpo_kernels.ops.tiles.traffic_account); speedup = t(baseline) / t(row); "
        "memory = peak(row) / peak(baseline); check = loss and gradient norms against the eager reference"
    )
    out.append("")
    if run.get("targets"):
        out += ["## Targets", "", "| status | preset | variant | target | measured | value |", "| --- | --- | --- | --- | --- | --- |"]
        for e in run["targets"]:
            v = "n/a" if e["value"] is None else f"{e['value']:.3g}{(' ' + e['unit']) if e.get('unit') else ''}"
            out.append(f"| {e['status']} | {e.get('preset', '')} | {e['variant']} | {e['target']} ({e['op']} {e['threshold']:g}) | {e.get('formula', e['provider'])} | {v} |")
        out.append("")
    out += _kernel_table(results)
    groups: Dict[tuple, List[dict]] = OrderedDict()
    for r in results:
        groups.setdefault((r["case"], r["dtype"], r["variant"]), []).append(r)
    device_type = "cpu" if meta.get("device_name", "CPU").startswith("CPU") else "cuda"
    for (case_name, dtype, variant), rows in groups.items():
        case = C.CASES[case_name]
        extra = ""
        tied = next((r for r in rows if r.get("num_groups")), None)
        if variant == "sparse90" and tied:
            extra = f", {tied['tied_groups']}/{tied['num_groups']} groups tied"
        stats = next((r["input_stats"] for r in rows if r.get("input_stats")), None)
        if variant == "zipf" and stats:
            extra = (f", Zipf candidates: {stats['distinct_candidates']} distinct ids in {stats['candidate_pairs']} pairs, "
                     f"the most frequent in {stats['max_pairs_per_id']}")
        out += [f"## {case_name}: {case.title} — {dtype}, {variant}{extra}", ""]
        out += [
            "| shape | provider | mode | median ms | peak MiB | extra MiB | throughput | speedup | memory | check |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        shape_order = []
        for r in rows:
            if r["shape"] not in shape_order:
                shape_order.append(r["shape"])
        rows = sorted(
            rows,
            key=lambda r: (shape_order.index(r["shape"]), C.MODES.index(r["mode"]), _ROLE_ORDER.get(r.get("role"), 9), r["provider"]),
        )
        for r in rows:
            label = C.shape_label(case.full_shape(r["shape"]))
            if r.get("status") != "ok":
                err = (r.get("error") or "").replace("|", "/").replace("\n", " ")[:160]
                out.append(f"| {label} | {r['provider']} | {r['mode']} | error | | | | | | {err} |")
                continue
            thr = r.get("throughput")
            thr_s = f"{thr['value']:.3g} {thr['unit']}" if thr else f"{r['tokens_per_s']:.3g} tok/s"
            if thr and thr.get("vs_copy") is not None:
                thr_s += f" ({thr['vs_copy']:.0%} of copy)"
            traffic = C.pass_traffic(case_name, r["shape"], dtype, variant, r["provider"], r["mode"], device_type)
            if traffic is not None:
                thr_s += f"; {traffic / 1e9:.3g} GB beyond matmuls"
            out.append(
                f"| {label} | {r['provider']} | {r['mode']} | {_fmt_ms(r['time_s']['median'])} | {_fmt_mib(r['peak_bytes'])} | "
                f"{_fmt_mib(r['extra_bytes'])} | {thr_s} | {_vs(r, 'speedup', '.2f')} | {_vs(r, 'memory', '.2f')} | {_check(r)} |"
            )
        out.append("")
    if run.get("skipped"):
        out += ["## Skipped providers", "", "| case | provider | reason |", "| --- | --- | --- |"]
        for s in run["skipped"]:
            out.append(f"| {s['case']} | {s['provider']} | {s['reason']} |")
        out.append("")
    if run.get("plots"):
        out += ["## Plots", ""] + [f"- {p}" for p in run["plots"]] + [""]
    return "\n".join(out)


def _kernel_table(results: List[dict]) -> List[str]:
    rows = [r for r in results if r.get("status") == "ok" and r.get("kernel")]
    if not rows:
        return []
    out = ["## Kernel-only times next to the end-to-end call", "",
           "The backend's row forward, group op and row backward alone on the same inputs (`kernel_times`), "
           "against the whole `tpo_loss` forward+backward; bandwidth for 3 passes over [M,V] (6*M*V bytes in bf16).", "",
           "| case | shape | dtype | variant | provider | row fwd ms | group ms | row bwd ms | kernels ms | end-to-end ms | "
           "kernels GB/s | end-to-end GB/s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        k = r["kernel"]
        label = C.shape_label(C.CASES[r["case"]].full_shape(r["shape"]))
        if k.get("error"):
            out.append(f"| {r['case']} | {label} | {r['dtype']} | {r['variant']} | {r['provider']} | error: "
                       f"{k['error'][:120].replace('|', '/')} | | | | | | |")
            continue

        def bw(thr):
            if not thr:
                return "-"
            text = f"{thr['value']:.4g}"
            return text + (f" ({thr['vs_copy']:.0%} of copy)" if thr.get("vs_copy") is not None else "")

        e2e = r.get("throughput") if r["mode"] == "full" else None
        out.append(
            f"| {r['case']} | {label} | {r['dtype']} | {r['variant']} | {r['provider']} | {_fmt_ms(k['row_forward']['median'])} | "
            f"{_fmt_ms(k['group']['median'])} | {_fmt_ms(k['row_backward']['median'])} | {_fmt_ms(k['total_s'])} | "
            f"{_fmt_ms(r['time_s']['median']) if r['mode'] == 'full' else '-'} | {bw(k.get('throughput'))} | {bw(e2e)} |")
    return out + [""]


# --------------------------------------------------------------------------- plots


def plots(run: dict, out_dir: str) -> List[str]:
    """Time and peak memory vs vocab size and vs tokens; needs matplotlib (imported here)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401
    except Exception as exc:
        print(f"plots skipped: matplotlib not importable ({exc}); pip install matplotlib", flush=True)
        return []
    written = []
    ok = [r for r in run["results"] if r.get("status") == "ok"]
    combos = OrderedDict()
    for r in ok:
        combos.setdefault((r["case"], r["dtype"], r["variant"]), []).append(r)
    for (case_name, dtype, variant), rows in combos.items():
        case = C.CASES[case_name]
        mode = "full" if any(r["mode"] == "full" for r in rows) else rows[0]["mode"]
        rows = [r for r in rows if r["mode"] == mode]
        for axis in ("vocab", "tokens"):
            param = "V" if axis == "vocab" else ("G" if "G" in rows[0]["shape"] else case.token_key)
            series = defaultdict(list)
            for r in rows:
                fixed = tuple((k, v) for k, v in sorted(r["shape"].items()) if k != param)
                series[fixed].append(r)
            fixed, best = max(series.items(), key=lambda kv: len({r["shape"][param] for r in kv[1]}), default=(None, []))
            xs = sorted({r["shape"][param] for r in best})
            if len(xs) < 2:
                continue
            fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
            by_provider = OrderedDict()
            for r in sorted(best, key=lambda r: (_ROLE_ORDER.get(r["role"], 9), r["provider"])):
                by_provider.setdefault(r["provider"], []).append(r)
            for name, prs in by_provider.items():
                prs = sorted(prs, key=lambda r: r["shape"][param])
                x = [r["shape"][param] if axis == "vocab" else case.tokens(r["shape"]) for r in prs]
                style = "-o" if prs[0]["role"] == "ours" else "--s"
                ax_t.plot(x, [r["time_s"]["median"] * 1e3 for r in prs], style, label=name)
                ax_m.plot(x, [r["peak_bytes"] / MiB for r in prs], style, label=name)
            xlabel = "vocabulary size V" if axis == "vocab" else f"tokens ({'M' if case.token_key == 'M' else 'R'})"
            ticks = sorted({r["shape"][param] if axis == "vocab" else case.tokens(r["shape"]) for r in best})
            for ax, ylabel in ((ax_t, f"median time, {mode} (ms)"), (ax_m, "peak memory (MiB)")):
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xticks(ticks)
                ax.set_xticklabels([str(t) for t in ticks], rotation=30 if len(ticks) > 4 else 0)
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                ax.set_xlabel(xlabel)
                ax.set_ylabel(ylabel)
                ax.grid(True, which="both", alpha=0.3)
            ax_t.legend(fontsize=8)
            fixed_s = " ".join(f"{k}={v}" for k, v in fixed)
            fig.suptitle(f"{case_name} {dtype} {variant} ({fixed_s}) — {run['meta'].get('device_name', '')}", fontsize=10)
            fig.tight_layout()
            path = os.path.join(out_dir, f"{case_name}-{dtype}-{variant}-vs-{axis}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written


def write_json(run: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(run, f, indent=1, default=str)
