"""``tpo-kernels bench`` / ``python -m bench``: plan, run, report.

Examples::

    tpo-kernels bench                          # default grid for this device (CPU: < 10 min)
    tpo-kernels bench --quick                  # a few small shapes, fwd+bwd only (about a minute)
    tpo-kernels bench --preset issue4-cpu      # the exact setting of an issue's target, with its verdict
    tpo-kernels bench --case logits --shape G=8,K=8,T=128,V=32768 --providers 'tpo:*,naive' --mode full
    tpo-kernels bench --list                   # cases, providers (and why any is skipped), presets
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fnmatch
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _csv(values: Optional[List[str]]) -> Optional[List[str]]:
    if not values:
        return None
    out = []
    for v in values:
        out += [p.strip() for p in v.split(",") if p.strip()]
    return out or None


def build_parser(prog="tpo-kernels bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Benchmark tpo_kernels against the baselines users would pick instead.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--case", action="append", help="case(s): logits, fused_linear, token, token_logits, logprobs (default: all)")
    p.add_argument("--preset", action="append", help="named preset(s) reproducing an issue's target exactly (see --list)")
    p.add_argument("--providers", action="append", help="provider names or globs, comma-separated (e.g. 'tpo:*,naive')")
    p.add_argument("--exclude", action="append", help="provider names or globs to leave out")
    p.add_argument("--dtype", action="append", help="fp32, bf16, fp16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--variant", action="append", help="dense, sparse90 (90%% of groups tied)")
    p.add_argument("--mode", action="append", help="forward, backward, full (default: all three; --quick: full)")
    p.add_argument("--shape", action="append", help="shape as NAME=INT,... e.g. G=8,K=8,T=128,V=32768 (replaces the grid)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
    p.add_argument("--quick", action="store_true", help="small shapes, fwd+bwd only, in-process: a fast first look")
    p.add_argument("--reduced", action="store_true", help="fewer repetitions (used by bench/gpu_check.sh)")
    p.add_argument("--out", help="output folder (default: bench/out/<run name>)")
    p.add_argument("--warmup", type=int, help="warm-up runs per measurement")
    p.add_argument("--reps", type=int, help="exact number of timed repetitions (default: adaptive)")
    p.add_argument("--target-time", type=float, help="seconds of timed repetitions to aim for per measurement")
    p.add_argument("--isolate", dest="isolate", action="store_true", default=None, help="fresh subprocess per measurement (CPU default)")
    p.add_argument("--no-isolate", dest="isolate", action="store_false", help="measure in this process")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per isolated measurement (default 900)")
    p.add_argument("--budget", type=float, help="stop starting new measurements after this many seconds")
    p.add_argument("--threads", type=int, help="torch.set_num_threads in each measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--list", action="store_true", help="list cases, providers with availability, and presets; run nothing")
    p.add_argument("--report", metavar="DIR", help="only rebuild results.md, targets and plots from DIR/results.json")
    return p


# --------------------------------------------------------------------------- planning


def _device(arg: str):
    import torch

    if arg == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(arg)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch")
    return dev


def _match(name, patterns):
    return any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def plan(args, device):
    """-> (specs, skipped, targets, title)."""
    from . import cases as C

    specs, skipped, targets = [], [], []
    providers_arg, exclude = _csv(args.providers), _csv(args.exclude) or []
    dtypes_arg, variants_arg, modes_arg = _csv(args.dtype), _csv(args.variant), _csv(args.mode)
    shapes_arg = [C.parse_shape(s) for s in (args.shape or [])]
    jobs = []  # (device, Job, uses the built-in grid)
    presets = _csv(args.preset)
    if presets:
        for name in presets:
            if name not in C.PRESETS:
                raise SystemExit(f"unknown preset {name!r}; presets: {', '.join(C.PRESETS)}")
            pre = C.PRESETS[name]
            pdev = device if pre.device == "any" else _preset_device(pre.device)
            targets += pre.targets
            if pdev is None:
                for job in pre.jobs:
                    skipped.append({"case": job.case, "provider": "*", "reason": f"preset {name} needs a CUDA device; none here"})
                continue
            jobs += [(pdev, job, False) for job in pre.jobs]
        title = "preset " + ", ".join(presets)
    else:
        names = _csv(args.case) or list(C.CASES)
        for n in names:
            if n not in C.CASES:
                raise SystemExit(f"unknown case {n!r}; cases: {', '.join(C.CASES)}")
        dkind = "cuda" if device.type == "cuda" else "cpu"
        grid_key = ("quick-" if args.quick else "") + dkind
        for n in names:
            case = C.CASES[n]
            if shapes_arg:
                shapes = [s for s in shapes_arg if set(case.params) <= set(s)]
                if not shapes:
                    raise SystemExit(f"--shape for case {n!r} needs the keys {','.join(case.params)}")
            else:
                shapes = case.grids[grid_key]
            provs = [p.name for p in C.select_providers(case, None, dkind, args.quick)]
            modes = ["full"] if args.quick else list(C.DEFAULT_MODES[dkind].get(n, ("full",)))
            dtype = "fp32" if dkind == "cpu" else "bf16"
            jobs.append((device, C.Job(n, shapes, [dtype], ["dense"], provs, modes), not shapes_arg))
        title = ("quick" if args.quick else "default grid") + f" on {device.type}"

    for job_index, (dev, job, builtin_grid) in enumerate(jobs):
        case = C.CASES[job.case]
        limited = C.LIMITED_PROVIDERS["cuda" if dev.type == "cuda" else "cpu"] if (builtin_grid and not providers_arg) else set()
        names = [p.name for p in case.providers if _match(p.name, providers_arg or job.providers)]
        names = [n for n in names if not _match(n, exclude)]
        for pname in names:
            prov = case.provider(pname)
            reason = prov.available(dev)
            if reason is not None:
                if not any(s["case"] == job.case and s["provider"] == pname for s in skipped):
                    skipped.append({"case": job.case, "provider": pname, "reason": reason})
                continue
            shapes = shapes_arg if (presets and shapes_arg) else job.shapes
            for shape_index, raw in enumerate(shapes):
                variants = variants_arg or raw.get("_variants") or job.variants
                shape = {k: v for k, v in raw.items() if not k.startswith("_")}
                for dtype in dtypes_arg or job.dtypes:
                    for variant_index, variant in enumerate(variants):
                        if pname in limited and (pname not in raw.get("_with", ()) or variant != "dense"):
                            continue
                        specs.append(
                            {
                                "case": job.case,
                                "shape": shape,
                                "dtype": dtype,
                                "variant": variant,
                                "provider": pname,
                                "modes": [m for m in C.MODES if m in (modes_arg or job.modes)],
                                "device": str(dev),
                                "seed": args.seed,
                                "check": prov.role != "floor",
                                # presets run job by job; the built-in grids run every case's main shape first
                                "_order": ((job_index, shape_index) if presets else (shape_index, job_index))
                                + (dtype, variant_index, _ROLE_ORDER.get(prov.role, 9)),
                            }
                        )
    specs.sort(key=lambda s: s["_order"])
    for s in specs:
        del s["_order"]
    return specs, skipped, targets, title


_ROLE_ORDER = {"reference": 0, "ours": 1, "floor": 2, "baseline": 3}


def _preset_device(kind):
    import torch

    if kind == "cuda":
        return torch.device("cuda") if torch.cuda.is_available() else None
    return torch.device("cpu")


def _timing_defaults(args, device_type):
    if device_type == "cuda":
        d = dict(warmup=3, min_reps=10, max_reps=100, target_time=0.3)
        if args.reduced or args.quick:
            d = dict(warmup=2, min_reps=5, max_reps=25, target_time=0.1)
    else:
        d = dict(warmup=1, min_reps=3, max_reps=15, target_time=0.5)
        if args.reduced or args.quick:
            d = dict(warmup=1, min_reps=3, max_reps=10, target_time=0.3)
    if args.warmup is not None:
        d["warmup"] = args.warmup
    if args.reps is not None:
        d["min_reps"] = d["max_reps"] = args.reps
    if args.target_time is not None:
        d["target_time"] = args.target_time
    return d


# --------------------------------------------------------------------------- machine description


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def describe_machine(device) -> dict:
    import torch

    cpu_model = next((l.split(":", 1)[1].strip() for l in _read("/proc/cpuinfo").splitlines() if l.startswith("model name")), platform.processor() or "?")
    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:
        ncpu = os.cpu_count()
    mem_kb = next((int(l.split()[1]) for l in _read("/proc/meminfo").splitlines() if l.startswith("MemTotal")), 0)
    machine = f"{ncpu} usable CPU cores ({cpu_model}), {mem_kb / 2**20:.0f} GiB RAM, {platform.system()} {platform.machine()}"
    device_name = f"CPU ({ncpu} cores)"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device_name = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
        machine += f"; GPU: {device_name}"
    else:
        machine += "; no GPU used"
    try:
        import triton

        triton_v = triton.__version__
    except Exception:
        triton_v = "not installed"
    try:
        import tpo_kernels

        tk_v = tpo_kernels.__version__
        status = tpo_kernels.backend_status()
    except Exception as exc:
        tk_v, status = f"not importable ({exc})", {}
    commit = ""
    try:
        commit = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO_ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10).stdout.strip()
        if commit and dirty:
            commit += " (+ uncommitted changes)"
    except Exception:
        pass
    software = (
        f"Python {platform.python_version()}, torch {torch.__version__}, triton {triton_v}, tpo_kernels {tk_v}"
        + (f" at {commit}" if commit else "")
        + f", torch threads {torch.get_num_threads()}"
    )
    functions = {}
    try:
        from .cases import OUR_FUNCTIONS, our_function

        functions = {name: our_function(name)[1] for name in OUR_FUNCTIONS}
    except Exception as exc:
        functions = {"error": str(exc)}
    return {"machine": machine, "device_name": device_name, "software": software, "backend_status": status, "tpo_functions": functions}


# --------------------------------------------------------------------------- running


def _run_isolated(spec, timeout):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory(prefix="tpo-bench-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        try:
            proc = subprocess.run([sys.executable, "-m", "bench.worker", spec_path, out_path], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return _errors(spec, f"timed out after {timeout:.0f} s")
        if os.path.exists(out_path):
            with open(out_path) as f:
                return json.load(f)
        tail = (proc.stderr or "")[-1200:]
        return _errors(spec, f"worker exited with {proc.returncode} (killed for memory?): {tail}")


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
    args = build_parser().parse_args(argv)
    import torch

    from . import cases as C
    from . import harness as H
    from . import report as R

    if args.report:
        return _rereport(args)
    device = _device(args.device)
    if args.list:
        return _list(device)
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)  # for in-process measurements; workers set their own
    try:
        return _main(args, argv, device)
    finally:
        torch.set_num_threads(threads_before)


def _main(args, argv, device) -> int:
    import torch

    from . import cases as C
    from . import harness as H
    from . import report as R
    specs, skipped, targets, title = plan(args, device)
    run_name = (("-".join(_csv(args.preset))) if args.preset else ("quick" if args.quick else "default")) + f"-{device.type}"
    out_dir = os.path.abspath(args.out or os.path.join(REPO_ROOT, "bench", "out", run_name))
    os.makedirs(out_dir, exist_ok=True)
    isolate = args.isolate
    if args.budget is None and not args.preset and not args.quick and not args.shape and device.type == "cpu":
        args.budget = 540.0  # the default CPU run promises to finish in under 10 minutes
        print("default CPU grid: new measurements stop after 540 s (--budget to change)", flush=True)
    devices = {s["device"] for s in specs}
    use_cuda = any(d.startswith("cuda") for d in devices)
    if isolate is None:
        isolate = not use_cuda and not args.quick
    timing = _timing_defaults(args, "cuda" if use_cuda else "cpu")
    meta = describe_machine(torch.device("cuda") if use_cuda else device)
    meta.update(
        title=title,
        presets=_csv(args.preset) or [],
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
    json_path, md_path = os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.md")
    n_meas = sum(len(s["modes"]) for s in specs)
    print(f"tpo-kernels bench: {title}; {n_meas} measurements in {len(specs)} runs; output {out_dir}", flush=True)
    print(f"  {meta['machine']}\n  {meta['software']}\n  memory: {meta['memory']}", flush=True)
    for s in skipped:
        print(f"  skip {s['case']}/{s['provider']}: {s['reason']}", flush=True)
    meta["load_average_start"] = _loadavg()
    t_start = time.perf_counter()
    for i, spec in enumerate(specs, 1):
        spec.update(timing)
        if args.threads:
            spec["threads"] = args.threads
        label = (f"[{i}/{len(specs)}] {spec['case']} {C.shape_label(spec['shape'])} {spec['dtype']} "
                 f"{spec['variant']} {spec['provider']}")
        if args.budget is not None and time.perf_counter() - t_start > args.budget:
            rs = _errors(spec, f"time budget of {args.budget:.0f} s used up", status="skipped")
            print(f"{label}: skipped (time budget)", flush=True)
        else:
            print(f"{label} ({', '.join(spec['modes'])})", flush=True)
            t0 = time.perf_counter()
            if isolate and not spec["device"].startswith("cuda"):
                rs = _run_isolated(spec, args.timeout)
            else:
                rs = H.measure(spec)
            load = _loadavg()
            for r in rs:
                r.setdefault("role", C.CASES[spec["case"]].provider(spec["provider"]).role)
                r["load_average"] = load
                print(f"    {r['mode']:8s} {_summary(r)}", flush=True)
            print(f"    [{time.perf_counter() - t0:.1f} s]", flush=True)
        run["results"].extend(rs)
        R.write_json(run, json_path)
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    meta["load_average_end"] = _loadavg()
    return _finish(run, targets, out_dir, args.no_plots)


def _finish(run, targets, out_dir, no_plots) -> int:
    from . import report as R

    R.derive(run["results"])
    run["targets"] = R.evaluate_targets(targets, run["results"])
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
    from . import cases as C

    out_dir = os.path.abspath(args.report)
    with open(os.path.join(out_dir, "results.json")) as f:
        run = json.load(f)
    presets = run["meta"].get("presets")
    if presets is None and run["meta"].get("title", "").startswith("preset "):
        presets = [p.strip() for p in run["meta"]["title"][len("preset "):].split(",")]
    targets = [t for name in presets or [] for t in C.PRESETS[name].targets]
    for r in run["results"]:  # derived fields are recomputed
        for key in ("vs", "check_vs_reference", "throughput", "tokens_per_s"):
            r.pop(key, None)
    return _finish(run, targets, out_dir, args.no_plots)


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _list(device) -> int:
    from . import cases as C

    print(f"device: {device}")
    from .cases import OUR_FUNCTIONS, our_function

    for name in OUR_FUNCTIONS:
        print(f"  {name}: {our_function(name)[1]}")
    for case in C.CASES.values():
        print(f"\ncase {case.name}: {case.title}")
        for p in case.providers:
            reason = p.available(device)
            print(f"  {p.name:20s} {'ok' if reason is None else 'skip: ' + reason}  ({p.describe})")
    print("\npresets:")
    for p in C.PRESETS.values():
        print(f"  {p.name:12s} [{p.device}] {p.about}")
    return 0
