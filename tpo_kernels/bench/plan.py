"""From command-line arguments to the list of measurements (specs) to run, and their timing."""

from __future__ import annotations

import fnmatch
from typing import List, Optional

from ..usage import UsageError
from . import cases as C
from .inputs import VARIANTS
from .presets import PRESETS, Job

_ROLE_ORDER = {"reference": 0, "ours": 1, "floor": 2, "baseline": 3}


def csv(values: Optional[List[str]]) -> Optional[List[str]]:
    """Repeated and comma-separated option values -> one list (None when empty)."""
    if not values:
        return None
    out = []
    for v in values:
        out += [p.strip() for p in v.split(",") if p.strip()]
    return out or None


def matches_any(name, patterns):
    """``name`` matches one of the provider names or globs ``patterns``."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def resolve_device(arg: Optional[str], prog: str = "tpo-kernels bench"):
    """``--device`` of the command ``prog``: auto or None (cuda when present, else cpu), cpu or
    cuda[:index] (a UsageError when it is not there)."""
    from ..selfcheck import usable_device

    try:
        return usable_device(None if arg == "auto" else arg)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}", prog) from None


def _preset_device(kind):
    import torch

    if kind == "cuda":
        return torch.device("cuda") if torch.cuda.is_available() else None
    return torch.device("cpu")


def _points(shapes) -> List[C.GridPoint]:
    return [s if isinstance(s, C.GridPoint) else C.GridPoint(dict(s)) for s in shapes]


def plan(args, device):
    """-> (specs, skipped, targets, title). A spec is the JSON-able description of one provider
    x shape x dtype x variant, with the modes to measure on it."""
    specs, skipped, targets = [], [], []
    providers_arg, exclude = csv(args.providers), csv(args.exclude) or []
    dtypes_arg, variants_arg, modes_arg = csv(args.dtype), csv(args.variant), csv(args.mode)
    try:
        shapes_arg = [C.parse_shape(s) for s in (args.shape or [])]
    except ValueError as exc:
        raise UsageError(f"--shape: {exc}") from None
    for shape in shapes_arg:
        small = {k: v for k, v in shape.items() if v < 1}
        if small:
            raise UsageError(f"--shape: sizes must be at least 1, got {', '.join(f'{k}={v}' for k, v in small.items())}")
    for name in variants_arg or []:
        if name not in VARIANTS:
            raise UsageError(f"--variant: unknown variant {name!r}; variants: {', '.join(VARIANTS)}")
    jobs = []  # (device, Job, grid points, uses the built-in grid)
    presets = csv(args.preset)
    if presets:
        for name in presets:
            if name not in PRESETS:
                raise UsageError(f"--preset: unknown preset {name!r}; presets: {', '.join(PRESETS)}")
            pre = PRESETS[name]
            pdev = device if pre.device == "any" else _preset_device(pre.device)
            targets += pre.targets
            if pdev is None:
                for job in pre.jobs:
                    skipped.append({"case": job.case, "provider": "*", "reason": f"preset {name} needs a CUDA device; none here"})
                continue
            jobs += [(pdev, job, _points(shapes_arg or job.shapes), False) for job in pre.jobs]
        title = "preset " + ", ".join(presets)
    else:
        names = csv(args.case) or list(C.CASES)
        for n in names:
            if n not in C.CASES:
                raise UsageError(f"--case: unknown case {n!r}; cases: {', '.join(C.CASES)}")
        dkind = "cuda" if device.type == "cuda" else "cpu"
        grid_key = ("quick-" if args.quick else "") + dkind
        for n in names:
            case = C.CASES[n]
            if shapes_arg:
                points = _points(s for s in shapes_arg if set(case.params) <= set(s))
                if not points:
                    raise UsageError(f"--shape for case {n!r} needs the keys {','.join(case.params)}")
            else:
                points = case.grids[grid_key]
            provs = [p.name for p in C.select_providers(case, None, dkind, args.quick)]
            modes = ["full"] if args.quick else list(C.DEFAULT_MODES[dkind].get(n, ("full",)))
            dtype = "fp32" if dkind == "cpu" else "bf16"
            job = Job(n, [p.shape for p in points], [dtype], ["dense"], provs, modes)
            jobs.append((device, job, points, not shapes_arg))
        title = ("quick" if args.quick else "default grid") + f" on {device.type}"

    kernels_arg = getattr(args, "kernels", None)
    ordered = []
    for job_index, (dev, job, points, builtin_grid) in enumerate(jobs):
        case = C.CASES[job.case]
        limited = C.LIMITED_PROVIDERS["cuda" if dev.type == "cuda" else "cpu"] if (builtin_grid and not providers_arg) else set()
        names = [p.name for p in case.providers if matches_any(p.name, providers_arg or job.providers)]
        names = [n for n in names if not matches_any(n, exclude)]
        for pname in names:
            prov = case.provider(pname)
            reason = prov.available(dev)
            if reason is not None:
                if not any(s["case"] == job.case and s["provider"] == pname for s in skipped):
                    skipped.append({"case": job.case, "provider": pname, "reason": reason})
                continue
            for shape_index, point in enumerate(points):
                variants = variants_arg or point.variants or job.variants
                for dtype in dtypes_arg or job.dtypes:
                    for variant_index, variant in enumerate(variants):
                        if pname in limited and (pname not in point.costly or variant != "dense"):
                            continue
                        # presets run job by job; the built-in grids run every case's main shape first
                        order = ((job_index, shape_index) if presets else (shape_index, job_index)) + (
                            dtype, variant_index, _ROLE_ORDER.get(prov.role, 9))
                        ordered.append((order, {
                            "case": job.case,
                            "shape": dict(point.shape),
                            "dtype": dtype,
                            "variant": variant,
                            "provider": pname,
                            "modes": [m for m in C.MODES if m in (modes_arg or job.modes)],
                            "device": str(dev),
                            "seed": args.seed,
                            "check": prov.role != "floor",
                            # kernel-only stage times next to the end-to-end call (GPU default)
                            "kernels": bool((dev.type == "cuda" if kernels_arg is None else kernels_arg)
                                            and job.case == "logits" and prov.role == "ours"),
                        }))
    ordered.sort(key=lambda pair: pair[0])
    specs = [spec for _, spec in ordered]
    return specs, skipped, targets, title


def timing_defaults(args, device_type) -> dict:
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
