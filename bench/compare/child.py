"""One side's timing process of ``python -m bench.compare``: the fixed suite, timed in a fresh
interpreter that imports the tpo_kernels of the tree it was started in.

The parent runs this file's source as ``python -c SOURCE CONFIG_JSON`` with that side's tree as the
working folder and first on PYTHONPATH, so the file must stand alone: it imports only the standard
library, torch and tpo_kernels (never ``bench``, which the base tree may lack or hold in another
form). It prints one line, ``RESULT_MARKER`` followed by JSON: the process (pid, torch threads, the
tpo_kernels file and the commit in its ``_build_info``) and, per case, the seconds of one
forward+backward call (the minimum over the samples: on a loaded machine the other processes only
ever add time) or the error that kept the case from running (a function or keyword this tree lacks,
a backend not built).

Every case uses the public API only and the same seeded inputs on both sides; a case's inputs are
leaves prepared outside the timed region, and the logits of the logits cases are the clone of a leaf
(not leaves themselves), so that the default in-place backward runs as it does in training.
"""

from __future__ import annotations

import fnmatch
import json
import os
import resource
import statistics
import sys
import time

RESULT_MARKER = "@@bench.compare.result@@ "
# Every sample is one call, and fast cases take more samples than asked, until they add up to
# MIN_CASE_SECONDS (at most MAX_SAMPLES): on a loaded machine a millisecond call is often stretched
# many times over by a thread that waits for a core, and its minimum needs one undisturbed call.
MIN_CASE_SECONDS = 0.5
MAX_SAMPLES = 30


# ------------------------------------------------------------------------------------- the inputs


def _sequence_batch(torch, shape, device, dtype, sparse=False):
    """Labels ``[N, T]`` and scores ``[N]`` of ``N = G * K`` completions; ``sparse``: every group but
    the first has tied scores (zero-signal groups, which the backward skips)."""
    n, t, v, k = shape["N"], shape["T"], shape["V"], shape["K"]
    labels = torch.randint(0, v, (n, t), device=device)
    scores = torch.randn(n, device=device, dtype=torch.float32)
    if sparse:
        scores[k:] = 1.0
    return labels, scores


def _logits_leaf(torch, rows, shape, device, dtype):
    return (torch.randn(*rows, shape["V"], device=device, dtype=torch.float32) * 2).to(dtype)


def _head(torch, rows, shape, device, dtype):
    hidden = torch.randn(*rows, shape["H"], device=device, dtype=torch.float32).to(dtype)
    weight = (torch.randn(shape["V"], shape["H"], device=device, dtype=torch.float32) * shape["H"] ** -0.5).to(dtype)
    return hidden, weight


def _fresh(*tensors):
    """New leaves over the same storage (so no gradient accumulates between samples)."""
    return [t.detach().requires_grad_() for t in tensors]


def _logits_view(logits):
    """The activation a model hands over: a non-leaf (the clone of a leaf, whose backward only
    passes the gradient on), so the loss may take its in-place backward."""
    leaf = logits.clone().requires_grad_()
    return leaf.clone()


def _backward(torch, out):
    loss = out[0] if isinstance(out, (tuple, list)) else out
    if loss.dim() > 0:  # per-token log-probs: a fixed weighting of them
        loss = (loss.float() * torch.linspace(-1.0, 1.0, loss.numel(), device=loss.device).view(loss.shape)).sum()
    loss.backward()


# ------------------------------------------------------------------------------------- the suite
# Each builder takes (torch, tpo_kernels, backend, shape, device, dtype) and returns (prepare, step):
# prepare() gives a call's fresh inputs (untimed), step(inputs) runs forward and backward (timed).


def _tpo_loss(variant):
    def build(torch, tk, backend, shape, device, dtype):
        n, t, k = shape["N"], shape["T"], shape["K"]
        labels, scores = _sequence_batch(torch, shape, device, dtype, sparse=variant == "sparse")
        if variant == "strided":  # logits[:, :-1] of a [N, T + 1, V] activation
            full = _logits_leaf(torch, (n, t + 1), shape, device, dtype)
            prepare = lambda: _logits_view(full)[:, :-1]  # noqa: E731
        else:
            logits = _logits_leaf(torch, (n, t), shape, device, dtype)
            prepare = lambda: _logits_view(logits)  # noqa: E731
        step = lambda z: _backward(torch, tk.tpo_loss(z, labels, scores, group_size=k, backend=backend))  # noqa: E731
        return prepare, step
    return build


def _kept_sets(torch, labels, vocab):
    """Padded kept sets ``[N, T, 8]`` of top-k / top-p replay: the label, then distinct ids (the
    label plus multiples of a prime, mod V), -1 past each set's size: 1 for about half the tokens,
    else 2 to 8 (small sets, as samplers keep)."""
    gen = torch.Generator().manual_seed(1)
    sizes = torch.where(torch.rand(labels.shape, generator=gen) < 0.46, 1,
                        torch.randint(2, 9, labels.shape, generator=gen)).to(labels.device)
    steps = torch.arange(8, device=labels.device)
    ids = (labels[..., None] + steps * 7919) % vocab
    return torch.where(steps < sizes[..., None], ids, -1)


def _fused_linear_tpo_loss(variant):
    def build(torch, tk, backend, shape, device, dtype):
        n, t, k, v = shape["N"], shape["T"], shape["K"], shape["V"]
        labels, scores = _sequence_batch(torch, shape, device, dtype, sparse=variant == "sparse")
        hidden, weight = _head(torch, (n, t), shape, device, dtype)
        # "cached": memory for every token's logits row in fp32, so the backward recomputes none;
        # "masked": replay of small kept sets (sampling_mask), |S| dot products per token
        extra = {"logits_cache_bytes": n * t * v * 4} if variant == "cached" else {}
        if variant == "masked":
            extra = {"sampling_mask": _kept_sets(torch, labels, v)}
        step = lambda hw: _backward(torch, tk.fused_linear_tpo_loss(  # noqa: E731
            hw[0], hw[1], labels, scores, group_size=k, backend=backend, **extra))
        return (lambda: _fresh(hidden, weight)), step
    return build


def _tpo_loss_from_logprobs(torch, tk, backend, shape, device, dtype):
    n, t, k = shape["N"], shape["T"], shape["K"]
    _, scores = _sequence_batch(torch, shape, device, dtype)
    logprobs = -torch.rand(n, t, device=device, dtype=torch.float32) * 3
    step = lambda lp: _backward(torch, tk.tpo_loss_from_logprobs(  # noqa: E731
        lp[0], scores, group_size=k, backend=backend))
    return (lambda: _fresh(logprobs)), step


def _candidates(torch, shape, device):
    r, k, v = shape["N"] * shape["T"], shape["K"], shape["V"]
    return torch.randint(0, v, (r, k), device=device), torch.randn(r, k, device=device, dtype=torch.float32)


def _token_tpo_loss(torch, tk, backend, shape, device, dtype):
    candidates, scores = _candidates(torch, shape, device)
    logits = _logits_leaf(torch, (shape["N"] * shape["T"],), shape, device, dtype)
    step = lambda z: _backward(torch, tk.token_tpo_loss(z, candidates, scores, backend=backend))  # noqa: E731
    return (lambda: _logits_view(logits)), step


def _fused_linear_token_tpo_loss(torch, tk, backend, shape, device, dtype):
    candidates, scores = _candidates(torch, shape, device)
    hidden, weight = _head(torch, (shape["N"] * shape["T"],), shape, device, dtype)
    step = lambda hw: _backward(torch, tk.fused_linear_token_tpo_loss(  # noqa: E731
        hw[0], hw[1], candidates, scores, backend=backend))
    return (lambda: _fresh(hidden, weight)), step


def _selective_logprobs(torch, tk, backend, shape, device, dtype):
    labels, _ = _sequence_batch(torch, shape, device, dtype)
    logits = _logits_leaf(torch, (shape["N"], shape["T"]), shape, device, dtype)
    step = lambda z: _backward(torch, tk.selective_logprobs(z, labels, backend=backend))  # noqa: E731
    return (lambda: _logits_view(logits)), step


def _fused_linear_logprobs(torch, tk, backend, shape, device, dtype):
    labels, _ = _sequence_batch(torch, shape, device, dtype)
    hidden, weight = _head(torch, (shape["N"], shape["T"]), shape, device, dtype)
    step = lambda hw: _backward(torch, tk.fused_linear_logprobs(hw[0], hw[1], labels, backend=backend))  # noqa: E731
    return (lambda: _fresh(hidden, weight)), step


# (name, builder, on every backend?): the variants (cached, sparse, strided) run on the kernel
# backends (cpu, cuda, compiled Triton), not on the portable torch backend (the fallback, and the
# slowest: it would double the suite's time) nor under the Triton interpreter, which covers the
# launch path of each function once.
FUNCTIONS = [
    ("tpo_loss", _tpo_loss(None), True),
    ("tpo_loss/sparse", _tpo_loss("sparse"), False),
    ("tpo_loss/strided", _tpo_loss("strided"), False),
    ("fused_linear_tpo_loss", _fused_linear_tpo_loss(None), True),
    ("fused_linear_tpo_loss/cached", _fused_linear_tpo_loss("cached"), False),
    ("fused_linear_tpo_loss/sparse", _fused_linear_tpo_loss("sparse"), False),
    ("fused_linear_tpo_loss/masked", _fused_linear_tpo_loss("masked"), False),
    ("tpo_loss_from_logprobs", _tpo_loss_from_logprobs, True),
    ("token_tpo_loss", _token_tpo_loss, True),
    ("fused_linear_token_tpo_loss", _fused_linear_token_tpo_loss, True),
    ("selective_logprobs", _selective_logprobs, True),
    ("fused_linear_logprobs", _fused_linear_logprobs, True),
]


def backends_here(gpu: bool):
    """(label, backend, device, shape key, dtype name, whether the variants run) of every backend this
    machine runs: cpu and torch on the CPU; with a GPU, cuda, compiled Triton and torch on it (bf16);
    without one, Triton under its interpreter at the tiny shape."""
    rows = [("cpu", "cpu", "cpu", "cpu", "float32", True), ("torch", "torch", "cpu", "cpu", "float32", False)]
    if gpu:
        rows += [("cuda", "cuda", "cuda", "gpu", "bfloat16", True),
                 ("triton", "triton", "cuda", "gpu", "bfloat16", True),
                 ("torch-cuda", "torch", "cuda", "gpu", "bfloat16", False)]
    else:
        rows += [("triton-interp", "triton", "cpu", "interp", "float32", False)]
    return rows


def suite(gpu: bool, patterns=None):
    """Case names in order, each with what runs it: (name, builder, backend, device, shape key, dtype)."""
    cases = []
    for label, backend, device, shape_key, dtype, with_variants in backends_here(gpu):
        for function, builder, everywhere in FUNCTIONS:
            if not (everywhere or with_variants):
                continue
            head, _, variant = function.partition("/")
            name = "/".join(p for p in (head, label, variant) if p)
            if patterns and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
                continue
            cases.append((name, builder, backend, device, shape_key, dtype))
    return cases


# ------------------------------------------------------------------------------------- the timing


def _sync(torch, device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_case(torch, tk, case, config):
    """Seconds of one step: warm-up calls, then ``repeats`` timed calls (more for fast cases, see
    MIN_CASE_SECONDS); the minimum, the median and the minimum CPU time of the process (all its
    threads, which waiting for a core does not add to; spinning and cache contention still do)."""
    name, builder, backend, device, shape_key, dtype = case
    torch.manual_seed(0)
    prepare, step = builder(torch, tk, backend, config["shapes"][shape_key], device, getattr(torch, dtype))
    for _ in range(config["warmup"]):
        step(prepare())
    _sync(torch, device)
    samples, cpu_samples = [], []
    while len(samples) < config["repeats"] or (sum(samples) < MIN_CASE_SECONDS and len(samples) < MAX_SAMPLES):
        inputs = prepare()
        _sync(torch, device)
        start, cpu_start = time.perf_counter(), time.process_time()
        step(inputs)
        _sync(torch, device)
        samples.append(time.perf_counter() - start)
        cpu_samples.append(time.process_time() - cpu_start)
        del inputs
    return {"seconds": min(samples), "median_seconds": statistics.median(samples), "cpu_seconds": min(cpu_samples),
            "samples": len(samples)}


def _build_info(tk):
    try:
        from tpo_kernels import _build_info  # noqa: PLC0415 - generated at build time, may be absent
    except ImportError:
        return {"commit": "unknown", "dirty": None}
    return {"commit": getattr(_build_info, "COMMIT", "unknown"), "dirty": getattr(_build_info, "DIRTY", None)}


def main(argv):
    config = json.loads(argv[0])
    import torch

    torch.set_num_threads(config["threads"])
    record = {"pid": os.getpid(), "cwd": os.getcwd(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "python": sys.executable, "cases": {}}
    import tpo_kernels as tk

    record["package_file"] = os.path.realpath(tk.__file__)
    record["build_info"] = _build_info(tk)
    for case in suite(config["gpu"], config.get("cases")):
        try:
            record["cases"][case[0]] = time_case(torch, tk, case, config)
        except Exception as exc:  # noqa: BLE001 - a case this tree cannot run is reported, not fatal
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            record["cases"][case[0]] = {"error": f"{type(exc).__name__}: {first_line}"}
    usage = resource.getrusage(resource.RUSAGE_SELF)  # the whole process: imports, inputs, all calls
    record["process_cpu_seconds"] = usage.ru_utime + usage.ru_stime
    print(RESULT_MARKER + json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
