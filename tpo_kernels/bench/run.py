"""tpo-kernels bench (also python -m tpo_kernels bench and python -m tpo_kernels.bench):
plan, run, report.

examples:
  tpo-kernels bench                            # default grid for this device (CPU: < 10 min)
  tpo-kernels bench --quick                    # a few small shapes, fwd+bwd only (seconds to a minute)
  tpo-kernels bench --preset fused-linear-cpu  # a named setting, with the verdicts on its targets
  tpo-kernels bench --case logits --shape G=8,K=8,T=128,V=32768 --providers 'tpo:*,naive' --mode full
  tpo-kernels bench --list                     # cases, providers (and why any is skipped), presets
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import sys
import time
from typing import TYPE_CHECKING

from ..usage import OneLineParser, UsageError, output_folder_problem
from .machine import describe_machine, loadavg

if TYPE_CHECKING:  # pragma: no cover
    from ..selfcheck.heartbeat import Heartbeat

# The cases, the plan and the presets import torch: they are imported where used, so that
# ``tpo-kernels bench --help`` answers without loading torch.

DEFAULT_OUT = "tpo-bench-out"
PROG = "tpo-kernels bench"


def build_parser(prog=PROG) -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="Benchmark tpo_kernels against the baselines users would pick instead.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__[__doc__.index("examples:"):])
    p.add_argument("--case", action="append", help="case(s): logits, fused_linear, token, token_logits, logprobs (default: all)")
    p.add_argument("--preset", action="append", help="named preset(s): a fixed setting and the targets it checks (see --list)")
    p.add_argument("--providers", action="append", help="provider names or globs, comma-separated (e.g. 'tpo:*,naive')")
    p.add_argument("--exclude", action="append", help="provider names or globs to leave out")
    p.add_argument("--dtype", action="append", help="fp32, bf16, fp16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--variant", action="append", help="dense, sparse90 (90%% of groups tied), zipf (Zipf-distributed candidates, token cases)")
    p.add_argument("--mode", action="append", help="forward, backward, full (default: all three; --quick: full)")
    p.add_argument("--shape", action="append", help="shape as NAME=INT,... e.g. G=8,K=8,T=128,V=32768 (replaces the grid)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
    p.add_argument("--quick", action="store_true", help="small shapes, fwd+bwd only, in-process: a fast first look")
    p.add_argument("--reduced", action="store_true", help="fewer repetitions (for a time-limited check)")
    p.add_argument("--out", help=f"output folder (default: ./{DEFAULT_OUT}/<run name> in the current folder)")
    p.add_argument("--warmup", type=int, help="warm-up runs per measurement")
    p.add_argument("--reps", type=int, help="exact number of timed repetitions (default: adaptive)")
    p.add_argument("--target-time", type=float, help="seconds of timed repetitions to aim for per measurement")
    p.add_argument("--isolate", dest="isolate", action="store_true", default=None, help="fresh subprocess per measurement (CPU default)")
    p.add_argument("--no-isolate", dest="isolate", action="store_false", help="measure in this process")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per isolated measurement (default 900)")
    p.add_argument("--budget", type=float, help="stop starting new measurements after this many seconds")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole plan this many times, interleaved (provider A, B, ..., then A, B, ... again), "
                        "and report the median of the rounds' medians (a shared machine's load spreads evenly)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads in each measurement")
    p.add_argument("--kernels", dest="kernels", action="store_true", default=None,
                   help="also time the logits path's kernels alone (row fwd, group op, row bwd); default on a GPU")
    p.add_argument("--no-kernels", dest="kernels", action="store_false")
    p.add_argument("--calibrate", dest="calibrate", action="store_true", default=None,
                   help="measure the copy bandwidth first (default on a GPU; on a CPU: memcpy bandwidth)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false")
    p.add_argument("--calibrate-bytes", type=int, help="calibration buffer size (default: GPU max(1 GiB, 32x L2), CPU 256 MiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--list", action="store_true", help="list cases, providers with availability, and presets; run nothing")
    p.add_argument("--report", metavar="DIR", help="only rebuild results.md, targets and plots from DIR/results.json")
    return p


# --------------------------------------------------------------------------- running


def _run_isolated(spec, timeout):
    """One spec in a fresh ``python -m tpo_kernels.bench.worker`` process."""
    from .harness import run_fresh_worker

    result = run_fresh_worker(["tpo_kernels.bench.worker"], spec, timeout)
    return _errors(spec, result) if isinstance(result, str) else result


def _ident(spec):
    return {k: spec[k] for k in ("case", "shape", "dtype", "variant", "provider")}


def _errors(spec, message, status="error"):
    return [dict(_ident(spec), mode=m, status=status, error=message) for m in spec["modes"]]


def _summary(r):
    from .report import MiB

    if r.get("status") != "ok":
        return f"ERROR {r.get('error', '')[:300]}"
    def ms(x):
        return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"

    s = f"{ms(r['time_s']['median'])} (min {ms(r['time_s']['min'])}, {r['reps']} reps), peak {r['peak_bytes'] / MiB:.0f} MiB"
    if r.get("check"):
        s += f", loss {r['check']['loss']:.6g}"
    return s


def main(argv=None) -> int:
    """Run the benchmark with ``argv``; returns the exit status. A usage error (a bad option or
    value, a device or provider that is not there, an output folder that cannot be written) is
    found before any measurement: one line on stderr and :class:`~tpo_kernels.usage.UsageError`
    (SystemExit with status 2)."""
    try:
        return _checked_main(argv)
    except UsageError as exc:
        exc.prog = PROG
        exc.report()
        raise


def _checked_main(argv) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from .plan import resolve_device

    _check_values(args)
    if args.report:
        return _rereport(args)
    device = resolve_device(args.device)
    if args.list:
        return _list(device)
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)  # for in-process measurements; workers set their own
    try:
        return _main(args, argv, device)
    finally:
        torch.set_num_threads(threads_before)


def _check_values(args) -> None:
    """The option values that argparse's types do not check, before any work (UsageError)."""
    import math

    from . import cases as C
    from .plan import csv, matches_any

    def at_least(option, value, minimum):
        if value is not None and not value >= minimum:
            raise UsageError(f"{option} must be at least {minimum}, got {value}")

    def positive(option, value):
        if value is not None and not 0 < value < math.inf:
            raise UsageError(f"{option} must be a finite number of seconds > 0, got {value}")

    at_least("--rounds", args.rounds, 1)
    at_least("--reps", args.reps, 1)
    at_least("--warmup", args.warmup, 0)
    at_least("--threads", args.threads, 1)
    at_least("--calibrate-bytes", args.calibrate_bytes, 1)
    positive("--target-time", args.target_time)
    positive("--timeout", args.timeout)
    if args.budget is not None and not 0 <= args.budget < math.inf:
        raise UsageError(f"--budget must be a finite number of seconds >= 0, got {args.budget}")
    for option, values, known in (("--dtype", args.dtype, C.DTYPES), ("--mode", args.mode, C.MODES)):
        unknown = [v for v in csv(values) or [] if v not in known]
        if unknown:
            raise UsageError(f"{option}: unknown value(s) {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    names = sorted({p.name for case in C.CASES.values() for p in case.providers})
    for option, patterns in (("--providers", args.providers), ("--exclude", args.exclude)):
        unknown = [pat for pat in csv(patterns) or [] if not any(matches_any(n, [pat]) for n in names)]
        if unknown:
            raise UsageError(f"{option}: {', '.join(map(repr, unknown))} matches no provider; providers: {', '.join(names)}")
    if args.report:
        results = os.path.join(args.report, "results.json")
        if not os.path.isfile(results):
            raise UsageError(f"--report: {results} does not exist")
        problem = output_folder_problem(args.report)
        if problem:
            raise UsageError(f"--report: {problem}")


def _main(args, argv, device) -> int:
    import torch

    from .plan import csv, plan, timing_defaults

    specs, skipped, targets, title = plan(args, device)
    run_name = (("-".join(csv(args.preset))) if args.preset else ("quick" if args.quick else "default")) + f"-{device.type}"
    out_dir = os.path.abspath(args.out or os.path.join(DEFAULT_OUT, run_name))
    problem = output_folder_problem(out_dir, parents=args.out is None)
    if problem:
        raise UsageError(f"--out: {problem}")
    isolate = args.isolate
    if args.budget is None and not args.preset and not args.quick and not args.shape and device.type == "cpu":
        args.budget = 540.0  # the default CPU run promises to finish in under 10 minutes
        print("default CPU grid: new measurements stop after 540 s (--budget to change)", flush=True)
    devices = {s["device"] for s in specs}
    use_cuda = any(d.startswith("cuda") for d in devices)
    if isolate is None:
        isolate = not use_cuda and not args.quick
    timing = timing_defaults(args, "cuda" if use_cuda else "cpu")
    meta = describe_machine(torch.device("cuda") if use_cuda else device)
    meta.update(
        title=title,
        presets=csv(args.preset) or [],
        command="tpo-kernels bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        started=_dt.datetime.now().isoformat(timespec="seconds"),
        timing=(
            "CUDA events around the timed region, L2 flushed before each repetition; median"
            if use_cuda
            else "time.perf_counter around the timed region; median"
        )
        + f" of adaptive repetitions (at least {timing['min_reps']}, at most {timing['max_reps']}, aiming at {timing['target_time']} s) after {timing['warmup']} warm-up run(s)",
        memory=(
            "torch.cuda.max_memory_allocated minus the allocation before the inputs were created (peak stats reset after warm-up)"
            if use_cuda
            else (
                "peak RSS increase (VmHWM) over the RSS measured before the inputs were allocated; each provider x shape runs in a fresh subprocess, its modes in the order forward, backward, full, with the high-water mark reset after each mode's warm-up (can only err upwards)"
                if isolate
                else "peak RSS increase (VmHWM) in the harness process, high-water mark reset per measurement (allocator caches can inflate it)"
            )
        ),
        memory_method="cuda" if use_cuda else ("rss-subprocess" if isolate else "rss-inprocess"),
        timing_params=timing,
    )
    run = {"meta": meta, "skipped": skipped, "results": [], "targets": [], "plots": []}
    json_path = os.path.join(out_dir, "results.json")
    n_meas = sum(len(s["modes"]) for s in specs)
    print(f"tpo-kernels bench: {title}; {n_meas} measurements in {len(specs)} runs; output {out_dir}", flush=True)
    print(f"  {meta['machine']}\n  {meta['software']}\n  memory: {meta['memory']}", flush=True)
    for s in skipped:
        print(f"  skip {s['case']}/{s['provider']}: {s['reason']}", flush=True)
    meta["load_average_start"] = loadavg()
    t_start = time.perf_counter()
    cal_device = torch.device("cuda") if use_cuda else device
    monitor = None
    if use_cuda:
        from .calibrate import ClockMonitor, smi_gpu_id

        monitor = ClockMonitor(smi_gpu_id(cal_device)).start()
    try:
        from ..selfcheck.heartbeat import Heartbeat

        # a line at least every PROGRESS_INTERVAL_S seconds, also while one measurement runs for minutes
        with Heartbeat(_print_line) as beat:
            run["calibration"] = _calibrate(args, cal_device, timing, beat)
            _measure_all(args, specs, timing, isolate, run, json_path, t_start, beat)
    finally:
        if monitor is not None:
            from .calibrate import clocks_text

            run["clocks"] = monitor.stop()
            print(f"  GPU clocks and power during the run: {clocks_text(run['clocks'])}", flush=True)
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    meta["load_average_end"] = loadavg()
    return _finish(run, targets, out_dir, args.no_plots)


def _print_line(line: str) -> None:
    print(line, flush=True)


def _calibrate(args, device, timing, beat: Heartbeat) -> dict:
    """The copy-bandwidth calibration of this run (``calibrate.copy_bandwidth``), or why not."""
    wanted = args.calibrate if args.calibrate is not None else device.type == "cuda"
    if not wanted:
        return {"skipped": "off on a CPU unless --calibrate" if device.type != "cuda" else "--no-calibrate"}
    from .calibrate import calibration_text, copy_bandwidth

    beat.stage("copy-bandwidth calibration")
    try:
        cal = copy_bandwidth(device, args.calibrate_bytes, reps=max(5, timing["min_reps"]))
    except Exception as exc:  # recorded; targets relative to it then say 'not measured'
        cal = {"skipped": f"calibration failed: {type(exc).__name__}: {exc}"}
    beat.say(f"  copy-bandwidth calibration: {calibration_text(cal)}")
    return cal


def _measure_all(args, specs, timing, isolate, run, json_path, t_start, beat: Heartbeat) -> None:
    from . import report as R

    by_round = []
    for round_index in range(args.rounds):
        run["results"] = [r for rs in by_round for r in rs]
        by_round.append(_measure_round(args, specs, timing, isolate, run, json_path, t_start,
                                       f"round {round_index + 1}/{args.rounds} " if args.rounds > 1 else "", beat))
    run["results"] = R.merge_rounds(by_round)
    R.write_json(run, json_path)


def _measure_round(args, specs, timing, isolate, run, json_path, t_start, prefix, beat: Heartbeat) -> list:
    """One pass over the plan; its results (also appended to ``run`` as they come)."""
    from . import cases as C
    from . import harness as H
    from . import report as R

    results = []
    for i, spec in enumerate(specs, 1):
        spec.update(timing)
        if args.threads:
            spec["threads"] = args.threads
        label = (f"{prefix}[{i}/{len(specs)}] {spec['case']} {C.shape_label(spec['shape'])} {spec['dtype']} "
                 f"{spec['variant']} {spec['provider']}")
        if args.budget is not None and time.perf_counter() - t_start > args.budget:
            rs = _errors(spec, f"time budget of {args.budget:.0f} s used up", status="skipped")
            beat.say(f"{label}: skipped (time budget)")
        else:
            beat.say(f"{label} ({', '.join(spec['modes'])})")
            beat.stage(label)
            t0 = time.perf_counter()
            if isolate and not spec["device"].startswith("cuda"):
                rs = _run_isolated(spec, args.timeout)
            else:
                rs = H.measure(spec)
            load = loadavg()
            for r in rs:
                r.setdefault("role", C.CASES[spec["case"]].provider(spec["provider"]).role)
                r["load_average"] = load
                beat.say(f"    {r['mode']:8s} {_summary(r)}")
            beat.say(f"    [{time.perf_counter() - t0:.1f} s]")
        results.extend(rs)
        run["results"].extend(rs)
        R.write_json(run, json_path)
    return results


def _finish(run, targets, out_dir, no_plots) -> int:
    from . import report as R

    R.derive(run["results"], run.get("calibration"))
    run["targets"] = R.evaluate_targets(targets, run["results"], run.get("calibration"))
    if not no_plots:
        run["plots"] = [os.path.basename(p) for p in R.plots(run, out_dir)]
    json_path, md_path = os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.md")
    R.write_json(run, json_path)
    md = R.markdown(run)
    with open(md_path, "w") as f:
        f.write(md + "\n")
    print()
    print(md)
    if run["targets"]:
        print("Targets:")
        print(R.targets_text(run["targets"]))
    print(f"\nwrote {json_path}, {md_path}" + (f" and {len(run['plots'])} plots" if run["plots"] else "") + f" in {run['meta'].get('elapsed_s')} s")
    return 0


def _rereport(args) -> int:
    from .presets import PRESETS

    out_dir = os.path.abspath(args.report)
    with open(os.path.join(out_dir, "results.json")) as f:
        run = json.load(f)
    presets = run["meta"].get("presets")
    if presets is None and run["meta"].get("title", "").startswith("preset "):
        presets = [p.strip() for p in run["meta"]["title"][len("preset "):].split(",")]
    unknown = [name for name in presets or [] if name not in PRESETS]
    if unknown:
        print(f"presets {', '.join(unknown)} are not defined here: their targets are not evaluated", flush=True)
    targets = [t for name in presets or [] if name in PRESETS for t in PRESETS[name].targets]
    for r in run["results"]:  # derived fields are recomputed
        for key in ("vs", "check_vs_reference", "throughput", "tokens_per_s"):
            r.pop(key, None)
        if isinstance(r.get("kernel"), dict):
            r["kernel"].pop("throughput", None)
    return _finish(run, targets, out_dir, args.no_plots)


def _list(device) -> int:
    from . import cases as C
    from .presets import PRESETS

    print(f"device: {device}")
    for case in C.CASES.values():
        print(f"\ncase {case.name}: {case.title}")
        for p in case.providers:
            reason = p.available(device)
            print(f"  {p.name:20s} {'ok' if reason is None else 'skip: ' + reason}  ({p.describe})")
    print("\npresets:")
    for p in PRESETS.values():
        print(f"  {p.name:24s} [{p.device}] {p.about}")
    return 0
