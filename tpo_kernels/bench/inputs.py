"""Seeded inputs of every case, and the probe that reads the gradient arriving at the logits.

Every provider of one comparison gets bit-identical inputs: the big tensors are drawn on the
inputs' device from one seeded generator, the small ones on the CPU from another.

Score variants: ``dense`` (every group has distinct scores) and ``sparse90`` (90% of the groups,
rounded down so the active share is never below 10%, have tied scores: the sparse-reward regime
where TPO's coefficients vanish exactly).

Candidate variant (token cases only): ``zipf`` has dense scores and candidate ids drawn from a
Zipf distribution (probability of the i-th most frequent id proportional to ``1 / i``, exponent
``ZIPF_EXPONENT``) over a seeded permutation of the vocabulary, distinct within each state: a few
ids (as in text: "the", ",", ".") appear in a large share of the states, which is what a
per-token reduction over the (state, candidate) pairs sees in training. The other variants draw
candidates uniformly (with repeats allowed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
DTYPE_SIZE = {name: torch.tensor([], dtype=dt).element_size() for name, dt in DTYPES.items()}
VARIANTS = ("dense", "sparse90", "zipf")
CANDIDATE_VARIANTS = ("zipf",)  # variants of the token cases' candidates (scores dense)
ZIPF_EXPONENT = 1.0


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
    stats: Dict[str, object] = field(default_factory=dict)  # facts about the inputs, copied into the results

    def __getitem__(self, key):
        return self.tensors[key]


class Generators:
    """A generator on the inputs' device for the big tensors and a CPU one for the small ones,
    both seeded, so every provider of a comparison gets identical inputs."""

    def __init__(self, seed: int, device):
        device = torch.device(device)
        self.dev = torch.Generator(device=device)
        self.dev.manual_seed(seed)
        self.cpu = torch.Generator()
        self.cpu.manual_seed(seed + 1)


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def sequence_tokens(shape: dict) -> int:
    """M = G * K * T of a sequence-level shape."""
    return shape["G"] * shape["K"] * shape["T"]


def make_scores(num_groups: int, k: int, variant: str, gens: Generators, device) -> Tuple[Tensor, int]:
    """``([G, K] scores, number of tied groups)``. dense: Gaussian (no ties). sparse90:
    floor(0.9 G) groups tied (all 0 or all 1, binary rewards), the others binary with at least one
    success and one failure."""
    gen = gens.cpu
    if variant in CANDIDATE_VARIANTS:
        raise ValueError(f"variant {variant!r} (candidate distribution) applies to the token cases only")
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


def _randn(shape, dtype, device, gens: Generators, scale=1.0) -> Tensor:
    """Generated where it lives, in its dtype (a 16k x 152k bf16 tensor would take seconds and
    10 GB of host memory to make on the CPU and copy)."""
    x = torch.randn(*shape, generator=gens.dev, device=device, dtype=dtype)
    return x.mul_(scale) if scale != 1.0 else x


def _randint(high, shape, device, gens: Generators) -> Tensor:
    return torch.randint(0, high, shape, generator=gens.dev, device=device)


def make_logits_inputs(shape, dtype, device, variant, seed) -> Inputs:
    g = Generators(seed, device)
    n, t, v = shape["G"] * shape["K"], shape["T"], shape["V"]
    logits = _randn((n, t, v), dtype, device, g, 2.0).requires_grad_(True)
    labels = _randint(v, (n, t), device, g)
    scores, tied = make_scores(shape["G"], shape["K"], variant, g, device)
    inp = Inputs({"logits": logits, "labels": labels, "scores": scores.reshape(-1)}, probe=Probe())
    inp.input_bytes = nbytes(logits) + nbytes(labels) + nbytes(scores)
    inp.tied_groups, inp.num_groups = tied, shape["G"]
    return inp


def make_linear_inputs(shape, dtype, device, variant, seed) -> Inputs:
    g = Generators(seed, device)
    n, t, h, v = shape["G"] * shape["K"], shape["T"], shape["H"], shape["V"]
    hidden = _randn((n, t, h), dtype, device, g).requires_grad_(True)
    weight = _randn((v, h), dtype, device, g, 1.0 / math.sqrt(h)).requires_grad_(True)
    labels = _randint(v, (n, t), device, g)
    scores, tied = make_scores(shape["G"], shape["K"], variant, g, device)
    inp = Inputs(
        {"hidden": hidden, "weight": weight, "labels": labels, "scores": scores.reshape(-1)},
        leaves={"hidden": hidden, "weight": weight},
    )
    inp.input_bytes = nbytes(hidden) + nbytes(weight) + nbytes(labels) + nbytes(scores)
    inp.kept_grad_bytes = nbytes(hidden) + nbytes(weight)
    inp.tied_groups, inp.num_groups = tied, shape["G"]
    return inp


def zipf_candidates(rows: int, k: int, vocab: int, seed: int, exponent: float = ZIPF_EXPONENT) -> Tensor:
    """``[rows, k]`` int64 candidate ids, distinct within each row, Zipf-distributed over a seeded
    permutation of ``range(vocab)`` (see the module docstring). Deterministic in ``seed``; drawn on
    the CPU."""
    if k > vocab:
        raise ValueError(f"zipf candidates: K={k} distinct ids per state need V >= K (V={vocab})")
    gen = torch.Generator().manual_seed(seed)
    probs = torch.arange(1, vocab + 1, dtype=torch.float64).pow_(-exponent)
    probs /= probs.sum()
    ids = torch.multinomial(probs, rows * k, replacement=True, generator=gen).view(rows, k)
    for _ in range(1000):  # redraw the later copies of an id within a row until every row is distinct
        ordered, where = ids.sort(dim=1)
        repeat_sorted = torch.zeros_like(ids, dtype=torch.bool)
        repeat_sorted[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
        if not bool(repeat_sorted.any()):
            break
        repeat = torch.zeros_like(repeat_sorted).scatter_(1, where, repeat_sorted)
        ids[repeat] = torch.multinomial(probs, int(repeat.sum()), replacement=True, generator=gen)
    else:  # pragma: no cover - needs an absurd K / V
        raise RuntimeError("zipf candidates: could not draw distinct ids")
    return torch.randperm(vocab, generator=gen)[ids]


def candidate_stats(candidates: Tensor) -> dict:
    """How skewed the candidate ids are: distinct ids, and the (state, candidate) pairs of the most
    frequent id (the longest per-token run a weight-gradient reduction walks)."""
    _, counts = torch.unique(candidates.reshape(-1).cpu(), return_counts=True)
    return {"candidate_pairs": int(candidates.numel()), "distinct_candidates": int(counts.numel()),
            "max_pairs_per_id": int(counts.max()) if counts.numel() else 0}


def _candidates(r, k, v, variant, device, gens: Generators, seed: int) -> Tensor:
    if variant == "zipf":
        return zipf_candidates(r, k, v, seed + 2).to(device)
    return _randint(v, (r, k), device, gens)


def _score_variant(variant: str) -> str:
    return "dense" if variant in CANDIDATE_VARIANTS else variant


def make_token_inputs(shape, dtype, device, variant, seed) -> Inputs:
    g = Generators(seed, device)
    r, k, h, v = shape["R"], shape["K"], shape["H"], shape["V"]
    hidden = _randn((r, h), dtype, device, g).requires_grad_(True)
    weight = _randn((v, h), dtype, device, g, 1.0 / math.sqrt(h)).requires_grad_(True)
    cand = _candidates(r, k, v, variant, device, g, seed)
    scores, tied = make_scores(r, k, _score_variant(variant), g, device)
    inp = Inputs(
        {"hidden": hidden, "weight": weight, "candidates": cand, "scores": scores},
        leaves={"hidden": hidden, "weight": weight},
    )
    inp.input_bytes = nbytes(hidden) + nbytes(weight) + nbytes(cand) + nbytes(scores)
    inp.kept_grad_bytes = nbytes(hidden) + nbytes(weight)
    inp.tied_groups, inp.num_groups = tied, r
    if variant in CANDIDATE_VARIANTS:
        inp.stats = candidate_stats(cand)
    return inp


def make_token_logits_inputs(shape, dtype, device, variant, seed) -> Inputs:
    g = Generators(seed, device)
    r, k, v = shape["R"], shape["K"], shape["V"]
    logits = _randn((r, v), dtype, device, g, 2.0).requires_grad_(True)
    cand = _candidates(r, k, v, variant, device, g, seed)
    scores, tied = make_scores(r, k, _score_variant(variant), g, device)
    inp = Inputs({"logits": logits, "candidates": cand, "scores": scores}, probe=Probe())
    inp.input_bytes = nbytes(logits) + nbytes(cand) + nbytes(scores)
    inp.tied_groups, inp.num_groups = tied, r
    if variant in CANDIDATE_VARIANTS:
        inp.stats = candidate_stats(cand)
    return inp


def make_logprobs_inputs(shape, dtype, device, variant, seed) -> Inputs:
    g = Generators(seed, device)
    m, v = shape["M"], shape["V"]
    logits = _randn((m, v), dtype, device, g, 2.0).requires_grad_(True)
    labels = _randint(v, (m,), device, g)
    weights = (torch.randn(m, generator=g.cpu) / m).to(device)  # upstream gradient of the log-probs
    inp = Inputs({"logits": logits, "labels": labels, "weights": weights}, probe=Probe())
    inp.input_bytes = nbytes(logits) + nbytes(labels) + nbytes(weights)
    return inp
