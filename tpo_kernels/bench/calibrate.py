"""What the device can do, measured in the same run: copy bandwidth, and the GPU's clocks and
power while the benchmarks ran.

* :func:`copy_bandwidth`: a device-to-device copy (``dst.copy_(src)``: every byte read once and
  written once, counted as ``2 * size`` bytes) and a read-only reduction (``src.sum()``, ``size``
  bytes) over a buffer much larger than the L2 cache (at least 1 GiB and 32x L2 on a GPU), median
  of repeated runs timed with CUDA events. Bandwidth targets are stated as fractions of the copy
  figure, so they hold the code to what this device delivers, not to a datasheet number. On a CPU
  the same measurement (``torch`` copy and sum of a 256 MiB buffer) gives the memcpy bandwidth;
  it runs there only when asked for.
* :class:`ClockMonitor`: ``nvidia-smi`` samples (SM and memory clocks, power, temperature,
  performance state) every 250 ms in a background process for the length of the run, plus the
  clock-event (throttle) reasons at the start and the end. Without ``nvidia-smi`` it records why.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch

GiB = 1 << 30
CPU_BUFFER_BYTES = 256 << 20


def _time(fn: Callable[[], object], device: torch.device, reps: int, warmup: int) -> List[float]:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        pairs = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) / 1e3 for s, e in pairs]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _summary(times: List[float], nbytes: int) -> dict:
    median = statistics.median(times)
    return {"gbps": nbytes / median / 1e9, "bytes": int(nbytes), "median_s": median, "min_s": min(times),
            "max_s": max(times), "reps": len(times)}


def buffer_bytes(device: torch.device, requested: Optional[int] = None) -> Dict[str, int]:
    """The calibration buffer's size: ``requested``, else on a GPU max(1 GiB, 32x L2) capped at a
    quarter of the free memory; on a CPU 256 MiB."""
    if device.type != "cuda":
        return {"bytes": int(requested or CPU_BUFFER_BYTES), "l2_bytes": 0}
    props = torch.cuda.get_device_properties(device)
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    size = int(requested or max(GiB, 32 * l2))
    free, _ = torch.cuda.mem_get_info(device)
    size = min(size, free // 4)  # source, destination, and room for everything else
    return {"bytes": size - size % 4096, "l2_bytes": l2}


def copy_bandwidth(device, nbytes: Optional[int] = None, reps: Optional[int] = None, warmup: int = 2) -> dict:
    """Device-to-device copy and read-only reduction bandwidth (GB/s = 1e9 bytes/s), see the
    module docstring. Returns a JSON-able dict; ``copy.gbps`` is the reference of the targets."""
    device = torch.device(device)
    sizes = buffer_bytes(device, nbytes)
    size = sizes["bytes"]
    reps = reps or (20 if device.type == "cuda" else 5)
    src = torch.empty(size // 4, dtype=torch.float32, device=device)
    src.fill_(1.0)  # touches every page, and a sum of ones is exact enough to check
    dst = torch.empty_like(src)
    copy_times = _time(lambda: dst.copy_(src), device, reps, warmup)
    read_times = _time(lambda: torch.sum(src), device, reps, warmup)
    result = {
        "device": str(device),
        "buffer_bytes": size,
        "l2_bytes": sizes["l2_bytes"],
        "copy": _summary(copy_times, 2 * size),
        "read": _summary(read_times, size),
        "method": (
            f"dst.copy_(src) of a {size / GiB:.2f} GiB fp32 buffer counted as 2x its size (read + write), and "
            f"src.sum() counted as its size (read only); median of {reps} runs after {warmup} warm-up, "
            + ("CUDA events" if device.type == "cuda" else f"time.perf_counter, {torch.get_num_threads()} torch threads")
        ),
    }
    src = dst = None  # free the buffers before the benchmarks
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def calibration_text(cal: Optional[dict]) -> str:
    if not cal:
        return "not measured"
    if cal.get("skipped"):
        return f"not measured ({cal['skipped']})"
    return (f"copy {cal['copy']['gbps']:.1f} GB/s, read-only reduction {cal['read']['gbps']:.1f} GB/s on {cal['device']} "
            f"({cal['method']}); bandwidth targets are fractions of the copy figure")


# --------------------------------------------------------------------------- nvidia-smi

SMI_FIELDS = ("timestamp", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.draw", "power.limit",
              "temperature.gpu", "pstate")
_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer name first


def smi_gpu_id(device: Optional[torch.device] = None) -> Optional[str]:
    """What ``nvidia-smi -i`` calls the torch device: the matching ``CUDA_VISIBLE_DEVICES`` entry
    (an index or a UUID), else the device index; None (all GPUs) for MIG entries."""
    index = 0
    if device is not None and device.index is not None:
        index = device.index
    elif torch.cuda.is_available():
        index = torch.cuda.current_device()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        if index >= len(visible) or visible[index].startswith("MIG"):
            return None
        return visible[index]
    return str(index)


def _number(text: str):
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "N/A", "[Not Supported]"


def parse_samples(text: str) -> List[dict]:
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(SMI_FIELDS):
            continue
        row = {"timestamp": parts[0], "pstate": parts[-1]}
        for name, value in zip(SMI_FIELDS[1:-1], parts[1:-1]):
            row[name] = _number(value)
        rows.append(row)
    return rows


def summarize_samples(rows: List[dict]) -> dict:
    out: Dict[str, object] = {"samples": len(rows)}
    if not rows:
        return out
    out["first"], out["last"] = rows[0]["timestamp"], rows[-1]["timestamp"]
    for name in SMI_FIELDS[1:-1]:
        values = [r[name] for r in rows if r.get(name) is not None]
        if values:
            out[name] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    out["pstates"] = sorted({r["pstate"] for r in rows})
    return out


class ClockMonitor:
    """Samples ``nvidia-smi`` in the background between :meth:`start` and :meth:`stop`.

    ``stop()`` returns ``{"available": True, "gpu", "interval_ms", "start", "end", "during"}`` (one
    query each at start and end, and the summary of the samples in between: min / median / max
    per field) or ``{"available": False, "reason": ...}``."""

    def __init__(self, gpu: Optional[str] = None, interval_ms: int = 250, exe: Optional[str] = None):
        self.gpu, self.interval_ms = gpu, int(interval_ms)
        self.exe = exe or shutil.which("nvidia-smi")
        self.proc: Optional[subprocess.Popen] = None
        self.file = None
        self.start_state: Optional[dict] = None
        self.reason: Optional[str] = None if self.exe else "nvidia-smi not found"

    def _base(self) -> List[str]:
        return [self.exe] + (["-i", self.gpu] if self.gpu is not None else [])

    def query(self) -> Optional[dict]:
        """One reading: the fields above plus the clock-event reasons (a hex bit mask) when the
        driver knows either name of that field."""
        try:
            out = subprocess.run(self._base() + [f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError) as exc:
            self.reason = f"nvidia-smi failed: {exc}"
            return None
        rows = parse_samples(out.stdout)
        if out.returncode != 0 or not rows:
            self.reason = f"nvidia-smi exited with {out.returncode}: {(out.stderr or out.stdout).strip()[:200]}"
            return None
        state = dict(rows[0])
        for field in _REASON_FIELDS:
            try:
                r = subprocess.run(self._base() + [f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=20)
            except (OSError, subprocess.SubprocessError):
                break
            if r.returncode == 0 and r.stdout.strip():
                state["clock_event_reasons"] = r.stdout.strip().splitlines()[0].strip()
                break
        return state

    def start(self) -> "ClockMonitor":
        if not self.exe:
            return self
        self.start_state = self.query()
        if self.start_state is None:
            return self
        self.file = tempfile.NamedTemporaryFile(mode="w+", prefix="tpo-smi-", suffix=".csv", delete=False)
        cmd = self._base() + [f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits", f"--loop-ms={self.interval_ms}"]
        try:
            self.proc = subprocess.Popen(cmd, stdout=self.file, stderr=subprocess.DEVNULL)
        except OSError as exc:
            self.reason = f"nvidia-smi failed: {exc}"
        return self

    def stop(self) -> dict:
        if self.start_state is None:
            return {"available": False, "reason": self.reason or "not started"}
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        samples: List[dict] = []
        if self.file is not None:
            self.file.flush()
            self.file.seek(0)
            samples = parse_samples(self.file.read())
            self.file.close()
            os.unlink(self.file.name)
        end = self.query()
        return {"available": True, "gpu": self.gpu, "interval_ms": self.interval_ms, "start": self.start_state,
                "end": end, "during": summarize_samples(samples)}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.result = self.stop()
        return False


def clocks_text(clocks: Optional[dict]) -> str:
    if not clocks:
        return "not recorded"
    if not clocks.get("available"):
        return f"not recorded ({clocks.get('reason')})"
    during = clocks.get("during", {})

    def span(name, unit):
        d = during.get(name)
        return f"{d['min']:.0f}/{d['median']:.0f}/{d['max']:.0f} {unit}" if d else "n/a"

    start, end = clocks.get("start") or {}, clocks.get("end") or {}
    limit = start.get("power.limit")
    text = (f"{during.get('samples', 0)} nvidia-smi samples every {clocks.get('interval_ms')} ms: SM clock min/median/max "
            f"{span('clocks.sm', 'MHz')} (max {start.get('clocks.max.sm') or 'n/a'} MHz), memory clock {span('clocks.mem', 'MHz')}, "
            f"power {span('power.draw', 'W')} (limit {limit if limit is not None else 'n/a'} W), temperature max "
            f"{during.get('temperature.gpu', {}).get('max', 'n/a')} C, P-states {','.join(during.get('pstates', [])) or 'n/a'}")
    reasons = [s.get("clock_event_reasons") for s in (start, end) if s.get("clock_event_reasons")]
    if reasons:
        text += f"; clock-event reasons at start/end {' / '.join(reasons)}"
    return text
