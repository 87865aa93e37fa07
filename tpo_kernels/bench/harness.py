"""Timing and memory measurement of one (case, shape, dtype, variant, provider, mode).

Timing. After warm-up (which includes torch.compile's compilation and lazy extension loading),
each repetition runs the untimed setup (zeroing gradients; for ``backward`` also the forward) and
then the timed region; the median is reported with min/max and the repetition count.
CPU: ``time.perf_counter``. CUDA: a pair of CUDA events around the timed region on the current
stream, a 256 MiB buffer written before each repetition to flush L2, one synchronize at the end.

Agreement. Before anything is timed, a provider with ``spec["check"]`` runs once on small float64
inputs next to the case's reference provider (``naive``) on the same values; its loss and every
gradient must agree within ``FLOAT64_RTOL`` of the largest reference entry (peers that compute in
fp32 internally land near 1e-7), else the measurement is an error and nothing is timed. The
maximum relative difference is reported as ``check_fp64``.

Kernel-only times (``spec["kernels"]``, logits case, tpo_kernels providers): after the modes, the
backend's row forward, group op and row backward alone on the same inputs (``kernel_times``),
attached to the ``full`` result as ``kernel``.

Memory (peak bytes over a baseline taken *before the inputs are allocated*, so the inputs and
everything the computation allocates count):

* CUDA: ``torch.cuda.max_memory_allocated() - memory_allocated_before_inputs``, with the peak
  statistics reset after warm-up.
* CPU, ``rss-subprocess`` (default): each (case, shape, dtype, variant, provider) runs in a fresh
  Python subprocess, its modes in the order forward, backward, full. The kernel's RSS high-water
  mark (VmHWM, reset through /proc/self/clear_refs) is reset after the imports and again after
  each mode's warm-up; the reported peak is the high-water mark over that mode's timed
  repetitions minus the RSS measured after the imports, before the inputs existed. One-time costs
  of warm-up (compilation) do not count; what stays resident (inputs, compiled code, memory the
  allocator kept from an earlier mode) does, so the figure can only err upwards.
* CPU, ``rss-inprocess`` (``--no-isolate``): the same high-water mark in the harness process
  between measurements. Memory the allocator kept from an earlier measurement can inflate it
  (never deflate it), so use it for quick looks only.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import List, Optional, Union

import torch

from . import cases as C
from . import kernel_times


# --------------------------------------------------------------------------- RSS


def _status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    kb = _status_kb("VmRSS")
    if kb is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return kb * 1024


def _malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so RSS reflects live allocations."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
        except OSError:
            _LIBC = False
    if _LIBC:
        try:
            _LIBC.malloc_trim(0)
        except AttributeError:
            pass


_LIBC = None


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux >= 4.0)."""
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    kb = _status_kb("VmHWM")
    if kb is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return kb * 1024


# --------------------------------------------------------------------------- timing


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(64 << 20, dtype=torch.int32, device=device) if self.cuda else None

    def run(self, runner, mode: str, reps: int):
        times = []
        events = []
        for _ in range(reps):
            runner.zero_grad()
            state = runner.forward() if mode == "backward" else None
            if self.cuda:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                _timed(runner, mode, state)
                end.record()
                events.append((start, end))
            else:
                t0 = time.perf_counter()
                _timed(runner, mode, state)
                times.append(time.perf_counter() - t0)
            del state
        if self.cuda:
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) / 1e3 for s, e in events]
        runner.zero_grad()
        return times


def _timed(runner, mode, state):
    if mode == "forward":
        out = runner.forward()
        del out
    elif mode == "backward":
        runner.backward(state)
    else:
        runner.backward(runner.forward())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- one measurement


def measure(spec: dict) -> list:
    """Run the measurements described by ``spec`` (JSON-able) in this process: one result dict per
    mode in ``spec["modes"]``, measured in that order on the same inputs.

    spec keys: case, shape, dtype, variant, provider, modes, device, seed, warmup, min_reps,
    max_reps, target_time, check.
    """
    ident = {k: spec[k] for k in ("case", "shape", "dtype", "variant", "provider")}
    device = torch.device(spec["device"])
    case = C.CASES[spec["case"]]
    provider = case.provider(spec["provider"])
    dtype = C.DTYPES[spec["dtype"]]
    results = []
    check = None
    try:
        check_fp64 = _float64_check(case, provider, spec, device) if spec.get("check") else None
        if check_fp64 is not None and check_fp64.get("ok") is False:
            error = (f"float64 check against {REFERENCE_PROVIDER} failed before timing: max relative difference "
                     f"{check_fp64['max_rel_diff']:.3g} > {FLOAT64_RTOL:g} ({check_fp64['worst']})")
            return [dict(ident, mode=m, role=provider.role, status="error", error=error, check_fp64=check_fp64)
                    for m in spec["modes"]]
        if spec.get("prime", True) and provider.name != "compile":
            _prime(case, provider, spec, device, dtype)
        timer = _Timer(device)  # its L2-flush buffer exists before the baseline
        gc.collect()
        memory_note = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(device)
        else:
            can_reset = reset_peak_rss()
            base = rss_bytes() if can_reset else peak_rss_bytes()
            memory_note = None if can_reset else "VmHWM reset unavailable: peak since process start"
        inputs = case.make_inputs(spec["shape"], dtype, device, spec["variant"], spec["seed"])
        runner = provider.build(inputs, spec["shape"])
        check_s = None
        if spec.get("check") and hasattr(runner, "check"):
            t0 = time.perf_counter()
            check = runner.check()
            _sync(device)
            check_s = time.perf_counter() - t0
            if spec["modes"][0] != "full":
                # the check may have overwritten in-place buffers: rebuild from fresh inputs
                del runner
                inputs = case.make_inputs(spec["shape"], dtype, device, spec["variant"], spec["seed"])
                runner = provider.build(inputs, spec["shape"])
                check_s = None
    except Exception as exc:
        err = f"{type(exc).__name__}: {exc}"
        tb = traceback.format_exc(limit=8)
        return [dict(ident, mode=m, role=provider.role, status="error", error=err, traceback=tb) for m in spec["modes"]]
    for mode in spec["modes"]:
        result = dict(ident, mode=mode, role=provider.role)
        if check is not None:
            result["check"], check = check, None  # reported once, on the first mode
        if check_fp64 is not None:
            result["check_fp64"], check_fp64 = check_fp64, None
        if memory_note:
            result["memory_note"] = memory_note
        try:
            # a check run (one forward+backward) doubles as the first warm-up run of "full"
            credit = 1 if (check_s is not None and mode == "full" and mode == spec["modes"][0]) else 0
            t0 = time.perf_counter()
            warm = timer.run(runner, mode, max(1, spec["warmup"]) - credit)
            warm_wall = time.perf_counter() - t0
            est = min(warm) if warm else (check_s if credit else warm_wall)
            reps = int(max(spec["min_reps"], min(spec["max_reps"], spec["target_time"] / max(est, 1e-6))))
            gc.collect()
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            else:
                reset_peak_rss()
            times = timer.run(runner, mode, reps)
            _sync(device)
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) - base
            else:
                peak = peak_rss_bytes() - base
            result.update(
                status="ok",
                reps=len(times),
                warmup=len(warm) + credit,
                time_s={
                    "median": statistics.median(times),
                    "min": min(times),
                    "max": max(times),
                    "mean": statistics.fmean(times),
                },
                peak_bytes=int(peak),
                input_bytes=inputs.input_bytes,
                kept_grad_bytes=inputs.kept_grad_bytes if mode != "forward" else 0,
                tied_groups=inputs.tied_groups,
                num_groups=inputs.num_groups,
            )
            result["extra_bytes"] = result["peak_bytes"] - result["input_bytes"] - result["kept_grad_bytes"]
            if getattr(runner, "logits_cache_bytes", None) is not None:
                result["logits_cache_bytes"] = int(runner.logits_cache_bytes)
            if inputs.stats:
                result["input_stats"] = inputs.stats
        except Exception as exc:  # recorded, the run goes on
            result.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=8))
        results.append(result)
    if spec.get("kernels"):
        _kernel_only(case, provider, spec, device, inputs, timer, results)
    del runner, inputs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def _kernel_only(case, provider, spec, device, inputs, timer, results) -> None:
    """Kernel-only stage times of the logits path (see ``kernel_times``), attached as ``kernel`` to
    the ``full`` result (else the last measured mode) of a tpo_kernels provider."""
    backend = kernel_times.backend_of(provider.name)
    ok = [r for r in results if r.get("status") == "ok"]
    if case.name != "logits" or backend is None or not ok:
        return
    target = next((r for r in ok if r["mode"] == "full"), ok[-1])
    try:
        stages = kernel_times.logits_stages(inputs, spec["shape"], backend, device)
        target["kernel"] = kernel_times.measure_stages(stages, timer, spec)
    except Exception as exc:  # recorded; the end-to-end figures stand
        target["kernel"] = {"error": f"{type(exc).__name__}: {exc}"}


REFERENCE_PROVIDER = "naive"
FLOAT64_RTOL = 1e-4


def _tiny_shape(shape: dict) -> dict:
    tiny = {k: min(v, 8) if k in ("G", "T", "R", "M") else v for k, v in shape.items()}
    tiny.update({k: min(shape[k], 256) for k in ("V",) if k in shape})
    tiny.update({k: min(shape[k], 32) for k in ("H",) if k in shape})
    return tiny


def _float64_results(case, provider, spec, device) -> list:
    """Loss and gradients of one forward and backward on the small float64 inputs."""
    inputs = case.make_inputs(_tiny_shape(spec["shape"]), torch.float64, device, spec["variant"], spec["seed"])
    runner = provider.build(inputs, _tiny_shape(spec["shape"]))
    runner.zero_grad()
    loss = runner.forward()
    runner.backward(loss)
    return [("loss", loss.detach().reshape(-1))] + [(name, t.grad) for name, t in inputs.leaves.items()
                                                    if t.grad is not None]


def _float64_check(case, provider, spec, device) -> Optional[dict]:
    """The provider against the reference provider on small float64 inputs (see the module
    docstring); None for the reference itself, ``{"error": ...}`` when the provider cannot run in
    float64 (the run goes on; the fp32 check against the reference still applies)."""
    if provider.name == REFERENCE_PROVIDER or REFERENCE_PROVIDER not in {p.name for p in case.providers}:
        return None
    try:
        got = dict(_float64_results(case, provider, spec, device))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    want = _float64_results(case, case.provider(REFERENCE_PROVIDER), spec, device)
    diffs = {}
    for name, ref in want:
        value = got.get(name)
        if value is None or value.shape != ref.shape:
            diffs[name] = float("inf")
        else:
            scale = float(ref.abs().max()) or 1.0
            diffs[name] = float((value.double() - ref).abs().max()) / scale
    worst = max(diffs, key=diffs.get)
    return {"ok": diffs[worst] <= FLOAT64_RTOL, "max_rel_diff": diffs[worst], "worst": worst, "rel_diff": diffs}


def _prime(case, provider, spec, device, dtype):
    """Run the provider once on tiny inputs, so lazy imports and extension loads happen before the
    memory baseline (they are not part of the measured computation)."""
    tiny = _tiny_shape(spec["shape"])
    try:
        inputs = case.make_inputs(tiny, dtype, device, spec["variant"], spec["seed"])
        runner = provider.build(inputs, tiny)
        runner.zero_grad()
        runner.backward(runner.forward())
        runner.zero_grad()
    except Exception:
        pass  # the real run reports errors


# --------------------------------------------------------------------------- subprocess worker


def run_fresh_worker(command: List[str], job, timeout: float) -> Union[dict, list, str]:
    """``python -m *command JOB.json OUT.json`` in a fresh process (memory isolation), run in the
    folder that holds the tpo_kernels imported here so that the worker imports that same package.
    Returns what the worker wrote to OUT.json, or an error message when it wrote nothing."""
    import tpo_kernels

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(tpo_kernels.__file__)))
    with tempfile.TemporaryDirectory(prefix="tpo-bench-") as tmp:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        try:
            proc = subprocess.run([sys.executable, "-m", *command, job_path, out_path], cwd=package_parent,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s"
        if os.path.exists(out_path):
            with open(out_path) as f:
                return json.load(f)
        tail = (proc.stderr or "")[-1500:]
        return f"worker exited with {proc.returncode} (killed for memory?): {tail}"



def worker_main(argv=None) -> int:
    """``python -m tpo_kernels.bench.worker SPEC.json OUT.json``: one measurement in a fresh process."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    torch.manual_seed(spec["seed"])
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    results = measure(spec)
    for r in results:
        r["threads"] = torch.get_num_threads()
    with open(argv[1], "w") as f:
        json.dump(results, f)
    return 0
