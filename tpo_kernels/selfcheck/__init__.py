"""Numerical self-check of the TPO losses on this machine: ``tpo_kernels.check(...)`` and
``tpo-kernels check``.

On the chosen device, dtype and shapes, for every backend that runs there (or the ones asked for)
and every public function ("path"), it runs

1. **gradcheck**: float64 ``torch.autograd.gradcheck`` (fast mode) of the path on small shapes;
2. **reference**: the path at the chosen shapes and dtype against :mod:`tpo_kernels.reference`
   evaluated in float64 on the same (rounded) inputs: the loss, token and sequence log-probs,
   entropies, p, q and every gradient. The float64 reference runs one chunk of rows at a time
   (16 MiB of ``[rows, V]`` each, see :mod:`.paths`), so the check's memory is the path's own at
   your shapes plus a few float64 copies of the ``[V, H]`` weight, whatever N and T are;
3. **edge cases**: the numerical edges the kernels are built for (fp32 inputs, small shapes):
   masked (-inf) vocabularies, confident tokens, logits with a large common offset, large logits
   at a low temperature (entropy), long completions, a -inf label logit on-policy, scores of
   extreme spread, exact ties;

and returns a :class:`CheckReport`: one row per quantity with its max absolute and relative error,
the tolerance and pass/fail. ``report.table()`` prints it, ``report.to_json()`` serializes it,
``report.passed`` is the verdict (the command exits non-zero on any failure).

Tolerances, and why (``eps``: unit roundoff of the compute dtype, 2^-24 for fp32 and 2^-53 for
fp64; ``eps_in``: of the input dtype; ``S``: the largest spread ``(max z - min z) / tau`` of a row
of tempered logits; ``V``, ``T``, ``H``: vocabulary, tokens per completion, hidden size):

* **token** (token log-probs, entropies, candidate logits): ``abs <= 16 eps (S + log V + 1)``. A
  log-prob is ``(z_y - max z) / tau - log sum exp(...)``: two terms of magnitude ``<= S`` and
  ``<= log V``, each a few roundings from exact (exp and log within 2 ulp, the V-term sum within
  ~log2 V ulp in the kernels' tree/lane order); 16 ulps of the largest term leave a margin of
  ~10x over what the kernels reach. The fused-linear paths add the logits' own error: the
  matmul's fp32 accumulation (``H eps |h| |W|``) and, for bf16/fp16 inputs, one rounding of each
  logit to the input dtype (``eps_in |z|``), which is what the model's own lm_head does.
* with a logit transform, **token** adds ``4 eps max |tempered logit|`` (one more rounding of each).
* **sequence** (sequence log-probs, p, q, the loss): ``abs <= T * token``: the sum of T token
  errors bounds the error of a sequence log-prob (summed in float64); p and q move by at most the
  spread of those errors and the loss by at most their size.
* **gradient**: elementwise ``|err| <= k * M + w * sequence / tau``, where ``M`` is the magnitude
  the entry is computed from (``|dL/dz|`` for logits gradients; ``|dL/dz| @ |W|`` and friends for
  the hidden, weight and bias gradients of the fused-linear paths, the classical matmul bound),
  ``k = token-relative error (16 eps (S + log V + 1)) + one rounding to the gradient's dtype +
  n eps`` for a sum of n terms, and ``w * sequence / tau`` the error the group coefficient ``p - q``
  passes on (w = 1 / groups for the mean).
* **fp64** inputs use the same formulas with fp64's eps (about 1e-13 here).
* edge cases state their own tolerance (e.g. "1% of the true-class gradient" or "1e-6 absolute")
  in the row's note.

Every path runs with the logit transforms asked for (``logit_scale``, ``logit_softcap``; the
reference applies the same ones), and gradcheck runs each logits-taking path both plain and with
a scale and a soft cap.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from ..checks.arguments import check_flag, check_int, check_logit_transform, check_positive
from ..backends import Backend, backend_status, get_backend, triton_interpreter_enabled
from .edges import _EDGE_CASES, _edge_long
from .heartbeat import Heartbeat
from .inputs import CHUNK_ELEMENTS, _make_inputs
from .paths import _REFERENCE_RUNNERS, _gradcheck
from .report import _DTYPES, PATHS, CheckReport, CheckRow, _Rows


# ----------------------------------------------------------------------------- entry point


class ArgumentError(ValueError):
    """A bad argument of :func:`check`, refused before any work. ``argument`` names it as the
    function spells it (``tpo-kernels check`` maps it to its option)."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


@contextmanager
def _argument(name: str):
    """Turn a library checker's ValueError / TypeError / RuntimeError into an ArgumentError naming ``name``."""
    try:
        yield
    except ArgumentError:
        raise
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ArgumentError(name, str(exc)) from exc


def usable_device(device: Union[str, torch.device, None]) -> torch.device:
    """``device`` as a torch.device the check (and the commands) can run on: cpu, or cuda (with an
    index below the device count) when torch sees a CUDA device; None picks cuda when present,
    else cpu. Raises ValueError naming ``device`` otherwise."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be a string or a torch.device, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be cpu or cuda[:index], got {str(device)!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda[:index], got {str(device)!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} is not available: torch {torch.__version__} sees no CUDA device "
                             f"(built with CUDA {torch.version.cuda})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r} is not available: torch sees {torch.cuda.device_count()} "
                             f"CUDA device(s)")
    return device


def _resolve(backends, device) -> List[Backend]:
    if backends is None:
        return [get_backend(name, device) for name, state in backend_status().items()
                if state == "available" and _runs_on(name, device)]
    if isinstance(backends, (str, Backend)):
        backends = [backends]
    return [get_backend(b, device) for b in backends]


def _runs_on(name: str, device) -> bool:
    try:
        get_backend(name, device)
        return True
    except (RuntimeError, ValueError):
        return False


def estimate_peak_bytes(dtype: torch.dtype, N: int, T: int, V: int, H: int) -> int:
    """A rough upper estimate of the check's memory above the process's own: the largest path's
    tensors at these shapes (logits and their gradient in ``dtype``, the hidden states, weight and
    their gradients), four float64 ``[V, H]`` tensors of the fused reference (the weight, its
    gradient, its magnitude and the gradient's bound; gradients are compared a slice of rows at a
    time), and the reference's chunks."""
    size = torch.empty((), dtype=dtype).element_size()
    rows = N * T
    path = 2 * rows * V * size + 2 * (rows * H + V * H + V) * size + 4 * rows * V  # + fp32 row buffers
    reference = 4 * V * H * 8 + 16 * CHUNK_ELEMENTS * 8 + 8 * rows * (H + 8)
    return path + reference


# The long-completion edge case redraws the first 3 tokens of all but one completion.
_MIN_LONG_TOKENS = 3


@dataclass
class CheckArguments:
    """The arguments of :func:`check`, checked and resolved (:func:`check_arguments`)."""

    device: torch.device
    dtype: torch.dtype
    backends: List[Backend]
    paths: Tuple[str, ...]
    N: int
    K: int
    T: int
    V: int
    H: int
    temperature: float
    eta: float
    logit_scale: float
    logit_softcap: Optional[float]
    long_tokens: Optional[int]
    seed: int


def check_arguments(
    *,
    device: Union[str, torch.device, None] = None,
    dtype: Union[str, torch.dtype] = torch.float32,
    backends: Optional[Sequence[Union[str, Backend]]] = None,
    paths: Optional[Sequence[str]] = None,
    N: int = 8,
    K: int = 4,
    T: int = 16,
    V: int = 256,
    H: int = 64,
    temperature: float = 0.7,
    eta: float = 0.5,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    long_tokens: Optional[int] = None,
    seed: int = 0,
) -> CheckArguments:
    """Check the arguments of :func:`check` (same names and defaults) without running anything;
    raises :class:`ArgumentError` naming the first bad one. The hyper-parameters go through the
    checks every public loss applies to them (``eta``, ``temperature``, ``logit_scale``,
    ``logit_softcap``), so the check refuses exactly what the functions it checks refuse."""
    with _argument("device"):
        device = usable_device(device)
    with _argument("dtype"):
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ValueError(f"dtype must be one of {sorted(set(_DTYPES))}, got {dtype!r}")
            dtype = _DTYPES[dtype]
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or float64, got {dtype}")
    with _argument("paths"):
        paths = tuple(PATHS if paths is None else paths)
        unknown = [p for p in paths if p not in PATHS]
        if unknown or not paths:
            raise ValueError(f"paths must be among {PATHS}, got {unknown or 'none'}")
    shape = {}
    for name, value in (("N", N), ("K", K), ("T", T), ("V", V), ("H", H)):
        with _argument(name):
            shape[name] = check_int(name, value, 1)
    if shape["N"] % shape["K"]:
        raise ArgumentError("K", f"K must divide N (groups of K completions), got N={N}, K={K}")
    if shape["K"] > shape["V"]:
        raise ArgumentError("K", f"K (candidates per state) must be <= V, got K={K}, V={V}")
    with _argument("temperature"):
        temperature = check_positive("temperature", temperature)
    with _argument("eta"):
        eta = check_positive("eta", eta)
    try:
        logit_scale, logit_softcap = check_logit_transform(logit_scale, logit_softcap, 1.0 / temperature)
    except (ValueError, TypeError) as exc:  # its message names the argument (or the factor) at fault
        raise ArgumentError("logit_softcap" if "logit_softcap" in str(exc) else "logit_scale", str(exc)) from exc
    if long_tokens is not None:
        with _argument("long_tokens"):
            long_tokens = check_int("long_tokens", long_tokens, _MIN_LONG_TOKENS)
    with _argument("seed"):
        seed = check_int("seed", seed, -(2 ** 63))  # what torch.Generator.manual_seed takes
        if seed >= 2 ** 64:
            raise ValueError(f"seed must be below 2**64 (a torch.Generator seed), got {seed}")
    with _argument("backends"):
        chosen = _resolve(backends, device)
        if not chosen:
            raise RuntimeError(f"no backend runs on {device} here: {backend_status()}")
    return CheckArguments(device=device, dtype=dtype, backends=chosen, paths=paths, temperature=temperature, eta=eta,
                          logit_scale=logit_scale, logit_softcap=logit_softcap, long_tokens=long_tokens, seed=seed, **shape)


def check(
    *,
    device: Union[str, torch.device, None] = None,
    dtype: Union[str, torch.dtype] = torch.float32,
    backends: Optional[Sequence[Union[str, Backend]]] = None,
    paths: Optional[Sequence[str]] = None,
    N: int = 8,
    K: int = 4,
    T: int = 16,
    V: int = 256,
    H: int = 64,
    temperature: float = 0.7,
    eta: float = 0.5,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    gradcheck: bool = True,
    edge_cases: bool = True,
    long_tokens: Optional[int] = None,
    seed: int = 0,
    progress: Optional[Callable[[str], None]] = None,
    progress_interval: Optional[float] = None,
) -> CheckReport:
    """Check every backend and path numerically on this machine; see the module docstring.

    Args:
        device: where to run (default: CUDA when present, else CPU).
        dtype: input dtype of the reference section (float32, bfloat16, float16, float64; a name
            works too). Gradcheck runs in float64 and the edge cases in float32 whatever it is.
        backends: names or :class:`~tpo_kernels.backends.Backend` instances (default: every backend
            that runs on ``device``).
        paths: a subset of :data:`PATHS` (default: all seven public functions).
        N, K, T, V, H: completions, group size (also candidates per state), tokens per
            completion, vocabulary and hidden size of the reference section (token-level paths use
            ``N * T`` states with K candidates each).
        temperature, eta, logit_scale, logit_softcap: the hyper-parameters of the reference section.
        gradcheck, edge_cases: run those sections.
        long_tokens: completion length of the long-completion edge case (default 32768; 1024
            under the Triton interpreter, which runs one Python program per row).
        seed: of the random inputs.
        progress: called with one line of text before the work (what runs, a memory estimate),
            after each backend and path, and whenever ``progress_interval`` seconds pass without a
            line (what runs now and for how long; this one from a helper thread).
        progress_interval: seconds (default :data:`~.heartbeat.PROGRESS_INTERVAL_S`, 15).

    Every argument is checked before any work (:func:`check_arguments`): a bad one raises
    :class:`ArgumentError` (a ValueError) naming it.
    """
    start = time.perf_counter()
    args = check_arguments(device=device, dtype=dtype, backends=backends, paths=paths, N=N, K=K, T=T, V=V, H=H,
                           temperature=temperature, eta=eta, logit_scale=logit_scale, logit_softcap=logit_softcap,
                           long_tokens=long_tokens, seed=seed)
    for name, flag in (("gradcheck", gradcheck), ("edge_cases", edge_cases)):
        with _argument(name):
            check_flag(name, flag)
    if progress_interval is not None:
        with _argument("progress_interval"):
            check_positive("progress_interval", progress_interval)
    beat = Heartbeat(progress or (lambda line: None), progress_interval, indent="")
    if progress is None:
        return _run_check(args, gradcheck, edge_cases, beat, start)
    with beat:
        return _run_check(args, gradcheck, edge_cases, beat, start)


def _run_check(args: CheckArguments, gradcheck: bool, edge_cases: bool, beat: Heartbeat, start: float) -> CheckReport:
    device, dtype, chosen, paths = args.device, args.dtype, args.backends, args.paths
    N, K, T, V, H = args.N, args.K, args.T, args.V, args.H
    say = beat.say
    report = CheckReport(device=str(device), dtype=str(dtype).replace("torch.", ""),
                         shapes=dict(N=N, K=K, T=T, V=V, H=H), backends=[b.name for b in chosen])
    sections = [s for s, on in (("gradcheck", gradcheck), ("reference", True), ("edge cases", edge_cases)) if on]
    say(f"tpo_kernels check on {device}, {report.dtype}, N={N} K={K} T={T} V={V} H={H}: "
        f"{len(chosen)} backend(s) ({', '.join(report.backends)}) x {len(paths)} path(s); {', '.join(sections)}")
    say(f"estimated peak memory: {estimate_peak_bytes(dtype, N, T, V, H) / 2**30:.2f} GiB above the process's own "
        f"(inputs: logits {N * T * V * torch.empty((), dtype=dtype).element_size() / 2**30:.2f} GiB)")
    beat.stage("making the inputs")
    inputs = _make_inputs(device, dtype, (N, K, T, V, H), temperature=args.temperature, eta=args.eta, seed=args.seed,
                          logit_scale=args.logit_scale, logit_softcap=args.logit_softcap)
    step, steps = 0, len(chosen) * (len(paths) + int(edge_cases))
    for backend in chosen:
        for path in paths:
            began, before = time.perf_counter(), len(report.rows)
            where = f"[{step + 1}/{steps}] {backend.name} {path}"
            if gradcheck:
                beat.stage(f"{where}: gradcheck")
                _gradcheck(_Rows(report, "gradcheck", backend.name, path), backend, path, device)
            beat.stage(f"{where}: reference")
            rows = _Rows(report, "reference", backend.name, path)
            try:
                _REFERENCE_RUNNERS[path](rows, backend, inputs)
            except Exception as exc:  # a crash is a failed check, reported like one
                rows.error("runs", exc)
            step += 1
            say(_progress_line(step, steps, backend.name, path, report.rows[before:], began))
        if edge_cases:
            began, before = time.perf_counter(), len(report.rows)
            rows = _Rows(report, "edge", backend.name, "fp32")
            tokens = args.long_tokens
            if tokens is None:
                tokens = 1024 if backend.name == "triton" and device.type == "cpu" and triton_interpreter_enabled() else 32768
            cases = [(case.__name__.replace("_edge_", ""), case) for case in _EDGE_CASES]
            cases.append((f"long ({tokens} tokens)", lambda r, b, d: _edge_long(r, b, d, tokens)))
            for name, case in cases:
                beat.stage(f"[{step + 1}/{steps}] {backend.name} edge cases: {name}")
                try:
                    case(rows, backend, device)
                except Exception as exc:
                    rows.error(name, exc)
            step += 1
            say(_progress_line(step, steps, backend.name, "edge cases", report.rows[before:], began))
    report.seconds = time.perf_counter() - start
    return report


def _progress_line(step: int, steps: int, backend: str, what: str, rows: List[CheckRow], began: float) -> str:
    failed = sum(not r.passed for r in rows)
    verdict = "PASS" if failed == 0 else f"FAIL ({failed} of {len(rows)})"
    return f"[{step}/{steps}] {backend:6s} {what:28s} {len(rows):3d} checks {verdict}  {time.perf_counter() - began:.1f} s"


__all__ = ["PATHS", "ArgumentError", "CheckArguments", "CheckReport", "CheckRow", "check", "check_arguments",
           "estimate_peak_bytes", "usable_device"]
