"""Kernel-only times of the logits path, measured next to the end-to-end call on the same inputs.

``tpo_loss(logits, labels, scores, group_size=K, backend=b)`` does, besides its kernels, input
checks, the batch layout, autograd bookkeeping and a few small PyTorch ops. The stages here are
the backend's operations alone, called as ``tpo_loss`` calls them (temperature 1, no entropy,
eta 1, anchored on-policy, mean reduction):

* ``row_forward``:  ``backend.row_forward(logits[M, V], labels)`` -> the rows' ``RowSummary``;
* ``group``:        ``backend.group_targets(token log-probs, layout, scores)`` -> p, q, ...;
* ``row_backward``: ``backend.row_backward(logits, labels, summary, ...)`` writing the logits gradient in place, with the
  per-token gradient ``(p - q)[sequence] / G`` (rows of tied groups get 0 and are skipped, as in
  the real backward).

Each stage is timed like the end-to-end modes (warm-up, adaptive repetitions, CUDA events with
the L2 flushed before each repetition on a GPU). Their sum is the kernel-only time of one
forward+backward, and ``3 * M * V * element size / sum`` (``6 M V`` bytes in bf16) its bandwidth.
The stages run after the end-to-end modes, in place on the inputs' logits buffer (which then
holds gradients: the kernels' timing does not depend on the values).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

STAGES = ("row_forward", "group", "row_backward")


def backend_of(provider_name: str) -> Optional[str]:
    """``"tpo:cuda"`` -> ``"cuda"``; None for providers that are not a tpo_kernels backend."""
    prefix, _, backend = provider_name.partition(":")
    return backend if prefix == "tpo" and backend else None


class StageRunner:
    """One stage as a runner the harness's timer can time (its ``forward`` is the stage)."""

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn

    def zero_grad(self):
        pass

    def forward(self):
        return self.fn()


def logits_stages(inputs, shape: dict, backend_name: str, device: torch.device) -> Dict[str, Callable[[], object]]:
    """The three stages of the ``logits`` case for ``backend_name``, set up on ``inputs``."""
    from tpo_kernels.backends import get_backend
    from tpo_kernels.group_math import build_layout

    backend = get_backend(backend_name, device)
    with torch.no_grad():
        logits = inputs["logits"].detach()
        n, t, v = logits.shape
        rows = logits.view(n * t, v)  # shares the inputs' storage: the backward writes into it
        labels = inputs["labels"].reshape(n * t).contiguous()
        layout = build_layout(n * t, device, padded_shape=(n, t), group_size=shape["K"])
        summary = backend.row_forward(rows, labels, inv_temperature=1.0, with_entropy=False)
        token_logprobs = summary.label_logprob
        scores = inputs["scores"].to(token_logprobs.dtype)
        result = backend.group_targets(token_logprobs, layout, scores, eta=1.0, anchor=True)
        grad = ((result.p - result.q) / layout.num_groups).to(token_logprobs.dtype).repeat_interleave(t)

    def forward():
        with torch.no_grad():
            return backend.row_forward(rows, labels, inv_temperature=1.0, with_entropy=False)

    def group():
        with torch.no_grad():
            return backend.group_targets(token_logprobs, layout, scores, eta=1.0, anchor=True)

    def backward():
        with torch.no_grad():
            backend.row_backward(rows, labels, summary, grad, inv_temperature=1.0, out=rows)

    return {"row_forward": forward, "group": group, "row_backward": backward}


def measure_stages(stages: Dict[str, Callable[[], object]], timer, spec: dict) -> dict:
    """Median (and min) seconds of each stage, with the harness's timer and repetition rules."""
    import statistics
    import time

    out: Dict[str, object] = {}
    total = 0.0
    for name in STAGES:
        runner = StageRunner(stages[name])
        t0 = time.perf_counter()
        warm = timer.run(runner, "forward", max(1, spec["warmup"]))
        est = min(warm) if warm else time.perf_counter() - t0
        reps = int(max(spec["min_reps"], min(spec["max_reps"], spec["target_time"] / max(est, 1e-6))))
        times = timer.run(runner, "forward", reps)
        median = statistics.median(times)
        out[name] = {"median": median, "min": min(times), "max": max(times), "reps": len(times)}
        total += median
    out["total_s"] = total
    return out
