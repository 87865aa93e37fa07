"""Benchmark cases, providers, default shape grids and issue presets.

A *case* is one thing a user computes ("sequence-level TPO on materialized logits", ...). It
knows how to build seeded inputs for a shape, dtype and score variant, which *providers* (our
backends and the baselines users would pick instead) can compute it, and how to turn a time into
a throughput. A *provider* returns a runner with ``forward()`` -> state, ``backward(state)`` and
``zero_grad()``; the harness times those.

Variants: ``dense`` (every group has distinct scores) and ``sparse90`` (90% of groups, rounded down
so the active share is never below 10%, have tied scores: the sparse-reward regime of the paper's
Sec. 4.2, where TPO's coefficients vanish exactly).
"""

from __future__ import annotations

import fnmatch
import math
import shutil
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import baselines as B

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
VARIANTS = ("dense", "sparse90")
MODES = ("forward", "backward", "full")
OUR_BACKENDS = ("cuda", "triton", "cpu", "torch")


# --------------------------------------------------------------------------- inputs


class GradProbe(torch.autograd.Function):
    """Stands in for the layer that produced the logits (an lm_head, say).

    Returns a non-leaf alias of the input, so ``tpo_loss``'s in-place backward is allowed (as it
    is on real activations: it never overwrites a leaf), and discards the gradient that arrives,
    as the producing layer would consume it. While ``probe.active`` it records that gradient's norm,
    which the harness compares across providers.
    """

    @staticmethod
    def forward(ctx, x, probe):
        ctx.probe = probe
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.probe.active:  # accumulates in fp32 (at least) without a full-size upcast copy
            ctx.probe.norms.append(float(grad.norm()))
        return None, None


class Probe:
    def __init__(self):
        self.active = False
        self.norms: List[float] = []

    def __call__(self, x: Tensor) -> Tensor:
        return GradProbe.apply(x, self)


@dataclass
class Inputs:
    tensors: Dict[str, Tensor]
    leaves: Dict[str, Tensor] = field(default_factory=dict)  # parameters/activations whose .grad is kept
    probe: Optional[Probe] = None
    input_bytes: int = 0
    kept_grad_bytes: int = 0
    tied_groups: int = 0
    num_groups: int = 0

    def __getitem__(self, key):
        return self.tensors[key]


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _scores(num_groups: int, k: int, variant: str, gens: "_Gens", device) -> Tuple[Tensor, int]:
    """``[G, K]`` scores. dense: Gaussian (no ties). sparse90: floor(0.9 G) groups tied (all 0 or all
    1, binary rewards), the others binary with at least one success and one failure."""
    gen = gens.cpu
    if variant == "dense":
        return torch.randn(num_groups, k, generator=gen).to(device), 0
    if variant != "sparse90":
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    tied = int(math.floor(0.9 * num_groups))
    if num_groups > 1 and tied == num_groups:
        tied = num_groups - 1
    order = torch.randperm(num_groups, generator=gen)
    s = (torch.rand(num_groups, k, generator=gen) < 0.5).float()
    s[:, 0], s[:, 1 % k] = 1.0, 0.0  # mixed by default
    tied_idx = order[:tied]
    s[tied_idx] = (torch.rand(tied, 1, generator=gen) < 0.5).float().expand(tied, k)
    return s.to(device), tied


def _randn(shape, dtype, device, gen, scale=1.0) -> Tensor:
    """Generated where it lives, in its dtype (a 16k x 152k bf16 tensor would take seconds and
    10 GB of host memory to make on the CPU and copy)."""
    x = torch.randn(*shape, generator=gen.dev, device=device, dtype=dtype)
    return x.mul_(scale) if scale != 1.0 else x


def _randint(high, shape, device, gen) -> Tensor:
    return torch.randint(0, high, shape, generator=gen.dev, device=device)


class _Gens:
    """A generator on the inputs' device for the big tensors and a CPU one for the small ones,
    both seeded, so every provider of a comparison gets identical inputs."""

    def __init__(self, seed: int, device):
        device = torch.device(device)
        self.dev = torch.Generator(device=device)
        self.dev.manual_seed(seed)
        self.cpu = torch.Generator()
        self.cpu.manual_seed(seed + 1)


def _seq_tokens(shape: dict) -> int:
    return shape["G"] * shape["K"] * shape["T"]


def make_logits_inputs(shape, dtype, device, variant, seed):
    g = _Gens(seed, device)
    n, t, v = shape["G"] * shape["K"], shape["T"], shape["V"]
    logits = _randn((n, t, v), dtype, device, g, 2.0).requires_grad_(True)
    labels = _randint(v, (n, t), device, g)
    scores, tied = _scores(shape["G"], shape["K"], variant, g, device)
    inp = Inputs({"logits": logits, "labels": labels, "scores": scores.reshape(-1)}, probe=Probe())
    inp.input_bytes = _nbytes(logits) + _nbytes(labels) + _nbytes(scores)
    inp.tied_groups, inp.num_groups = tied, shape["G"]
    return inp


def make_linear_inputs(shape, dtype, device, variant, seed):
    g = _Gens(seed, device)
    n, t, h, v = shape["G"] * shape["K"], shape["T"], shape["H"], shape["V"]
    hidden = _randn((n, t, h), dtype, device, g).requires_grad_(True)
    weight = _randn((v, h), dtype, device, g, 1.0 / math.sqrt(h)).requires_grad_(True)
    labels = _randint(v, (n, t), device, g)
    scores, tied = _scores(shape["G"], shape["K"], variant, g, device)
    inp = Inputs(
        {"hidden": hidden, "weight": weight, "labels": labels, "scores": scores.reshape(-1)},
        leaves={"hidden": hidden, "weight": weight},
    )
    inp.input_bytes = _nbytes(hidden) + _nbytes(weight) + _nbytes(labels) + _nbytes(scores)
    inp.kept_grad_bytes = _nbytes(hidden) + _nbytes(weight)
    inp.tied_groups, inp.num_groups = tied, shape["G"]
    return inp


def _candidates(r, k, v, device, gen):
    return _randint(v, (r, k), device, gen)


def make_token_inputs(shape, dtype, device, variant, seed):
    g = _Gens(seed, device)
    r, k, h, v = shape["R"], shape["K"], shape["H"], shape["V"]
    hidden = _randn((r, h), dtype, device, g).requires_grad_(True)
    weight = _randn((v, h), dtype, device, g, 1.0 / math.sqrt(h)).requires_grad_(True)
    cand = _candidates(r, k, v, device, g)
    scores, tied = _scores(r, k, variant, g, device)
    inp = Inputs(
        {"hidden": hidden, "weight": weight, "candidates": cand, "scores": scores},
        leaves={"hidden": hidden, "weight": weight},
    )
    inp.input_bytes = _nbytes(hidden) + _nbytes(weight) + _nbytes(cand) + _nbytes(scores)
    inp.kept_grad_bytes = _nbytes(hidden) + _nbytes(weight)
    inp.tied_groups, inp.num_groups = tied, r
    return inp


def make_token_logits_inputs(shape, dtype, device, variant, seed):
    g = _Gens(seed, device)
    r, k, v = shape["R"], shape["K"], shape["V"]
    logits = _randn((r, v), dtype, device, g, 2.0).requires_grad_(True)
    cand = _candidates(r, k, v, device, g)
    scores, tied = _scores(r, k, variant, g, device)
    inp = Inputs({"logits": logits, "candidates": cand, "scores": scores}, probe=Probe())
    inp.input_bytes = _nbytes(logits) + _nbytes(cand) + _nbytes(scores)
    inp.tied_groups, inp.num_groups = tied, r
    return inp


def make_logprobs_inputs(shape, dtype, device, variant, seed):
    g = _Gens(seed, device)
    m, v = shape["M"], shape["V"]
    logits = _randn((m, v), dtype, device, g, 2.0).requires_grad_(True)
    labels = _randint(v, (m,), device, g)
    weights = (torch.randn(m, generator=g.cpu) / m).to(device)  # upstream gradient of the log-probs
    inp = Inputs({"logits": logits, "labels": labels, "weights": weights}, probe=Probe())
    inp.input_bytes = _nbytes(logits) + _nbytes(labels) + _nbytes(weights)
    return inp


# --------------------------------------------------------------------------- runners


class LossRunner:
    """forward() -> scalar loss; backward(loss) -> loss.backward()."""

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


class Matmul4Runner:
    """The fused-linear floor: the four [M,H]x[H,V]-sized matmuls of a chunked fused loss
    (forward logits, backward recompute, dH = dZ @ W, dW = dZ^T @ h), at full size, no softmax."""

    def __init__(self, inputs: Inputs):
        self.inputs = inputs
        h = inputs["hidden"]
        self.h = h.detach().reshape(-1, h.shape[-1])
        self.w = inputs["weight"].detach()

    def zero_grad(self):
        pass

    def forward(self):
        return self.h @ self.w.t()

    def backward(self, state):
        z = self.h @ self.w.t()  # recompute
        dh = z @ self.w  # z stands in for dlogits (same shape and dtype)
        dw = z.t() @ self.h
        return dh, dw

    def check(self):
        return None


# --------------------------------------------------------------------------- providers


@dataclass
class Provider:
    name: str
    role: str  # "ours" | "baseline" | "reference"
    describe: str
    available: Callable[[torch.device], Optional[str]]  # None or the reason it is skipped
    build: Callable[[Inputs, dict], object]  # (inputs, shape) -> runner


def _tk():
    import tpo_kernels

    return tpo_kernels


OUR_FUNCTIONS = ("tpo_loss", "selective_logprobs", "fused_linear_tpo_loss", "token_tpo_loss", "fused_linear_token_tpo_loss")
_SUBMODULES = ("functional", "fused_linear", "token_level")


def our_function(name: str):
    """``(function, where)``: the public ``tpo_kernels.<name>``, else the module that defines it
    while it is not yet re-exported at the top level, else ``(None, "missing")``."""
    import importlib

    tk = _tk()
    fn = getattr(tk, name, None)
    if fn is not None:
        return fn, f"tpo_kernels.{name}"
    for sub in _SUBMODULES:
        try:
            mod = importlib.import_module(f"tpo_kernels.{sub}")
        except Exception:
            continue
        fn = getattr(mod, name, None)
        if callable(fn):
            return fn, f"tpo_kernels.{sub}.{name} (not re-exported by tpo_kernels yet)"
    return None, "missing"


def _our_available(fn_name: str, backend: str):
    def check(device: torch.device) -> Optional[str]:
        try:
            fn, _ = our_function(fn_name)
        except Exception as exc:
            return f"tpo_kernels not importable: {type(exc).__name__}: {exc}"
        tk = _tk()
        if fn is None:
            return f"tpo_kernels.{fn_name} does not exist yet"
        status = tk.backend_status().get(backend, "unknown backend")
        if backend == "triton" and device.type == "cpu":
            return "Triton runs on CPU only under TRITON_INTERPRET=1 (an interpreter, not a benchmark); GPU only"
        if backend == "cuda" and device.type != "cuda":
            return "the cuda backend needs a CUDA device"
        if backend == "cpu" and device.type != "cpu":
            return "the cpu backend runs on CPU tensors only"
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


_compiled: Dict[str, Callable] = {}


def _compiled_fn(key: str, fn: Callable) -> Callable:
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, dynamic=False)
    return _compiled[key]


def _our_providers(fn_name: str, make: Callable[[str], Callable[[Inputs, dict], object]], prefix="tpo", what=""):
    out = []
    for b in OUR_BACKENDS:
        out.append(
            Provider(
                f"{prefix}:{b}",
                "ours",
                f"tpo_kernels.{fn_name}(..., backend={b!r}){what}",
                _our_available(fn_name, b),
                make(b),
            )
        )
    return out


def _logits_providers():
    def ours(b):
        def build(inp, shape):
            fn, k, probe = our_function("tpo_loss")[0], shape["K"], inp.probe
            return LossRunner(
                lambda: fn(probe(inp["logits"]), inp["labels"], inp["scores"], group_size=k, backend=b),
                inp,
            )

        return build

    def naive(inp, shape):
        k, probe = shape["K"], inp.probe
        return LossRunner(lambda: B.naive_tpo_logits(probe(inp["logits"]), inp["labels"], inp["scores"], k), inp)

    def compiled(inp, shape):
        k, probe, fn = shape["K"], inp.probe, _compiled_fn("logits", B.naive_tpo_logits)
        return LossRunner(lambda: fn(probe(inp["logits"]), inp["labels"], inp["scores"], k), inp)

    return _our_providers("tpo_loss", ours, what=", in-place backward") + [
        Provider("naive", "reference", "eager PyTorch: fp32 log_softmax, gather, sum, group math, autograd", _always, naive),
        Provider("compile", "baseline", "torch.compile of the eager reference", _compile_available, compiled),
    ]


def _linear_providers():
    def ours(b):
        def build(inp, shape):
            fn, k = our_function("fused_linear_tpo_loss")[0], shape["K"]
            return LossRunner(
                lambda: fn(
                    inp["hidden"], inp["weight"], inp["labels"], inp["scores"], group_size=k, backend=b
                ),
                inp,
            )

        return build

    def wrap(fn):
        def build(inp, shape):
            k = shape["K"]
            return LossRunner(lambda: fn(inp["hidden"], inp["weight"], inp["labels"], inp["scores"], k), inp)

        return build

    def compiled(inp, shape):
        return wrap(_compiled_fn("linear", B.naive_tpo_linear))(inp, shape)

    return _our_providers("fused_linear_tpo_loss", ours) + [
        Provider("naive", "reference", "eager PyTorch: hidden @ W.T materialized, fp32 log_softmax, gather, autograd", _always, wrap(B.naive_tpo_linear)),
        Provider("compile", "baseline", "torch.compile of the eager reference", _compile_available, compiled),
        Provider(
            "torch_lce",
            "baseline",
            'TPO on F.linear_cross_entropy(reduction="none", options=LinearCrossEntropyOptions()), lp = -CE',
            lambda d: B.torch_lce_available(),
            wrap(B.torch_lce_tpo),
        ),
        Provider("cce", "baseline", 'TPO on cut_cross_entropy.linear_cross_entropy(reduction="none")', _gpu_only(B.cce_available), wrap(B.cce_tpo)),
        Provider("liger", "baseline", 'TPO on Liger-Kernel fused linear cross entropy (reduction="none")', _gpu_only(B.liger_available), wrap(B.liger_tpo)),
        Provider("matmul4", "floor", "four matmuls of the fused path's shapes (2*M*V*H flops each), no softmax", _always, lambda inp, shape: Matmul4Runner(inp)),
    ]


def _token_providers():
    def ours_fused(b):
        def build(inp, shape):
            fn = our_function("fused_linear_token_tpo_loss")[0]
            return LossRunner(
                lambda: fn(inp["hidden"], inp["weight"], inp["candidates"], inp["scores"], backend=b),
                inp,
            )

        return build

    def ours_logits(b):
        def build(inp, shape):
            fn = our_function("token_tpo_loss")[0]
            return LossRunner(
                lambda: fn(inp["hidden"] @ inp["weight"].t(), inp["candidates"], inp["scores"], backend=b),
                inp,
            )

        return build

    def naive(inp, shape):
        return LossRunner(lambda: B.naive_token_tpo_linear(inp["hidden"], inp["weight"], inp["candidates"], inp["scores"]), inp)

    def compiled(inp, shape):
        fn = _compiled_fn("token", B.naive_token_tpo_linear)
        return LossRunner(lambda: fn(inp["hidden"], inp["weight"], inp["candidates"], inp["scores"]), inp)

    return (
        _our_providers("fused_linear_token_tpo_loss", ours_fused)
        + _our_providers("token_tpo_loss", ours_logits, prefix="tpo_logits", what=" on materialized hidden @ W.T")
        + [
            Provider("naive", "reference", "full-vocab reference: hidden @ W.T, fp32 log_softmax, gather K, group math, autograd", _always, naive),
            Provider("compile", "baseline", "torch.compile of the full-vocab reference", _compile_available, compiled),
        ]
    )


def _token_logits_providers():
    def ours(b):
        def build(inp, shape):
            fn, probe = our_function("token_tpo_loss")[0], inp.probe
            return LossRunner(lambda: fn(probe(inp["logits"]), inp["candidates"], inp["scores"], backend=b), inp)

        return build

    def naive(inp, shape):
        probe = inp.probe
        return LossRunner(lambda: B.naive_token_tpo_logits(probe(inp["logits"]), inp["candidates"], inp["scores"]), inp)

    def compiled(inp, shape):
        probe, fn = inp.probe, _compiled_fn("token_logits", B.naive_token_tpo_logits)
        return LossRunner(lambda: fn(probe(inp["logits"]), inp["candidates"], inp["scores"]), inp)

    return _our_providers("token_tpo_loss", ours) + [
        Provider("naive", "reference", "full-vocab reference: fp32 log_softmax, gather K, group math, autograd", _always, naive),
        Provider("compile", "baseline", "torch.compile of the full-vocab reference", _compile_available, compiled),
    ]


def _weighted_sum(lp: Tensor, w: Tensor) -> Tensor:
    return (lp * w).sum()


def _naive_lp_loss(logits, labels, w):
    return _weighted_sum(B.naive_selective_logprobs(logits, labels), w)


def _logprobs_providers():
    def ours(b):
        def build(inp, shape):
            fn, probe = our_function("selective_logprobs")[0], inp.probe
            return LossRunner(
                lambda: _weighted_sum(fn(probe(inp["logits"]), inp["labels"], backend=b), inp["weights"]),
                inp,
            )

        return build

    def naive(inp, shape):
        probe = inp.probe
        return LossRunner(lambda: _naive_lp_loss(probe(inp["logits"]), inp["labels"], inp["weights"]), inp)

    def compiled(inp, shape):
        probe, fn = inp.probe, _compiled_fn("logprobs", _naive_lp_loss)
        return LossRunner(lambda: fn(probe(inp["logits"]), inp["labels"], inp["weights"]), inp)

    return _our_providers("selective_logprobs", ours) + [
        Provider("naive", "reference", "eager PyTorch: fp32 log_softmax + gather + autograd", _always, naive),
        Provider("compile", "baseline", "torch.compile of the eager log_softmax + gather", _compile_available, compiled),
    ]


# --------------------------------------------------------------------------- throughput


def _bandwidth(shape, dtype, mode, seconds):
    """Effective bandwidth of the logits path: 1 pass over [M,V] forward, 2 backward (read + in-place
    write), so 3*M*V*bytes for forward+backward (= 6*M*V bytes in bf16; DESIGN.md section 4)."""
    m = shape["M"] if "M" in shape else _seq_tokens(shape)
    passes = {"forward": 1, "backward": 2, "full": 3}[mode]
    return passes * m * shape["V"] * DTYPES_SIZE[dtype] / seconds / 1e9, "GB/s"


def _flops(shape, dtype, mode, seconds):
    """Fused-linear matmul work: 2*M*V*H per matmul; 1 forward, 3 backward (recompute, dH, dW)."""
    m = _seq_tokens(shape)
    mats = {"forward": 1, "backward": 3, "full": 4}[mode]
    return mats * 2 * m * shape["V"] * shape["H"] / seconds / 1e12, "TFLOP/s"


DTYPES_SIZE = {name: torch.tensor([], dtype=dt).element_size() for name, dt in DTYPES.items()}


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    name: str
    title: str
    params: Tuple[str, ...]
    token_key: str  # x axis of the "vs tokens" plot
    make_inputs: Callable
    providers: List[Provider]
    throughput: Optional[Callable] = None
    grids: Dict[str, List[dict]] = field(default_factory=dict)  # "cpu", "cuda", "quick-cpu", "quick-cuda"

    def provider(self, name: str) -> Provider:
        for p in self.providers:
            if p.name == name:
                return p
        raise KeyError(f"case {self.name!r} has no provider {name!r}; it has {[p.name for p in self.providers]}")

    def tokens(self, shape: dict) -> int:
        if self.token_key == "M" and "M" not in shape:
            return _seq_tokens(shape)
        return shape[self.token_key]

    def full_shape(self, shape: dict) -> dict:
        out = dict(shape)
        if self.token_key == "M" and "M" not in out:
            out["M"] = _seq_tokens(out)
        return out


def _seq(g, k, t, v, h=None):
    d = {"G": g, "K": k, "T": t, "V": v}
    if h is not None:
        d["H"] = h
    return d


def _main(shape: dict, variants=("dense",), with_=()) -> dict:
    """Mark a grid entry as a case's main shape: extra score variants, and the costly providers
    (LIMITED_PROVIDERS) that run only there, on its dense variant."""
    return dict(shape, _variants=list(variants), _with=list(with_))


GPU_VOCABS = (32000, 128256, 151936, 262144)

CASES: Dict[str, Case] = {}


def _register(case: Case):
    CASES[case.name] = case


_SPARSE = ("dense", "sparse90")
_CPU_COSTLY = ("compile", "tpo:torch", "tpo_logits:torch", "torch_lce", "matmul4")  # compile: logits case only
_GPU_COSTLY = ("compile", "tpo:torch", "tpo_logits:torch")

_register(
    Case(
        "logits",
        "Sequence-level TPO on materialized logits (tpo_loss)",
        ("G", "K", "T", "V"),
        "M",
        make_logits_inputs,
        _logits_providers(),
        _bandwidth,
        grids={
            # M = G*K*T. CPU: vocab sweep at M = 2048, token sweep at V = 32768
            "cpu": [_main(_seq(16, 8, 16, 32768), _SPARSE, _CPU_COSTLY)]
            + [_seq(16, 8, 16, v) for v in (8192, 16384)]
            + [_seq(g, 8, 16, 32768) for g in (8, 32)],
            "quick-cpu": [_main(_seq(10, 8, 8, 16384), _SPARSE), _seq(10, 8, 8, 4096), _seq(20, 8, 8, 16384)],
            # GPU: vocab sweep at M = 16384 (K=8, T=128), token sweep 4096..32768 at V = 151936, K=16 once
            "cuda": [_main(_seq(16, 8, 128, 151936), _SPARSE, _GPU_COSTLY)]
            + [_seq(16, 8, 128, v) for v in GPU_VOCABS if v != 151936]
            + [_seq(g, 8, 128, 151936) for g in (4, 8, 32)]
            + [_seq(8, 16, 128, 151936)],
            "quick-cuda": [_main(_seq(4, 8, 128, 151936), _SPARSE), _seq(4, 8, 128, 32000)],
        },
    )
)

_register(
    Case(
        "fused_linear",
        "Sequence-level TPO fused with the lm_head matmul (fused_linear_tpo_loss)",
        ("G", "K", "T", "H", "V"),
        "M",
        make_linear_inputs,
        _linear_providers(),
        _flops,
        grids={
            "cpu": [_main(_seq(8, 8, 16, 32768, 256), _SPARSE, ("tpo:torch", "torch_lce", "matmul4"))]
            + [_seq(8, 8, 16, 8192, 256), _seq(16, 8, 16, 32768, 256)],
            "quick-cpu": [_main(_seq(10, 8, 8, 16384, 256), _SPARSE), _seq(10, 8, 8, 4096, 256)],
            "cuda": [_main(_seq(16, 8, 128, 151936, 4096), _SPARSE, _GPU_COSTLY)]
            + [_seq(16, 8, 128, v, 4096) for v in GPU_VOCABS if v != 151936]
            + [_seq(g, 8, 128, 151936, 4096) for g in (4, 8, 32)]
            + [_seq(16, 8, 128, 151936, 2048), _seq(8, 16, 128, 151936, 4096)],
            "quick-cuda": [_main(_seq(4, 8, 128, 151936, 2048), _SPARSE), _seq(4, 8, 128, 32000, 2048)],
        },
    )
)

_register(
    Case(
        "token",
        "Token-level TPO, K candidates per state, from hidden states (fused_linear_token_tpo_loss)",
        ("R", "K", "H", "V"),
        "R",
        make_token_inputs,
        _token_providers(),
        None,
        grids={
            "cpu": [_main({"R": 1024, "K": 8, "H": 256, "V": 32768}, with_=("tpo:torch",))]
            + [{"R": 1024, "K": 8, "H": 256, "V": 8192}, {"R": 2048, "K": 8, "H": 256, "V": 32768}],
            "quick-cpu": [_main({"R": 256, "K": 8, "H": 256, "V": 16384}), {"R": 256, "K": 8, "H": 256, "V": 4096}],
            "cuda": [_main({"R": 8192, "K": 8, "H": 4096, "V": 151936}, with_=_GPU_COSTLY)]
            + [{"R": 8192, "K": 8, "H": 4096, "V": v} for v in GPU_VOCABS if v != 151936]
            + [{"R": r, "K": 8, "H": 4096, "V": 151936} for r in (4096, 16384)]
            + [{"R": 8192, "K": 16, "H": 4096, "V": 151936}, {"R": 8192, "K": 8, "H": 2048, "V": 151936}],
            "quick-cuda": [_main({"R": 2048, "K": 8, "H": 2048, "V": 151936}), {"R": 2048, "K": 8, "H": 2048, "V": 32000}],
        },
    )
)

_register(
    Case(
        "token_logits",
        "Token-level TPO on materialized logits (token_tpo_loss)",
        ("R", "K", "V"),
        "R",
        make_token_logits_inputs,
        _token_logits_providers(),
        None,
        grids={
            "cpu": [_main({"R": 2048, "K": 8, "V": 32768}), {"R": 2048, "K": 8, "V": 8192}],
            "quick-cpu": [_main({"R": 512, "K": 8, "V": 16384})],
            "cuda": [_main({"R": 16384, "K": 8, "V": 151936}, with_=_GPU_COSTLY), {"R": 16384, "K": 8, "V": 32000}, {"R": 16384, "K": 16, "V": 151936}],
            "quick-cuda": [_main({"R": 4096, "K": 8, "V": 151936})],
        },
    )
)

_register(
    Case(
        "logprobs",
        "Per-token log-probs with backward (selective_logprobs)",
        ("M", "V"),
        "M",
        make_logprobs_inputs,
        _logprobs_providers(),
        _bandwidth,
        grids={
            "cpu": [_main({"M": 2048, "V": 32768}, with_=("tpo:torch",)), {"M": 2048, "V": 8192}, {"M": 8192, "V": 32768}],
            "quick-cpu": [_main({"M": 512, "V": 16384})],
            "cuda": [_main({"M": 16384, "V": 151936}, with_=_GPU_COSTLY)]
            + [{"M": 16384, "V": v} for v in GPU_VOCABS if v != 151936]
            + [{"M": m, "V": 151936} for m in (4096, 32768)],
            "quick-cuda": [_main({"M": 4096, "V": 151936})],
        },
    )
)


# which providers the default grids consider (those that cannot run here are listed as skipped,
# with the reason); --providers replaces this list
_ALL = ["tpo:cuda", "tpo:triton", "tpo:cpu", "tpo:torch", "tpo_logits:cuda", "tpo_logits:triton", "tpo_logits:cpu",
        "tpo_logits:torch", "naive", "compile", "torch_lce", "cce", "liger", "matmul4"]
DEFAULT_PROVIDERS = {"cpu": _ALL, "cuda": _ALL}
QUICK_PROVIDERS = {
    "cpu": ["tpo:cuda", "tpo:triton", "tpo:cpu", "naive"],
    "cuda": ["tpo:cuda", "tpo:triton", "naive", "matmul4"],
}
# costly providers that the default grids run only at a case's main shape (dense variant)
# (torch_lce: F.linear_cross_entropy's chunked path took 15-40 s per fwd+bwd at M=1024-2048, H=256,
# V=32768 fp32 on the 2-core machine under load, 15x its options=None reference path)
LIMITED_PROVIDERS = {"cpu": set(_CPU_COSTLY), "cuda": set(_GPU_COSTLY)}
# modes of the default grids (any subset can be asked for with --mode)
DEFAULT_MODES = {
    "cpu": {"logits": MODES},
    "cuda": {"logits": MODES, "fused_linear": MODES, "logprobs": MODES},
}


def select_providers(case: Case, patterns: Optional[Sequence[str]], device_type: str, quick: bool) -> List[Provider]:
    if patterns:
        chosen = [p for p in case.providers if any(fnmatch.fnmatchcase(p.name, pat) for pat in patterns)]
    else:
        names = (QUICK_PROVIDERS if quick else DEFAULT_PROVIDERS)[device_type]
        chosen = [p for p in case.providers if p.name in names]
    return chosen


# --------------------------------------------------------------------------- presets and targets


@dataclass
class Target:
    """One number an issue asks for. ``kind``:

    * ``ratio``:   metric(num) / metric(den)      (time or memory "at most x of" a baseline)
    * ``speedup``: time(den) / time(num)           ("at least x faster than")
    * ``value``:   metric(num) itself              (e.g. extra memory, bandwidth)
    ``num`` may be ``"ours"``: evaluated for every tpo_kernels provider measured.
    """

    issue: str
    text: str
    case: str
    variant: str
    mode: str
    metric: str  # "time" | "peak" | "extra" | "throughput"
    kind: str
    num: str
    den: Optional[str]
    op: str  # "<=" | "<" | ">="
    threshold: float
    scale: float = 1.0  # value is divided by this before comparing (e.g. GiB, peak bandwidth)
    unit: str = ""


@dataclass
class Job:
    case: str
    shapes: List[dict]
    dtypes: List[str]
    variants: List[str]
    providers: List[str]
    modes: List[str]


@dataclass
class Preset:
    name: str
    device: str
    about: str
    jobs: List[Job]
    targets: List[Target]


_GiB = float(1 << 30)
H200_HBM = 4.8e12

ISSUE4_CPU = _seq(8, 8, 128, 32768, 512)
ISSUE4_GPU = _seq(16, 8, 128, 151936, 4096)
ISSUE5_CPU = _seq(8, 8, 128, 32768)
ISSUE5_GPU = _seq(16, 8, 128, 151936)
ISSUE6_CPU = {"R": 2048, "K": 8, "H": 512, "V": 32768}
ISSUE6_GPU = {"R": 8192, "K": 8, "H": 4096, "V": 151936}

PRESETS: Dict[str, Preset] = {}


def _preset(p: Preset):
    PRESETS[p.name] = p


_preset(
    Preset(
        "issue4-cpu",
        "cpu",
        "Issue 4 on CPU: fused hidden x lm_head TPO, G=8 K=8 T=128 (M=8192) H=512 V=32768 fp32, fwd+bwd: "
        "(a) naive, (b) F.linear_cross_entropy-TPO, (c) ours; dense and 90%-tied",
        [Job("fused_linear", [ISSUE4_CPU], ["fp32"], ["dense", "sparse90"], ["naive", "torch_lce", "tpo:cpu", "tpo:torch"], ["full"])],
        [
            Target("issue4", "peak memory at most that of (b) F.linear_cross_entropy-TPO", "fused_linear", "dense", "full", "peak", "ratio", "ours", "torch_lce", "<=", 1.0),
            Target("issue4", "peak memory under a quarter of (a) naive", "fused_linear", "dense", "full", "peak", "ratio", "ours", "naive", "<", 0.25),
            Target("issue4", "time at most 1.0x of (b)", "fused_linear", "dense", "full", "time", "ratio", "ours", "torch_lce", "<=", 1.0),
            Target("issue4", "90% of groups tied: time at most 0.4x of (b)", "fused_linear", "sparse90", "full", "time", "ratio", "ours", "torch_lce", "<=", 0.4),
        ],
    )
)
_preset(
    Preset(
        "issue4-gpu",
        "cuda",
        "Issue 4 on GPU: fused TPO, M=16384 (G=16 K=8 T=128) H=4096 V=151936 bf16, fwd+bwd, vs four cuBLAS matmuls",
        [
            Job(
                "fused_linear",
                [ISSUE4_GPU],
                ["bf16"],
                ["dense", "sparse90"],
                ["tpo:cuda", "tpo:triton", "matmul4", "naive", "torch_lce", "cce", "liger"],
                ["full"],
            )
        ],
        [
            Target("issue4", "time within 1.15x of four cuBLAS matmuls of the same shapes", "fused_linear", "dense", "full", "time", "ratio", "ours", "matmul4", "<=", 1.15),
            Target("issue4", "extra memory (peak minus inputs and their gradients) under 2 GiB", "fused_linear", "dense", "full", "extra", "value", "ours", None, "<", 2.0, _GiB, "GiB"),
        ],
    )
)
_preset(
    Preset(
        "issue5-cpu",
        "cpu",
        "Issue 5 on CPU: logits path fwd+bwd, cpu backend vs eager PyTorch at M=8192 V=32768 fp32 "
        "(tpo_loss on G=8 K=8 T=128, and selective_logprobs)",
        [
            Job("logits", [ISSUE5_CPU], ["fp32"], ["dense"], ["tpo:cpu", "tpo:torch", "naive"], ["full"]),
            Job("logprobs", [{"M": 8192, "V": 32768}], ["fp32"], ["dense"], ["tpo:cpu", "tpo:torch", "naive"], ["full"]),
        ],
        [
            Target("issue5", "tpo_loss fwd+bwd at least 2x faster than eager PyTorch", "logits", "dense", "full", "time", "speedup", "ours", "naive", ">=", 2.0),
            Target("issue5", "selective_logprobs fwd+bwd at least 2x faster than eager log_softmax+gather+autograd", "logprobs", "dense", "full", "time", "speedup", "ours", "naive", ">=", 2.0),
            Target("issue5", "no [M,V] fp32 temporary: tpo_loss extra memory under half of one (512 MiB)", "logits", "dense", "full", "extra", "value", "ours", None, "<", 0.5 * 8192 * 32768 * 4 / _GiB, _GiB, "GiB"),
        ],
    )
)
_preset(
    Preset(
        "issue5-gpu",
        "cuda",
        "Issue 5 on GPU: logits path fwd+bwd at M=16384 (G=16 K=8 T=128) V=151936 bf16 vs eager and torch.compile",
        [Job("logits", [ISSUE5_GPU], ["bf16"], ["dense"], ["tpo:cuda", "tpo:triton", "naive", "compile"], ["full"])],
        [
            Target("issue5", "at least 85% of H200 HBM bandwidth (4.8 TB/s) for 6*M*V bytes", "logits", "dense", "full", "throughput", "value", "ours", None, ">=", 0.85, H200_HBM / 1e9, "units of 4.8 TB/s"),
            Target("issue5", "at least 2x eager PyTorch", "logits", "dense", "full", "time", "speedup", "ours", "naive", ">=", 2.0),
            Target("issue5", "at least 1.3x torch.compile of the reference", "logits", "dense", "full", "time", "speedup", "ours", "compile", ">=", 1.3),
        ],
    )
)
_preset(
    Preset(
        "issue6-cpu",
        "cpu",
        "Issue 6 on CPU: token-level TPO, R=2048 K=8 H=512 V=32768 fp32, fused path vs full-vocab reference, fwd+bwd",
        [Job("token", [ISSUE6_CPU], ["fp32"], ["dense"], ["tpo:cpu", "tpo:torch", "naive"], ["full"])],
        [
            Target("issue6", "fused-linear token path at least 20x faster than the full-vocab reference", "token", "dense", "full", "time", "speedup", "ours", "naive", ">=", 20.0),
            Target("issue6", "no [R,V] tensor: extra memory under one [R,V] fp32 tensor (256 MiB)", "token", "dense", "full", "extra", "value", "ours", None, "<", 2048 * 32768 * 4 / _GiB, _GiB, "GiB"),
        ],
    )
)
_preset(
    Preset(
        "issue6-gpu",
        "cuda",
        "Issue 6 on GPU: token-level TPO, R=8192 K=8 H=4096 V=151936 bf16, fused path vs full-vocab reference, fwd+bwd",
        [Job("token", [ISSUE6_GPU], ["bf16"], ["dense"], ["tpo:cuda", "tpo:triton", "naive"], ["full"])],
        [
            Target("issue6", "fused-linear token path at least 20x faster than the full-vocab reference", "token", "dense", "full", "time", "speedup", "ours", "naive", ">=", 20.0),
            Target("issue6", "no [R,V] tensor: extra memory under one [R,V] bf16 tensor", "token", "dense", "full", "extra", "value", "ours", None, "<", 8192 * 151936 * 2 / _GiB, _GiB, "GiB"),
        ],
    )
)
_preset(
    Preset(
        "smoke",
        "any",
        "Tiny shapes through every case (for tests and a first look; seconds)",
        [
            Job("logits", [_seq(2, 4, 16, 512)], ["fp32"], ["dense", "sparse90"], ["tpo:cpu", "tpo:torch", "tpo:cuda", "tpo:triton", "naive"], ["forward", "backward", "full"]),
            Job("fused_linear", [_seq(2, 4, 16, 512, 64)], ["fp32"], ["dense"], ["tpo:*", "naive", "torch_lce", "matmul4"], ["full"]),
            Job("token", [{"R": 64, "K": 4, "H": 64, "V": 512}], ["fp32"], ["dense"], ["tpo:*", "tpo_logits:*", "naive"], ["full"]),
            Job("token_logits", [{"R": 64, "K": 4, "V": 512}], ["fp32"], ["dense"], ["tpo:*", "naive"], ["full"]),
            Job("logprobs", [{"M": 128, "V": 512}], ["fp32"], ["dense"], ["tpo:*", "naive"], ["full"]),
        ],
        [],
    )
)


def parse_shape(text: str) -> dict:
    """``"G=8,K=8,T=128,V=32768"`` -> dict of ints."""
    out = {}
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"shape entries look like NAME=INT, got {part!r}")
        key, value = part.split("=", 1)
        out[key.strip()] = int(value)
    return out


def shape_label(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())
