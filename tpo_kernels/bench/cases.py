"""Cases (what a user computes), their throughput measure and their default shape grids.

A *case* knows its shape parameters, how to build seeded inputs, which providers can compute it
and how to turn a time into a throughput. Its grids list the shapes ``tpo-kernels bench`` runs
by default on each device kind (``cpu``, ``cuda``) and with ``--quick`` (``quick-cpu``,
``quick-cuda``); each grid entry is a :class:`GridPoint`.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import inputs as I
from . import providers as P
from .inputs import DTYPE_SIZE, DTYPES, VARIANTS, sequence_tokens  # noqa: F401  (re-exported)

MODES = ("forward", "backward", "full")


@dataclass(frozen=True)
class GridPoint:
    """One shape of a grid, with its settings.

    ``variants``: the score variants measured at this shape (None: the job's). ``costly``: the
    costly providers (see ``LIMITED_PROVIDERS``) that run here, on the dense variant only; the
    default grids run them at each case's main shape only.
    """

    shape: Dict[str, int]
    variants: Optional[Tuple[str, ...]] = None
    costly: Tuple[str, ...] = ()


@dataclass
class Case:
    name: str
    title: str
    params: Tuple[str, ...]
    token_key: str  # x axis of the "vs tokens" plot
    make_inputs: Callable
    providers: List[P.Provider]
    throughput: Optional[Callable] = None
    grids: Dict[str, List[GridPoint]] = field(default_factory=dict)  # "cpu", "cuda", "quick-cpu", "quick-cuda"

    def provider(self, name: str) -> P.Provider:
        for p in self.providers:
            if p.name == name:
                return p
        raise KeyError(f"case {self.name!r} has no provider {name!r}; it has {[p.name for p in self.providers]}")

    def tokens(self, shape: dict) -> int:
        if self.token_key == "M" and "M" not in shape:
            return sequence_tokens(shape)
        return shape[self.token_key]

    def full_shape(self, shape: dict) -> dict:
        out = dict(shape)
        if self.token_key == "M" and "M" not in out:
            out["M"] = sequence_tokens(out)
        return out


# --------------------------------------------------------------------------- throughput


def bandwidth(shape, dtype, mode, seconds):
    """Effective bandwidth of the logits path: 1 pass over [M,V] forward, 2 backward (read + in-place
    write), so 3*M*V*bytes for forward+backward (= 6*M*V bytes in bf16)."""
    m = shape["M"] if "M" in shape else sequence_tokens(shape)
    passes = {"forward": 1, "backward": 2, "full": 3}[mode]
    return passes * m * shape["V"] * DTYPE_SIZE[dtype] / seconds / 1e9, "GB/s"


def flops(shape, dtype, mode, seconds):
    """Fused-linear matmul work: 2*M*V*H per matmul; 1 forward, 3 backward (recompute, dH, dW)."""
    mats = {"forward": 1, "backward": 3, "full": 4}[mode]
    return mats * 2 * sequence_tokens(shape) * shape["V"] * shape["H"] / seconds / 1e12, "TFLOP/s"


def fused_linear_traffic(shape: dict, dtype: str, device_type: str, one_gemm: bool = True,
                         out_dtype_matmul: Optional[bool] = None) -> Dict[str, Dict[str, int]]:
    """Bytes each pass of ``fused_linear_tpo_loss`` reads and writes beyond its matmuls at this
    shape and dtype under the device's default :class:`~tpo_kernels.ops.TilePolicy` (dense: every
    row with a gradient): :func:`tpo_kernels.ops.tiles.traffic_account` of the plan the forward and
    the backward take. ``one_gemm=False``: the backward's earlier plan (token chunks summed into
    an fp32 ``dW`` block accumulator), kept to measure the one-matmul plan against.
    ``out_dtype_matmul``: None follows the policy on this machine, except for CUDA here without
    one: True (what recent torch offers there)."""
    import torch

    from ..ops import TilePolicy
    from ..ops.tiles import backward_plan, tile_shape, traffic_account

    dt, rows, vocab, hidden = DTYPES[dtype], sequence_tokens(shape) if "M" not in shape else shape["M"], shape["V"], shape["H"]
    policy = TilePolicy.for_device(device_type)
    chunk = policy.chunk_size(rows, vocab)
    accum = torch.promote_types(torch.float32, dt)
    plan = backward_plan(rows, vocab, hidden, chunk, policy, dt, dt, accum, one_gemm=one_gemm)
    _, forward_block = tile_shape(rows, vocab, hidden, chunk, policy, dt, dt)
    if out_dtype_matmul is None:
        out_dtype_matmul = (True if device_type == "cuda" and not torch.cuda.is_available()
                            else policy.fused_accumulate(torch.device(device_type), dt, accum))
    return traffic_account(plan, hidden, dt, accum, out_dtype_matmul, cached=False,
                           forward_blocks=-(-vocab // forward_block))


def pass_traffic(case: str, shape: dict, dtype: str, variant: str, provider: str, mode: str,
                 device_type: str) -> Optional[int]:
    """The traffic beyond the matmuls of one benchmark row (:func:`fused_linear_traffic`): our
    fused-linear providers on the dense variant; None for the others."""
    if case != "fused_linear" or variant != "dense" or not provider.startswith(("tpo:", "tpo_cached:")):
        return None
    account = fused_linear_traffic(shape, dtype, device_type)
    passes = {"forward": ("forward",), "backward": ("backward",), "full": ("forward", "backward")}[mode]
    return sum(account[p]["total"] for p in passes)


# --------------------------------------------------------------------------- grids


def seq(g, k, t, v, h=None) -> dict:
    """A sequence-level shape: G groups of K completions of T tokens, vocabulary V, hidden size H."""
    d = {"G": g, "K": k, "T": t, "V": v}
    if h is not None:
        d["H"] = h
    return d


def _pts(*shapes: dict) -> List[GridPoint]:
    return [GridPoint(s) for s in shapes]


GPU_VOCABS = (32000, 128256, 151936, 262144)
SPARSE = ("dense", "sparse90")
_CPU_COSTLY = ("compile", "tpo:torch", "tpo_logits:torch", "torch_lce", "matmul4")  # compile: logits case only
_GPU_COSTLY = ("compile", "tpo:torch", "tpo_logits:torch")

CASES: Dict[str, Case] = {}


def _register(case: Case):
    CASES[case.name] = case


_register(Case(
    "logits", "Sequence-level TPO on materialized logits (tpo_loss)", ("G", "K", "T", "V"), "M",
    I.make_logits_inputs, P.logits_providers(), bandwidth,
    grids={
        # M = G*K*T. CPU: vocab sweep at M = 2048, token sweep at V = 32768
        "cpu": [GridPoint(seq(16, 8, 16, 32768), SPARSE, _CPU_COSTLY)]
        + _pts(*(seq(16, 8, 16, v) for v in (8192, 16384)), *(seq(g, 8, 16, 32768) for g in (8, 32))),
        "quick-cpu": [GridPoint(seq(10, 8, 8, 16384), SPARSE)] + _pts(seq(10, 8, 8, 4096), seq(20, 8, 8, 16384)),
        # GPU: vocab sweep at M = 16384 (K=8, T=128), token sweep 4096..32768 at V = 151936, K=16 once
        "cuda": [GridPoint(seq(16, 8, 128, 151936), SPARSE, _GPU_COSTLY)]
        + _pts(*(seq(16, 8, 128, v) for v in GPU_VOCABS if v != 151936), *(seq(g, 8, 128, 151936) for g in (4, 8, 32)),
               seq(8, 16, 128, 151936)),
        "quick-cuda": [GridPoint(seq(4, 8, 128, 151936), SPARSE)] + _pts(seq(4, 8, 128, 32000)),
    },
))

_register(Case(
    "fused_linear", "Sequence-level TPO fused with the lm_head matmul (fused_linear_tpo_loss)", ("G", "K", "T", "H", "V"), "M",
    I.make_linear_inputs, P.linear_providers(), flops,
    grids={
        "cpu": [GridPoint(seq(8, 8, 16, 32768, 256), SPARSE, ("tpo:torch", "torch_lce", "matmul4"))]
        + _pts(seq(8, 8, 16, 8192, 256), seq(16, 8, 16, 32768, 256)),
        "quick-cpu": [GridPoint(seq(10, 8, 8, 16384, 256), SPARSE)] + _pts(seq(10, 8, 8, 4096, 256)),
        "cuda": [GridPoint(seq(16, 8, 128, 151936, 4096), SPARSE, _GPU_COSTLY)]
        + _pts(*(seq(16, 8, 128, v, 4096) for v in GPU_VOCABS if v != 151936), *(seq(g, 8, 128, 151936, 4096) for g in (4, 8, 32)),
               seq(16, 8, 128, 151936, 2048), seq(8, 16, 128, 151936, 4096)),
        "quick-cuda": [GridPoint(seq(4, 8, 128, 151936, 2048), SPARSE)] + _pts(seq(4, 8, 128, 32000, 2048)),
    },
))


def _tok(r, k, h, v) -> dict:
    return {"R": r, "K": k, "H": h, "V": v}


_register(Case(
    "token", "Token-level TPO, K candidates per state, from hidden states (fused_linear_token_tpo_loss)", ("R", "K", "H", "V"), "R",
    I.make_token_inputs, P.token_providers(), None,
    grids={
        "cpu": [GridPoint(_tok(1024, 8, 256, 32768), costly=("tpo:torch",))] + _pts(_tok(1024, 8, 256, 8192), _tok(2048, 8, 256, 32768)),
        "quick-cpu": _pts(_tok(256, 8, 256, 16384), _tok(256, 8, 256, 4096)),
        "cuda": [GridPoint(_tok(8192, 8, 4096, 151936), ("dense", "zipf"), _GPU_COSTLY)]
        + _pts(*(_tok(8192, 8, 4096, v) for v in GPU_VOCABS if v != 151936), *(_tok(r, 8, 4096, 151936) for r in (4096, 16384)),
               _tok(8192, 16, 4096, 151936), _tok(8192, 8, 2048, 151936)),
        "quick-cuda": _pts(_tok(2048, 8, 2048, 151936), _tok(2048, 8, 2048, 32000)),
    },
))

_register(Case(
    "token_logits", "Token-level TPO on materialized logits (token_tpo_loss)", ("R", "K", "V"), "R",
    I.make_token_logits_inputs, P.token_logits_providers(), None,
    grids={
        "cpu": _pts({"R": 2048, "K": 8, "V": 32768}, {"R": 2048, "K": 8, "V": 8192}),
        "quick-cpu": _pts({"R": 512, "K": 8, "V": 16384}),
        "cuda": [GridPoint({"R": 16384, "K": 8, "V": 151936}, costly=_GPU_COSTLY)]
        + _pts({"R": 16384, "K": 8, "V": 32000}, {"R": 16384, "K": 16, "V": 151936}),
        "quick-cuda": _pts({"R": 4096, "K": 8, "V": 151936}),
    },
))

_register(Case(
    "logprobs", "Per-token log-probs with backward (selective_logprobs)", ("M", "V"), "M",
    I.make_logprobs_inputs, P.logprobs_providers(), bandwidth,
    grids={
        "cpu": [GridPoint({"M": 2048, "V": 32768}, costly=("tpo:torch",))] + _pts({"M": 2048, "V": 8192}, {"M": 8192, "V": 32768}),
        "quick-cpu": _pts({"M": 512, "V": 16384}),
        "cuda": [GridPoint({"M": 16384, "V": 151936}, costly=_GPU_COSTLY)]
        + _pts(*({"M": 16384, "V": v} for v in GPU_VOCABS if v != 151936), *({"M": m, "V": 151936} for m in (4096, 32768))),
        "quick-cuda": _pts({"M": 4096, "V": 151936}),
    },
))


# --------------------------------------------------------------------------- provider selection

# which providers the default grids consider (those that cannot run here are listed as skipped,
# with the reason); --providers replaces this list
_ALL = ["tpo:cuda", "tpo:triton", "tpo:cpu", "tpo:torch", "tpo_logits:cuda", "tpo_logits:triton", "tpo_logits:cpu",
        "tpo_logits:torch", "naive", "compile", "torch_lce", "cce", "liger", "matmul4"]
DEFAULT_PROVIDERS = {"cpu": _ALL, "cuda": _ALL}
QUICK_PROVIDERS = {
    "cpu": ["tpo:cuda", "tpo:triton", "tpo:cpu", "naive"],
    "cuda": ["tpo:cuda", "tpo:triton", "naive", "matmul4"],
}
# costly providers that the default grids run only where a GridPoint names them (dense variant)
# (torch_lce: F.linear_cross_entropy's chunked path took 15-40 s per fwd+bwd at M=1024-2048, H=256,
# V=32768 fp32 on a loaded 2-core machine, 15x its options=None reference path)
LIMITED_PROVIDERS = {"cpu": set(_CPU_COSTLY), "cuda": set(_GPU_COSTLY)}
# modes of the default grids (any subset can be asked for with --mode)
DEFAULT_MODES = {
    "cpu": {"logits": MODES},
    "cuda": {"logits": MODES, "fused_linear": MODES, "logprobs": MODES},
}


def select_providers(case: Case, patterns: Optional[Sequence[str]], device_type: str, quick: bool) -> List[P.Provider]:
    if patterns:
        return [p for p in case.providers if any(fnmatch.fnmatchcase(p.name, pat) for pat in patterns)]
    names = (QUICK_PROVIDERS if quick else DEFAULT_PROVIDERS)[device_type]
    return [p for p in case.providers if p.name in names]


# --------------------------------------------------------------------------- shapes as text


def parse_shape(text: str) -> dict:
    """``"G=8,K=8,T=128,V=32768"`` -> dict of ints."""
    out = {}
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"shape entries look like NAME=INT, got {part!r}")
        key, value = part.split("=", 1)
        try:
            out[key.strip()] = int(value)
        except ValueError:
            raise ValueError(f"shape entries look like NAME=INT, got {part!r}") from None
    return out


def shape_label(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())
