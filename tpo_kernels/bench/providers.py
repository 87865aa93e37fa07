"""Providers: the implementations that compute a case, ours and the ones users would pick instead.

A provider says whether it can run on a device (``available(device)`` returns None or the reason
it is skipped) and builds a *runner* for a case's inputs: ``forward()`` -> state,
``backward(state)``, ``zero_grad()`` and ``check()``; the harness times those.

* ``tpo:<backend>`` (and ``tpo_logits:<backend>`` for the token case): the public tpo_kernels
  functions with ``backend=`` each of cuda, triton, cpu, torch.
* ``naive``: eager PyTorch as people write it (``baselines.py``); also the correctness reference.
* ``compile``: ``torch.compile`` of ``naive``.
* ``tpo_cached:<backend>`` (fused-linear case): ``fused_linear_tpo_loss`` with a logits cache of
  every token (``logits_cache_bytes``), three matmuls instead of four.
* ``torch_lce``, ``cce``, ``liger``: TPO on PyTorch's, Cut Cross-Entropy's and Liger-Kernel's
  fused linear cross-entropy (token log-prob = -CE), where installed; ``cce_compile``: Cut
  Cross-Entropy's ``impl="torch_compile"``; ``liger_chunked``: Liger-Kernel's chunked selective
  log-probs (PyTorch, the path its GRPO/PPO losses use). ``pip install tpo-kernels[peers]``.
* ``matmul4``, ``matmul3``: the fused-linear floors, four (three, with the logits kept) full-size
  matmuls and no softmax.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

import tpo_kernels

from . import baselines as B
from .inputs import Inputs

OUR_BACKENDS = ("cuda", "triton", "cpu", "torch")


# --------------------------------------------------------------------------- runners


class LossRunner:
    """forward() -> scalar loss; backward(loss) -> loss.backward(). ``logits_cache_bytes``: the
    logits cache budget the call is given (None: no cache), recorded with its results."""

    logits_cache_bytes: Optional[int] = None

    def __init__(self, fn: Callable[[], Tensor], inputs: Inputs):
        self.fn, self.inputs = fn, inputs

    def zero_grad(self):
        for t in self.inputs.leaves.values():
            t.grad = None

    def forward(self):
        return self.fn()

    def backward(self, loss):
        loss.backward()

    def check(self) -> dict:
        """One untimed forward+backward on fresh inputs: loss value and gradient norms."""
        probe = self.inputs.probe
        if probe is not None:
            probe.active, probe.norms = True, []
        self.zero_grad()
        loss = self.forward()
        value = float(loss.detach().double())
        self.backward(loss)
        norms = {}
        if probe is not None:
            probe.active = False
            if probe.norms:
                norms["logits"] = probe.norms[-1]
        for name, t in self.inputs.leaves.items():
            norms[name] = float(t.grad.norm()) if t.grad is not None else 0.0
        self.zero_grad()
        return {"loss": value, "grad_norms": norms}


class MatmulRunner:
    """The fused-linear floor: the [M,H]x[H,V]-sized matmuls of a chunked fused loss (forward
    logits, with ``recompute`` the backward's recompute, dH = dZ @ W, dW = dZ^T @ h), at full size,
    no softmax: four matmuls, or three when the logits are kept."""

    def __init__(self, inputs: Inputs, recompute: bool):
        self.inputs, self.recompute = inputs, recompute
        h = inputs["hidden"]
        self.h = h.detach().reshape(-1, h.shape[-1])
        self.w = inputs["weight"].detach()

    def zero_grad(self):
        pass

    def forward(self):
        return self.h @ self.w.t()

    def backward(self, state):
        z = self.h @ self.w.t() if self.recompute else state
        dh = z @ self.w  # z stands in for dlogits (same shape and dtype)
        dw = z.t() @ self.h
        return dh, dw

    def check(self):
        return None


# --------------------------------------------------------------------------- providers


@dataclass
class Provider:
    name: str
    role: str  # "ours" | "baseline" | "reference" | "floor"
    describe: str
    available: Callable[[torch.device], Optional[str]]  # None or the reason it is skipped
    build: Callable[[Inputs, dict], object]  # (inputs, shape) -> runner


def _our_available(backend: str):
    def check(device: torch.device) -> Optional[str]:
        if backend == "triton" and device.type == "cpu":
            return "Triton runs on CPU only under TRITON_INTERPRET=1 (an interpreter, not a benchmark); GPU only"
        if backend == "cuda" and device.type != "cuda":
            return "the cuda backend needs a CUDA device"
        if backend == "cpu" and device.type != "cpu":
            return "the cpu backend runs on CPU tensors only"
        status = tpo_kernels.backend_status().get(backend, "unknown backend")
        if status != "available":
            return f"backend {backend!r}: {status}"
        return None

    return check


def _compile_available(device: torch.device) -> Optional[str]:
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        return "torch.compile on CPU needs a C++ compiler (none on PATH)"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except Exception as exc:
            return f"torch.compile on CUDA needs triton ({exc})"
    return None


def _gpu_only(check: Callable[[], Optional[str]]):
    def inner(device: torch.device) -> Optional[str]:
        if device.type != "cuda":
            return "GPU only (its kernels need CUDA)"
        return check()

    return inner


def _always(device):
    return None


def _both(*checks: Callable[[torch.device], Optional[str]]):
    """Available where every check passes; else the first reason."""
    def check(device: torch.device) -> Optional[str]:
        return next((reason for reason in (c(device) for c in checks) if reason is not None), None)

    return check


_compiled: Dict[str, Callable] = {}


def _compiled_fn(key: str, fn: Callable) -> Callable:
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, dynamic=False)
    return _compiled[key]


def _ours(fn_name: str, make: Callable[[Callable, str], Callable], prefix="tpo", what="") -> List[Provider]:
    """One provider per backend for the public ``tpo_kernels.<fn_name>``; ``make(fn, backend)``
    returns the provider's build function."""

    def builder(b):
        def build(inp, shape):
            return make(getattr(tpo_kernels, fn_name), b)(inp, shape)

        return build

    return [
        Provider(f"{prefix}:{b}", "ours", f"tpo_kernels.{fn_name}(..., backend={b!r}){what}", _our_available(b), builder(b))
        for b in OUR_BACKENDS
    ]


def _naive(describe: str, fn: Callable, call: Callable, compiled_describe="torch.compile of the eager reference") -> List[Provider]:
    """``naive`` (eager ``fn``) and ``compile`` (``torch.compile(fn)``), both run by
    ``call(fn, inputs, shape)`` -> loss."""

    def eager(inp, shape):
        return LossRunner(lambda: call(fn, inp, shape), inp)

    def compiled(inp, shape):
        cfn = _compiled_fn(fn.__name__, fn)
        return LossRunner(lambda: call(cfn, inp, shape), inp)

    return [
        Provider("naive", "reference", describe, _always, eager),
        Provider("compile", "baseline", compiled_describe, _compile_available, compiled),
    ]


def logits_providers() -> List[Provider]:
    def ours(fn, b):
        return lambda inp, shape: LossRunner(
            lambda: fn(inp.probe(inp["logits"]), inp["labels"], inp["scores"], group_size=shape["K"], backend=b), inp
        )

    return _ours("tpo_loss", ours, what=", in-place backward") + _naive(
        "eager PyTorch: fp32 log_softmax, gather, sum, group math, autograd",
        B.naive_tpo_logits,
        lambda fn, inp, shape: fn(inp.probe(inp["logits"]), inp["labels"], inp["scores"], shape["K"]),
    )


def _linear_call(fn, inp, shape):
    return fn(inp["hidden"], inp["weight"], inp["labels"], inp["scores"], shape["K"])


def _linear(fn):
    return lambda inp, shape: LossRunner(lambda: _linear_call(fn, inp, shape), inp)


def _full_logits_bytes(inp: Inputs) -> int:
    """Bytes of every token's logits in their dtype: a logits cache that holds them all."""
    h, w = inp["hidden"], inp["weight"]
    return h[..., 0].numel() * w.shape[0] * torch.promote_types(h.dtype, w.dtype).itemsize


def linear_providers() -> List[Provider]:
    def ours(fn, b, **settings):
        return lambda inp, shape: LossRunner(
            lambda: fn(inp["hidden"], inp["weight"], inp["labels"], inp["scores"], group_size=shape["K"], backend=b,
                       **{k: v(inp) for k, v in settings.items()}), inp
        )

    def cached(fn, b):
        build = ours(fn, b, logits_cache_bytes=_full_logits_bytes)

        def build_cached(inp, shape):
            runner = build(inp, shape)
            runner.logits_cache_bytes = _full_logits_bytes(inp)  # the extra_beyond_cache target subtracts it
            return runner

        return build_cached

    return (
        _ours("fused_linear_tpo_loss", ours)
        + _ours("fused_linear_tpo_loss", cached, prefix="tpo_cached", what=", logits_cache_bytes = every token's logits")
        + _naive("eager PyTorch: hidden @ W.T materialized, fp32 log_softmax, gather, autograd", B.naive_tpo_linear, _linear_call)
        + [
            Provider(
                "torch_lce",
                "baseline",
                'TPO on F.linear_cross_entropy(reduction="none", options=LinearCrossEntropyOptions()), lp = -CE',
                lambda d: B.torch_lce_available(),
                _linear(B.torch_lce_tpo),
            ),
            Provider("cce", "baseline", 'TPO on cut_cross_entropy.linear_cross_entropy(reduction="none")', _gpu_only(B.cce_available), _linear(B.cce_tpo)),
            Provider("cce_compile", "baseline", 'TPO on cut_cross_entropy.linear_cross_entropy(reduction="none", impl="torch_compile")',
                     _both(_compile_available, lambda d: B.cce_available()), _linear(B.cce_compile_tpo)),
            Provider("liger", "baseline", 'TPO on Liger-Kernel fused linear cross entropy (reduction="none")', _gpu_only(B.liger_available), _linear(B.liger_tpo)),
            Provider("liger_chunked", "baseline", "TPO on Liger-Kernel's chunked selective log-probs (LigerFusedLinearPPOBase.chunk_forward)",
                     lambda d: B.liger_chunked_available(), _linear(B.liger_chunked_tpo)),
            Provider("matmul4", "floor", "four matmuls of the fused path's shapes (2*M*V*H flops each), no softmax", _always,
                     lambda inp, shape: MatmulRunner(inp, recompute=True)),
            Provider("matmul3", "floor", "three matmuls of the fused path's shapes (logits kept, no recompute), no softmax", _always,
                     lambda inp, shape: MatmulRunner(inp, recompute=False)),
        ]
    )


def token_providers() -> List[Provider]:
    def fused(fn, b):
        return lambda inp, shape: LossRunner(lambda: fn(inp["hidden"], inp["weight"], inp["candidates"], inp["scores"], backend=b), inp)

    def on_logits(fn, b):
        return lambda inp, shape: LossRunner(
            lambda: fn(inp["hidden"] @ inp["weight"].t(), inp["candidates"], inp["scores"], backend=b), inp
        )

    naive = _naive(
        "full-vocab reference: hidden @ W.T, fp32 log_softmax, gather K, group math, autograd",
        B.naive_token_tpo_linear,
        lambda fn, inp, shape: fn(inp["hidden"], inp["weight"], inp["candidates"], inp["scores"]),
        "torch.compile of the full-vocab reference",
    )
    return (
        _ours("fused_linear_token_tpo_loss", fused)
        + _ours("token_tpo_loss", on_logits, prefix="tpo_logits", what=" on materialized hidden @ W.T")
        + naive
    )


def token_logits_providers() -> List[Provider]:
    def ours(fn, b):
        return lambda inp, shape: LossRunner(lambda: fn(inp.probe(inp["logits"]), inp["candidates"], inp["scores"], backend=b), inp)

    naive = _naive(
        "full-vocab reference: fp32 log_softmax, gather K, group math, autograd",
        B.naive_token_tpo_logits,
        lambda fn, inp, shape: fn(inp.probe(inp["logits"]), inp["candidates"], inp["scores"]),
        "torch.compile of the full-vocab reference",
    )
    return _ours("token_tpo_loss", ours) + naive


def naive_logprobs_loss(logits, labels, weights):
    """The log-probs case's loss: sum of eager log-probs weighted by a fixed upstream gradient."""
    return (B.naive_selective_logprobs(logits, labels) * weights).sum()


def logprobs_providers() -> List[Provider]:
    def ours(fn, b):
        return lambda inp, shape: LossRunner(
            lambda: (fn(inp.probe(inp["logits"]), inp["labels"], backend=b) * inp["weights"]).sum(), inp
        )

    naive = _naive(
        "eager PyTorch: fp32 log_softmax + gather + autograd",
        naive_logprobs_loss,
        lambda fn, inp, shape: fn(inp.probe(inp["logits"]), inp["labels"], inp["weights"]),
        "torch.compile of the eager log_softmax + gather",
    )
    return _ours("selective_logprobs", ours) + naive
