"""One TRL training step of a Qwen2-shaped model, four ways to compute the loss, side by side.

``python -m bench.trainer_step``, from the repository root (see bench/README.md, "Trainer step"). Variants:

* ``trl`` (a): TRL's stock ``GRPOTrainer`` loss (its default ``loss_type``, through TRL's own
  tiled log-prob head, which never holds the ``[tokens, V]`` logits).
* ``eager`` (b): the model's logits, then TPO in plain PyTorch (``baselines.naive_tpo_logits``:
  fp32 ``log_softmax`` over the vocabulary, gather, group softmax), as people write it.
* ``tpo_loss`` (c): the model's logits, then ``tpo_kernels.tpo_loss``.
* ``fused`` (d): ``TargetPOTrainer``, the fused-linear TPO head (hidden states and lm_head weight,
  no logits tensor).

Every variant drives ``trainer.training_step`` (forward, loss, backward; no optimizer update,
which is the same for all four) on one fixed batch of G prompts x K completions of a fixed
length, every completion token counted: generation is stubbed out (``_prepare_inputs`` returns the
batch), so all variants see the same tokens and scores from the same seed. The scores are random
rewards standardized per group (GRPO's advantages; TPO standardizes them again, a no-op).
Sampling temperature and TPO's eta are 1 (TRL's and TargetPOConfig's defaults, and what the eager
baseline computes).

Each variant runs in a fresh Python process (memory isolation): 1+ warm-up steps, then N timed
steps; the step time is their median. Loss-phase memory, per timed step, with the parameter
gradients freed before it (so the gradients the backward allocates count, the same for all four):

* CPU: the RSS high-water mark (VmHWM, reset through /proc/self/clear_refs after a malloc_trim)
  over the step minus the RSS just before it (``harness.reset_peak_rss``, ``peak_rss_bytes``).
* CUDA: ``torch.cuda.max_memory_allocated`` over the step (peak statistics reset just before it)
  minus ``memory_allocated`` before it.

The reported peak is the largest over the timed steps. It includes the backbone's activations and
the parameter gradients, both identical across variants (``grad_mib`` in the JSON).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from typing import List, Optional

import torch

from tpo_kernels.bench.harness import peak_rss_bytes, reset_peak_rss, rss_bytes, run_fresh_worker
from tpo_kernels.bench.machine import describe_machine, loadavg

from .experiment import bench_importable_in_children
from .trainer_step_setup import VARIANTS, StepSpec, build_batch, build_model, build_trainer

MIB = 2.0**20

# --------------------------------------------------------------------------- one variant, in this process


def measure_variant(variant: str, spec: StepSpec) -> dict:
    """Warm-up and timed ``training_step`` calls of one variant; see the module docstring."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory(prefix="tpo-step-") as out_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = build_trainer(variant, build_model(spec), spec, out_dir)
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop, which we bypass
        model = trainer.model
        batch = build_batch(spec, trainer.accelerator.device)

        def step():
            model.zero_grad(set_to_none=True)
            gc.collect()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            else:
                reset_peak_rss()
                base = rss_bytes()
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = trainer.training_step(model, batch, None)
            if cuda:
                torch.cuda.synchronize()
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            peak = (torch.cuda.max_memory_allocated(device) if cuda else peak_rss_bytes()) - base
            return float(loss), seconds, cpu_seconds, peak

        warm = [step() for _ in range(spec.warmup)]
        timed = [step() for _ in range(spec.reps)]
        grads = [p.grad for p in model.parameters() if p.grad is not None]  # of the last timed step
        grad_bytes = sum(g.numel() * g.element_size() for g in grads)
        grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])))
    times = [t for _, t, _, _ in timed]
    cpu_times = [c for _, _, c, _ in timed]
    return {
        "variant": variant,
        "label": VARIANTS[variant],
        "loss": timed[0][0],
        "losses": [x[0] for x in warm + timed],
        "peak_mib": max(x[3] for x in timed) / MIB,
        "peaks_mib": [x[3] / MIB for x in timed],
        "grad_mib": grad_bytes / MIB,
        "grad_norm": grad_norm,
        "time_s": {"median": statistics.median(times), "min": min(times), "max": max(times), "all": times},
        "cpu_s": {"median": statistics.median(cpu_times), "all": cpu_times},  # process CPU time, all threads
        "threads": torch.get_num_threads(),
    }


def _worker(argv: List[str]) -> int:
    with open(argv[0]) as f:
        job = json.load(f)
    result = measure_variant(job["variant"], StepSpec(**job["spec"]))
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


def run_fresh(variant: str, spec: StepSpec, timeout: float = 3600.0) -> dict:
    """``measure_variant`` in a fresh Python process that imports the tpo_kernels imported here."""
    with bench_importable_in_children():
        result = run_fresh_worker(["bench.trainer_step", "--worker"], {"variant": variant, "spec": asdict(spec)},
                                  timeout)
    if isinstance(result, str):
        return {"variant": variant, "label": VARIANTS[variant], "error": result}
    return result


# --------------------------------------------------------------------------- the run, the table


def run(spec: StepSpec, variants: List[str], log=print) -> dict:
    load_start = loadavg()
    results = []
    for variant in variants:
        log(f"{VARIANTS[variant]} ...")
        results.append(run_fresh(variant, spec))
        r = results[-1]
        log(f"  {r['error']}" if "error" in r else
            f"  loss {r['loss']:.6g}  peak {r['peak_mib']:.0f} MiB  step {r['time_s']['median']:.2f} s")
    base = next((r for r in results if r["variant"] == "trl" and "error" not in r), None)
    for r in results:
        if base is not None and "error" not in r:
            r["memory_vs_trl"] = r["peak_mib"] / base["peak_mib"]
            r["time_vs_trl"] = r["time_s"]["median"] / base["time_s"]["median"]
    return {
        "benchmark": "trainer-step",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "spec": asdict(spec),
        "loss_tokens": spec.loss_tokens,
        "memory_method": ("cuda max_memory_allocated" if spec.device.startswith("cuda") else "rss-subprocess")
        + ": peak over one training_step minus the memory before it (parameter gradients freed before)",
        "machine": {**describe_machine(torch.device(spec.device)), "loadavg_start": load_start,
                    "loadavg_end": loadavg()},
        "results": results,
    }


def markdown(report: dict) -> str:
    s = report["spec"]
    lines = [
        f"Qwen2-shaped model: V={s['vocab']}, H={s['hidden']}, {s['layers']} layers, tied embeddings; "
        f"G={s['groups']} x K={s['group_size']} completions of {s['completion_len']} tokens after "
        f"{s['prompt_len']}-token prompts ({report['loss_tokens']} loss tokens); {s['device']}, fp32, "
        f"median of {s['reps']} steps after {s['warmup']} warm-up.",
        "",
        "| variant | loss | loss-phase peak (MiB) | vs (a) | step time (s) | vs (a) | process CPU (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['label']} | error: {r['error'].splitlines()[0][:80]} | | | | | |")
            continue
        mem_ratio = f"{r['memory_vs_trl']:.2f}x" if "memory_vs_trl" in r else "-"
        time_ratio = f"{r['time_vs_trl']:.2f}x" if "time_vs_trl" in r else "-"
        lines.append(f"| {r['label']} | {r['loss']:.6g} | {r['peak_mib']:.0f} | {mem_ratio} | "
                     f"{r['time_s']['median']:.2f} | {time_ratio} | {r['cpu_s']['median']:.1f} |")
    grads = [r["grad_mib"] for r in report["results"] if "grad_mib" in r]
    if grads:
        lines += ["", f"Each peak includes the parameter gradients ({max(grads):.0f} MiB) and the backbone's "
                      "activations, the same for every variant."]
    lines += ["", "Step time: median wall clock of the timed steps; process CPU: their median CPU time summed "
                  "over the worker's threads (less sensitive to other processes on the machine)."]
    lines += ["", f"Machine: {report['machine']['machine']}; load average {report['machine']['loadavg_start']} "
                  f"-> {report['machine']['loadavg_end']}.", f"Memory: {report['memory_method']}."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    d = StepSpec()
    p = argparse.ArgumentParser(prog="python -m bench.trainer_step",
                                description="One TRL training step, four TPO/GRPO loss paths, each in a fresh process.")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    for name in ("vocab", "hidden", "layers", "intermediate", "heads", "kv_heads", "groups", "group_size",
                 "prompt_len", "completion_len", "warmup", "reps", "seed", "threads"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--device", default=d.device, help="cpu or cuda")
    p.add_argument("--backend", default=d.backend, help="tpo_kernels backend of (c) and (d)")
    p.add_argument("--out", default="bench/results/trainer-step", help="folder for results.json and results.md")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    args = build_parser().parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise SystemExit(f"--variants: unknown {unknown} (choose from {', '.join(VARIANTS)})")
    spec = StepSpec(**{k: v for k, v in vars(args).items() if k in StepSpec.__dataclass_fields__})
    smallest = {"group_size": 2, "seed": 0, "threads": 0}  # every other size is >= 1
    for name, value in asdict(spec).items():
        if isinstance(value, int) and value < smallest.get(name, 1):
            raise SystemExit(f"--{name.replace('_', '-')} must be >= {smallest.get(name, 1)}, got {value}")
    report = run(spec, variants)
    os.makedirs(args.out, exist_ok=True)
    table = markdown(report)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({**report, "argv": argv}, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    print()
    print(table)
    print(f"wrote {args.out}/results.json, {args.out}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
