"""Presets: named settings (case, shapes, dtypes, variants, providers, modes) that measure one
question, and the targets whose verdicts they print (``tpo-kernels bench --preset NAME``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from .cases import seq
from .inputs import sequence_tokens


@dataclass
class Target:
    """One number a preset checks. ``kind``:

    * ``ratio``:   metric(num) / metric(den)      (time or memory "at most x of" a baseline)
    * ``speedup``: time(den) / time(num)           ("at least x faster than")
    * ``value``:   metric(num) itself              (e.g. extra memory, bandwidth)
    ``num`` may be ``"ours"`` (evaluated for every tpo_kernels provider measured) or a provider
    name or glob (``"tpo:*"``: every backend without the logits cache). ``metric``
    ``kernel_throughput`` is the bandwidth of the kernel-only stage times (``kernel_times``);
    ``extra_beyond_cache`` is ``extra`` minus the logits cache budget the provider was given
    (``tpo_cached:*``; results without a recorded budget are 'not measured').
    ``relative="copy"``: the value is divided by the copy bandwidth measured in the same run on
    the same device (``calibrate.copy_bandwidth``) instead of by ``scale``.
    """

    text: str
    case: str
    variant: str
    mode: str
    metric: str  # "time" | "peak" | "extra" | "extra_beyond_cache" | "over_grads" | "throughput" | "kernel_throughput"
    kind: str
    num: str
    den: Optional[str]
    op: str  # "<=" | "<" | ">="
    threshold: float
    scale: float = 1.0  # value is divided by this before comparing (e.g. GiB, peak bandwidth)
    unit: str = ""
    preset: str = ""  # filled in by the preset that holds it
    relative: Optional[str] = None  # "copy": a fraction of the run's measured copy bandwidth


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
    device: str  # "cpu", "cuda" or "any"
    about: str
    jobs: List[Job]
    targets: List[Target]


GiB = float(1 << 30)

PRESETS: Dict[str, Preset] = {}


def _preset(p: Preset):
    for t in p.targets:
        t.preset = p.name
    PRESETS[p.name] = p


def _full(case, variant, metric, kind, num, den, op, threshold, text, scale=1.0, unit="", relative=None):
    return Target(text, case, variant, "full", metric, kind, num, den, op, threshold, scale, unit, relative=relative)


_FL_CPU = seq(8, 8, 128, 32768, 512)
_preset(Preset(
    "fused-linear-cpu", "cpu",
    "Fused hidden x lm_head TPO against naive and F.linear_cross_entropy-TPO: peak memory and time, "
    "G=8 K=8 T=128 (M=8192) H=512 V=32768 fp32, fwd+bwd; dense and 90%-tied",
    [Job("fused_linear", [_FL_CPU], ["fp32"], ["dense", "sparse90"], ["naive", "torch_lce", "tpo:cpu", "tpo:torch"], ["full"])],
    [
        _full("fused_linear", "dense", "peak", "ratio", "ours", "torch_lce", "<=", 1.0, "peak memory at most that of F.linear_cross_entropy-TPO"),
        _full("fused_linear", "dense", "peak", "ratio", "ours", "naive", "<", 0.25, "peak memory under a quarter of naive"),
        _full("fused_linear", "dense", "time", "ratio", "ours", "torch_lce", "<=", 1.0, "time at most that of F.linear_cross_entropy-TPO"),
        _full("fused_linear", "sparse90", "time", "ratio", "ours", "torch_lce", "<=", 0.4,
              "90% of groups tied: time at most 0.4x of F.linear_cross_entropy-TPO"),
    ],
))
# Extra memory of the fused-linear path on the GPU preset beyond what it must hold: its tiles and
# per-token scalars. The logits cache adds its budget (every token's logits here: M*V*2 bytes,
# 4.64 GiB at M=16384 V=151936 bf16) and nothing else: the forward writes each tile's logits into
# the cache and the backward reads them there instead of recomputing them into a tile buffer, so
# the cached providers get the same overhead on top of their budget.
_FL_GPU = seq(16, 8, 128, 151936, 4096)
_FL_GPU_OVERHEAD_GIB = 2.0
_FL_GPU_CACHE_GIB = sequence_tokens(_FL_GPU) * _FL_GPU["V"] * 2 / GiB
_preset(Preset(
    "fused-linear-gpu", "cuda",
    "Fused hidden x lm_head TPO against the matmul floors and the peers (fused cross-entropy kernels, chunked "
    "log-probs, torch.compile), with and without the logits cache: M=16384 (G=16 K=8 T=128) H=4096 V=151936 bf16, fwd+bwd",
    [Job("fused_linear", [_FL_GPU], ["bf16"], ["dense", "sparse90"],
         ["tpo:cuda", "tpo:triton", "tpo_cached:cuda", "tpo_cached:triton", "matmul4", "matmul3", "naive", "compile",
          "torch_lce", "cce", "cce_compile", "liger", "liger_chunked"], ["full"])],
    [
        _full("fused_linear", "dense", "time", "ratio", "ours", "matmul4", "<=", 1.15, "time within 1.15x of four cuBLAS matmuls of the same shapes"),
        _full("fused_linear", "dense", "extra", "value", "tpo:*", None, "<", _FL_GPU_OVERHEAD_GIB,
              f"without the cache: extra memory (peak minus inputs and their gradients) under "
              f"{_FL_GPU_OVERHEAD_GIB:g} GiB", GiB, "GiB"),
        _full("fused_linear", "dense", "extra_beyond_cache", "value", "tpo_cached:*", None, "<", _FL_GPU_OVERHEAD_GIB,
              f"with the cache: extra memory under its budget (every token's logits, M*V*2 bytes: "
              f"{_FL_GPU_CACHE_GIB:.2f} GiB at this shape) plus {_FL_GPU_OVERHEAD_GIB:g} GiB", GiB, "GiB"),
        *(_full("fused_linear", "dense", "time", "ratio", f"tpo:{b}", "matmul4", "<=", 1.10,
                "without the cache: time within 1.10x of four cuBLAS matmuls") for b in ("cuda", "triton")),
        *(_full("fused_linear", "dense", "time", "ratio", f"tpo_cached:{b}", "matmul3", "<=", 1.05,
                "with the cache of every token: time within 1.05x of three cuBLAS matmuls") for b in ("cuda", "triton")),
        *(_full("fused_linear", "dense", "time", "ratio", f"tpo_cached:{b}", peer, "<=", 1.0,
                f"with the cache: time at most that of {peer}") for b in ("cuda", "triton") for peer in ("cce", "liger")),
    ],
))
# M = 4096 tokens: the logits cache against eager, torch.compile and the peers (every group with
# signal), each provider in a fresh process.
_FL_PEERS_CPU = seq(4, 8, 128, 32768, 512)
_preset(Preset(
    "fused-linear-peers-cpu", "cpu",
    "Fused hidden x lm_head TPO with and without the logits cache against eager, torch.compile and the peers "
    "(Cut Cross-Entropy torch_compile, Liger-Kernel chunked log-probs): G=4 K=8 T=128 (M=4096) H=512 V=32768 fp32, "
    "fwd+bwd, every group with signal",
    [Job("fused_linear", [_FL_PEERS_CPU], ["fp32"], ["dense"],
         ["tpo:cpu", "tpo_cached:cpu", "naive", "compile", "cce_compile", "liger_chunked"], ["full"])],
    [
        _full("fused_linear", "dense", "time", "ratio", "tpo_cached:cpu", "naive", "<=", 0.85,
              "with the cache of every token: time at most 0.85x of eager"),
        _full("fused_linear", "dense", "time", "ratio", "tpo_cached:cpu", "cce_compile", "<=", 1.0,
              "with the cache: time at most that of Cut Cross-Entropy's torch_compile"),
        _full("fused_linear", "dense", "peak", "ratio", "tpo_cached:cpu", "cce_compile", "<=", 1.0,
              "with the cache: peak memory at most that of Cut Cross-Entropy's torch_compile"),
        _full("fused_linear", "dense", "peak", "ratio", "tpo_cached:cpu", "naive", "<=", 1.0,
              "with the cache: peak memory at most that of eager"),
        _full("fused_linear", "dense", "over_grads", "value", "tpo:cpu", None, "<=", 1.25,
              "default (no cache): peak beyond the inputs at most 1.25x the bytes of dH + dW (the floor)", unit="x"),
    ],
))
# The fused head's backward alone against its matmul floor: with the cache of every token it is
# two matmuls (dH, dW: matmul3's backward), without it three (the recompute too: matmul4's
# backward). Both measured in the same run, so the ratios hold on a shared machine.
_FL_BWD_CPU = seq(4, 8, 128, 32768, 512)
_preset(Preset(
    "fused-backward-cpu", "cpu",
    "The fused head's backward alone, cached and recomputed, against two and three matmuls of the same shapes "
    "(matmul3's and matmul4's backward): G=4 K=8 T=128 (M=4096) H=512 V=32768 fp32, every group with signal",
    [Job("fused_linear", [_FL_BWD_CPU], ["fp32"], ["dense"], ["tpo:cpu", "tpo_cached:cpu", "matmul3", "matmul4"],
         ["backward"])],
    [
        Target("with the cache of every token: backward within 1.10x of two matmuls (dH, dW)", "fused_linear", "dense",
               "backward", "time", "ratio", "tpo_cached:cpu", "matmul3", "<=", 1.10),
        Target("without the cache: backward within 1.10x of three matmuls (recompute, dH, dW)", "fused_linear", "dense",
               "backward", "time", "ratio", "tpo:cpu", "matmul4", "<=", 1.10),
    ],
))
_preset(Preset(
    "logits-speedup-cpu", "cpu",
    "Logits path against eager PyTorch, fwd+bwd at M=8192 V=32768 fp32: tpo_loss on G=8 K=8 T=128 "
    "(time and extra memory) and selective_logprobs (time)",
    [
        Job("logits", [seq(8, 8, 128, 32768)], ["fp32"], ["dense"], ["tpo:cpu", "tpo:torch", "naive"], ["full"]),
        Job("logprobs", [{"M": 8192, "V": 32768}], ["fp32"], ["dense"], ["tpo:cpu", "tpo:torch", "naive"], ["full"]),
    ],
    [
        _full("logits", "dense", "time", "speedup", "ours", "naive", ">=", 2.0, "tpo_loss fwd+bwd at least 2x faster than eager PyTorch"),
        _full("logprobs", "dense", "time", "speedup", "ours", "naive", ">=", 2.0,
              "selective_logprobs fwd+bwd at least 2x faster than eager log_softmax+gather+autograd"),
        _full("logits", "dense", "extra", "value", "ours", None, "<", 0.5 * 8192 * 32768 * 4 / GiB,
              "no [M,V] fp32 temporary: tpo_loss extra memory under half of one (512 MiB)", GiB, "GiB"),
    ],
))
_preset(Preset(
    "logits-speedup-gpu", "cuda",
    "Logits path against eager PyTorch and torch.compile, and as a share of the copy bandwidth measured in the same run, "
    "kernel-only and end to end: tpo_loss fwd+bwd at M=16384 (G=16 K=8 T=128) V=151936 bf16 (targets set for an H200)",
    [Job("logits", [seq(16, 8, 128, 151936)], ["bf16"], ["dense"], ["tpo:cuda", "tpo:triton", "naive", "compile"], ["full"])],
    [
        _full("logits", "dense", "kernel_throughput", "value", "ours", None, ">=", 0.90,
              "kernel-only (row fwd + group op + row bwd) at least 90% of the measured copy bandwidth for 6*M*V bytes",
              unit="of copy", relative="copy"),
        _full("logits", "dense", "throughput", "value", "ours", None, ">=", 0.80,
              "end to end (tpo_loss fwd+bwd) at least 80% of the measured copy bandwidth for 6*M*V bytes",
              unit="of copy", relative="copy"),
        _full("logits", "dense", "time", "speedup", "ours", "naive", ">=", 2.0, "at least 2x eager PyTorch"),
        _full("logits", "dense", "time", "speedup", "ours", "compile", ">=", 1.3, "at least 1.3x torch.compile of the reference"),
    ],
))
_preset(Preset(
    "token-level-speedup-cpu", "cpu",
    "Token-level TPO, fused path against the full-vocab reference: time and extra memory, "
    "R=2048 K=8 H=512 V=32768 fp32, fwd+bwd; uniform and Zipf-distributed candidates",
    [Job("token", [{"R": 2048, "K": 8, "H": 512, "V": 32768}], ["fp32"], ["dense", "zipf"], ["tpo:cpu", "tpo:torch", "naive"], ["full"])],
    [
        _full("token", "dense", "time", "speedup", "ours", "naive", ">=", 20.0, "fused-linear token path at least 20x faster than the full-vocab reference"),
        _full("token", "zipf", "time", "speedup", "ours", "naive", ">=", 20.0,
              "Zipf-distributed candidates: at least 20x faster than the full-vocab reference"),
        _full("token", "dense", "extra", "value", "ours", None, "<", 2048 * 32768 * 4 / GiB,
              "no [R,V] tensor: extra memory under one [R,V] fp32 tensor (256 MiB)", GiB, "GiB"),
    ],
))
_preset(Preset(
    "token-level-speedup-gpu", "cuda",
    "Token-level TPO, fused path against the full-vocab reference: time and extra memory, "
    "R=8192 K=8 H=4096 V=151936 bf16, fwd+bwd; uniform and Zipf-distributed candidates",
    [Job("token", [{"R": 8192, "K": 8, "H": 4096, "V": 151936}], ["bf16"], ["dense", "zipf"], ["tpo:cuda", "tpo:triton", "naive"], ["full"])],
    [
        _full("token", "dense", "time", "speedup", "ours", "naive", ">=", 20.0, "fused-linear token path at least 20x faster than the full-vocab reference"),
        _full("token", "zipf", "time", "speedup", "ours", "naive", ">=", 20.0,
              "Zipf-distributed candidates: at least 20x faster than the full-vocab reference"),
        _full("token", "dense", "extra", "value", "ours", None, "<", 8192 * 151936 * 2 / GiB,
              "no [R,V] tensor: extra memory under one [R,V] bf16 tensor", GiB, "GiB"),
    ],
))
_preset(Preset(
    "smoke", "any",
    "Tiny shapes through every case (for tests and a first look; seconds)",
    [
        Job("logits", [seq(2, 4, 16, 512)], ["fp32"], ["dense", "sparse90"], ["tpo:cpu", "tpo:torch", "tpo:cuda", "tpo:triton", "naive"],
            ["forward", "backward", "full"]),
        Job("fused_linear", [seq(2, 4, 16, 512, 64)], ["fp32"], ["dense"], ["tpo:*", "naive", "torch_lce", "matmul4"], ["full"]),
        Job("token", [{"R": 64, "K": 4, "H": 64, "V": 512}], ["fp32"], ["dense", "zipf"], ["tpo:*", "tpo_logits:*", "naive"], ["full"]),
        Job("token_logits", [{"R": 64, "K": 4, "V": 512}], ["fp32"], ["dense"], ["tpo:*", "naive"], ["full"]),
        Job("logprobs", [{"M": 128, "V": 512}], ["fp32"], ["dense"], ["tpo:*", "naive"], ["full"]),
    ],
    [],
))
