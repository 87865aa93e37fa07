"""Rows of the check, the report (table, JSON, verdict) and how errors are measured."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List

import torch
from torch import Tensor


PATHS = ("tpo_loss", "fused_linear_tpo_loss", "tpo_loss_from_logprobs", "token_tpo_loss",
         "fused_linear_token_tpo_loss", "selective_logprobs", "fused_linear_logprobs")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}


def _unit(dtype: torch.dtype) -> float:
    return {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8,
            torch.float16: 2.0 ** -11}[dtype]


@dataclass
class CheckRow:
    """One checked quantity: its worst errors, the tolerance and the verdict."""

    section: str  # "gradcheck", "reference" or "edge"
    backend: str
    path: str
    quantity: str
    max_abs: float
    max_rel: float
    tolerance: str  # the bound, in words and numbers
    passed: bool
    note: str = ""


@dataclass
class CheckReport:
    """What :func:`check` found. ``passed`` is False when any row failed."""

    device: str
    dtype: str
    shapes: Dict[str, int]
    backends: List[str]
    rows: List[CheckRow] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(row.passed for row in self.rows)

    @property
    def failures(self) -> List[CheckRow]:
        return [row for row in self.rows if not row.passed]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["passed"] = self.passed
        out["tolerances"] = TOLERANCE_NOTES
        for row in out["rows"]:  # JSON has no inf / nan
            for key in ("max_abs", "max_rel"):
                if not math.isfinite(row[key]):
                    row[key] = str(row[key])
        return out

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def table(self) -> str:
        head = ("section", "backend", "path", "quantity", "max abs err", "max rel err", "tolerance", "")
        body = [(r.section, r.backend, r.path, r.quantity, _fmt(r.max_abs), _fmt(r.max_rel), r.tolerance,
                 "PASS" if r.passed else "FAIL") for r in self.rows]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
        lines = [f"tpo_kernels check on {self.device}, {self.dtype}, shapes "
                 + ", ".join(f"{k}={v}" for k, v in self.shapes.items())
                 + f"; backends: {', '.join(self.backends)}"]
        for row in [head] + body:
            lines.append("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
        notes = sorted({r.note for r in self.rows if r.note})
        if notes:
            lines.append("notes:")
            lines.extend(f"  {n}" for n in notes)
        lines.append("tolerances:")
        lines.extend(f"  {k}: {v}" for k, v in TOLERANCE_NOTES.items())
        failed = len(self.failures)
        lines.append(f"{len(self.rows)} checks, {failed} failed, {self.seconds:.1f} s: "
                     + ("PASS" if failed == 0 else "FAIL"))
        return "\n".join(lines)


TOLERANCE_NOTES = {
    "token": "abs <= 16 eps (S + log V + 1) [+ the fused matmul's H eps |h||W| and, for bf16/fp16 "
             "inputs, one rounding of each logit eps_in |z|]: a log-prob is two terms of size <= S and "
             "<= log V, each a few roundings from exact",
    "sequence": "abs <= T x token: a sequence log-prob sums T token log-probs (in float64); p, q and "
                "the loss move by at most that",
    "gradient": "|err| <= k M + w sequence / tau elementwise: M the magnitude the entry is computed "
                "from (|dL/dz|, or |dL/dz| @ |W| etc. for the fused paths), k = token-relative error + "
                "one rounding to the gradient dtype + n eps for a sum of n terms",
    "gradcheck": "torch.autograd.gradcheck in float64 (fast mode), its default eps/atol/rtol decide; the "
                 "errors shown are of one random directional derivative (central differences, step 1e-6)",
    "edge": "per case, in its note",
}


def _fmt(x: float) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return f"{x:.2e}"


# ----------------------------------------------------------------------------- comparing


def _errors(actual: Tensor, expected: Tensor):
    """(|a - e| elementwise in float64 on the CPU, max abs, max rel); equal infinities are 0 and
    a NaN where the reference is not counts as inf."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    diff = torch.where(a == e, torch.zeros((), dtype=torch.float64), (a - e).abs())
    diff = torch.where(torch.isnan(a) & ~torch.isnan(e), torch.full((), math.inf, dtype=torch.float64), diff)
    if diff.numel() == 0:
        return diff, 0.0, 0.0
    # Relative to entries above 2^-24 of the largest: smaller ones (exp underflow, cancellation)
    # carry no relative information; the bounds are absolute anyway.
    finite = e[torch.isfinite(e)].abs()
    floor = max(float(finite.max()) * 2.0 ** -24, 1e-300) if finite.numel() else 1e-300
    rel = torch.where(diff == 0, torch.zeros((), dtype=torch.float64), diff / e.abs().clamp_min(floor))
    return diff, float(diff.max()), float(rel.max())


class _Rows:
    """Collects the rows of one (section, backend, path)."""

    def __init__(self, report: CheckReport, section: str, backend: str, path: str):
        self.report, self.section, self.backend, self.path = report, section, backend, path

    def add(self, quantity, max_abs, max_rel, tolerance, passed, note=""):
        self.report.rows.append(CheckRow(section=self.section, backend=self.backend, path=self.path, quantity=quantity,
                                         max_abs=float(max_abs), max_rel=float(max_rel), tolerance=tolerance,
                                         passed=bool(passed), note=note))

    def abs_bound(self, quantity, actual, expected, atol, note=""):
        diff, max_abs, max_rel = _errors(actual, expected)
        self.add(quantity, max_abs, max_rel, f"abs {atol:.1e}", max_abs <= atol, note)

    def elementwise(self, quantity, actual, expected, bound: Tensor, label: str, note=""):
        """|err| <= bound elementwise; the tolerance column shows the largest bound."""
        diff, max_abs, max_rel = _errors(actual, expected)
        bound = bound.detach().double().cpu().expand_as(diff)
        ok = bool((diff <= bound).all())
        self.add(quantity, max_abs, max_rel, f"{label} <= {float(bound.max()):.1e}", ok, note)

    def accumulated(self, quantity, acc: "_Accumulated", note=""):
        self.add(quantity, acc.max_abs, acc.max_rel, acc.tolerance(), acc.ok, note)

    def error(self, quantity, exc: BaseException):
        self.add(quantity, math.nan, math.nan, "runs", False, f"{type(exc).__name__}: {str(exc)[:160]}")


# Entries one comparison of _Accumulated takes at a time (2^21: 16 MiB of float64).
_COMPARE_ELEMENTS = 1 << 21


class _Accumulated:
    """``|actual - expected| <= bound`` elementwise over the chunks of one tensor, for a row of the
    report once every chunk is in (relative errors: each chunk against its own largest entry)."""

    def __init__(self, label: str = "gradient"):
        self.label, self.ok = label, True
        self.max_abs = self.max_rel = self.max_bound = 0.0

    def add(self, actual: Tensor, expected: Tensor, bound) -> None:
        """Compare one chunk; a large one (a ``[V, H]`` weight gradient) is compared a slice of
        rows at a time, so that its float64 temporaries stay ~16 MiB each."""
        bound = torch.as_tensor(bound, dtype=torch.float64)
        if actual.dim() == 0 or actual.numel() <= _COMPARE_ELEMENTS:
            return self._add(actual, expected, bound)
        per_row = bound.dim() == actual.dim() and bound.shape[0] == actual.shape[0]
        step = max(1, _COMPARE_ELEMENTS // max(actual[0].numel(), 1))
        for start in range(0, actual.shape[0], step):
            rows = slice(start, start + step)
            self._add(actual[rows], expected[rows], bound[rows] if per_row else bound)

    def _add(self, actual: Tensor, expected: Tensor, bound: Tensor) -> None:
        diff, max_abs, max_rel = _errors(actual, expected)
        bound = bound.detach().double().cpu().expand_as(diff)
        self.ok = self.ok and bool((diff <= bound).all())
        self.max_abs, self.max_rel = max(self.max_abs, max_abs), max(self.max_rel, max_rel)
        if bound.numel():
            self.max_bound = max(self.max_bound, float(bound.max()))

    def tolerance(self) -> str:
        return f"abs {self.max_bound:.1e}" if self.label == "abs" else f"{self.label} <= {self.max_bound:.1e}"
