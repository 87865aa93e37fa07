"""Triton kernels compiled exactly as their launchers specialize them, without a GPU."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections import OrderedDict
from typing import Callable, Iterable, List, Optional, Sequence, Tuple
from .parse import DEFAULT_DTYPES, DEFAULT_VOCABS, KernelRow, ReportError
from .tools import find_cuobjdump, inspect_binary, load_toolkit, package_dir, triton_tool


# --------------------------------------------------------------------------- Triton


@dataclasses.dataclass
class Scenario:
    """One call of a backend operation; every kernel it launches is attributed to ``label``."""

    label: str
    dtype: str
    call: Callable[[object], None]  # receives the TritonBackend

    @property
    def op(self) -> str:
        """The op whose kernels the call launches: row, candidate or group (``--ops``)."""
        return self.label.split()[0]


def triton_scenarios(vocabs: Sequence[int] = DEFAULT_VOCABS, dtypes: Sequence[str] = DEFAULT_DTYPES,
                     hidden: int = 4096, num_cand: int = 8) -> List[Scenario]:
    """The calls whose launches are compiled: every operation of the Triton backend, in every dtype
    its launcher takes, at representative shapes (see the module docstring)."""
    import torch

    from tpo_kernels.backends.kept_sets import KeptSets
    from tpo_kernels.group_math import build_layout, pair_runs

    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
    out: List[Scenario] = []

    def acc_of(dt):
        return torch.float64 if dt == torch.float64 else torch.float32

    for name in dtypes:
        dt = torch_dtypes[name]
        acc = acc_of(dt)
        for vocab in vocabs:
            def row_ops(backend, dt=dt, acc=acc, vocab=vocab, entropy=False):
                logits = torch.randn(2, vocab).to(dt)
                labels = torch.tensor([1, vocab - 1])
                summary = backend.row_forward(logits, labels, inv_temperature=1.0, with_entropy=entropy)
                g = torch.ones(2, dtype=acc)
                backend.row_backward(logits, labels, summary, g, grad_entropy=g if entropy else None,
                                     inv_temperature=1.0, out=logits)

            out.append(Scenario(f"row fwd+bwd V={vocab}", name, row_ops))
            out.append(Scenario(f"row fwd+bwd V={vocab} entropy", name,
                                lambda b, f=row_ops: f(b, entropy=True)))

            def row_ops_unaligned(backend, dt=dt, acc=acc, vocab=vocab, entropy=False):
                # logits[:, 1:] of a [2, 3, V] buffer: with an odd V the view starts off a 16-byte
                # boundary and its rows do not flatten (one launch with a batch stride), the
                # specializations of the README's slices; in place, as the logits path runs it.
                logits = torch.randn(2, 3, vocab).to(dt)[:, 1:]
                labels = torch.tensor([1, vocab - 1, 0, 2])
                summary = backend.row_forward(logits, labels, inv_temperature=1.0, with_entropy=entropy)
                g = torch.ones(4, dtype=acc)
                backend.row_backward(logits, labels, summary, g, grad_entropy=g if entropy else None,
                                     inv_temperature=1.0, out=logits)

            if vocab % 2:
                out.append(Scenario(f"row fwd+bwd V={vocab} unaligned start", name, row_ops_unaligned))
                out.append(Scenario(f"row fwd+bwd V={vocab} unaligned start entropy", name,
                                    lambda b, f=row_ops_unaligned: f(b, entropy=True)))

            def candidates(backend, dt=dt, acc=acc, vocab=vocab):
                kept = KeptSets.from_candidates(torch.randint(0, vocab, (4, num_cand)))
                backend.kept_gather(torch.randn(4, vocab).to(dt), kept)
                backend.kept_scatter(torch.ones(4 * num_cand, dtype=acc), kept, out=torch.empty(4, vocab, dtype=dt))

            out.append(Scenario(f"candidate gather/scatter K={num_cand} V={vocab}", name, candidates))

        def linear(backend, dt=dt, acc=acc, bias=False):
            rows_w, states = 64, 24  # the weight's row count does not enter the specialization
            h = torch.randn(states, hidden).to(dt)
            w = torch.randn(rows_w, hidden).to(dt)
            b = torch.randn(rows_w).to(dt) if bias else None
            cand = torch.randint(0, rows_w, (states, num_cand))
            cand[:, : num_cand // 2] = 5  # one token's run longer than a weight-gradient segment
            kept = KeptSets.from_candidates(cand)
            backend.kept_linear_forward(h, w, kept, bias=b)
            backend.kept_linear_backward(torch.ones(states * num_cand, dtype=acc), h, w, kept, runs=pair_runs(cand),
                                         with_hidden=True, with_weight=True, with_bias=bias)

        out.append(Scenario(f"candidate linear K={num_cand} H={hidden}", name, linear))
        out.append(Scenario(f"candidate linear K={num_cand} H={hidden} bias", name, lambda b, f=linear: f(b, bias=True)))

    for name in [d for d in ("fp32", "fp64") if d in dtypes or (d == "fp32" and set(dtypes) & {"bf16", "fp16"})]:
        dt = torch_dtypes[name]

        def group(backend, dt=dt, anchor=True, with_old=False):
            groups, k, t = 16, 8, 128
            layout = build_layout(groups * k * t, "cpu", padded_shape=(groups * k, t), group_size=k)
            token_lp = -torch.rand(groups * k * t, dtype=dt)
            scores = torch.randn(groups * k, dtype=dt)
            old = torch.randn(groups * k, dtype=dt) if with_old else None
            backend.group_targets(token_lp, layout, scores, old_seq_logprobs=old, eta=1.0, anchor=anchor)

        out.append(Scenario("group op G=16 K=8 T=128 on-policy", name, group))
        out.append(Scenario("group op G=16 K=8 T=128 old log-probs", name, lambda b, f=group: f(b, with_old=True)))
        out.append(Scenario("group op G=16 K=8 T=128 no anchor", name, lambda b, f=group: f(b, anchor=False)))
    return out


class _CompileOnlyDriver:
    """Stands in for Triton's CUDA driver: names the target GPU; launches never reach it."""

    def __init__(self, arch: int):
        self.arch = arch

    def get_current_device(self):
        return self.arch  # one kernel cache per architecture

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, 32)


def _dtype_name(value) -> str:
    text = str(value)
    return {"fp32": "fp32", "float32": "fp32", "fp64": "fp64", "float64": "fp64", "bf16": "bf16", "bfloat16": "bf16",
            "fp16": "fp16", "float16": "fp16"}.get(text.replace("triton.language.", ""), text)


def _spec_text(src, options) -> str:
    """Constexprs (by parameter name), num_warps, and the integer arguments that are *not* known
    to be multiples of 16 (those decide vector widths); arguments the kernel declares
    ``do_not_specialize`` (a batch's rows per entry, a divisor only) are never specialized and do
    not count."""
    names = list(src.signature)
    params = getattr(getattr(src, "fn", None), "params", [])
    unspecialized = {p.name for p in params if getattr(p, "do_not_specialize", False)}
    parts = []
    for key, value in sorted(src.constants.items()):
        index = key[0] if isinstance(key, tuple) else key
        name = names[index] if isinstance(index, int) and index < len(names) else str(key)
        if name == "ACC":
            continue  # the dtype column says it
        if hasattr(value, "primitive_bitwidth") or "triton.language" in str(type(value)):
            value = _dtype_name(value)
        parts.append(f"{name}={int(value) if isinstance(value, bool) else value}")
    parts.append(f"warps={options.get('num_warps', '?')}")
    unaligned = []
    for index, (name, ty) in enumerate(src.signature.items()):
        if ty in ("i32", "i64", "u32", "u64") and name not in unspecialized:
            attrs = src.attrs.get((index,), [])
            if not any(a[0] == "tt.divisibility" and a[1] >= 16 for a in attrs):
                unaligned.append(name)
    if unaligned:
        parts.append("not%16:" + ",".join(unaligned))
    return " ".join(parts)


def collect_triton(arch: int, scenarios: Iterable[Scenario], cuobjdump: Optional[str] = None) -> List[KernelRow]:
    """Compile every kernel the scenarios launch, for ``sm_<arch>``, and inspect the cubins.

    Must run in a process whose Triton kernels were defined with ``TRITON_INTERPRET`` off; it
    replaces Triton's active driver and ``JITFunction.run`` for the rest of the process."""
    import warnings

    import triton
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from tpo_kernels.backends.triton import TritonBackend, row_kernels

    if not isinstance(row_kernels._row_forward_kernel, JITFunction):
        raise ReportError("the Triton kernels were defined under TRITON_INTERPRET=1; run the report in a fresh process "
                          "with it unset")
    cuobjdump = cuobjdump or triton_tool("cuobjdump") or find_cuobjdump(load_toolkit())
    driver.set_active(_CompileOnlyDriver(int(arch)))
    launches: List[Tuple[object, object, Scenario, dict]] = []
    current: List[Optional[Scenario]] = [None]
    original_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        launches.append((self, kernel, current[0], dict(kwargs)))
        return kernel

    JITFunction.run = compile_only
    backend = TritonBackend()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. Triton 3.9's note on TRITON_DEFAULT_FP_FUSION
            for scenario in scenarios:
                current[0] = scenario
                try:
                    scenario.call(backend)
                except Exception as exc:
                    raise ReportError(f"Triton sm_{arch}: {scenario.label} ({scenario.dtype}): {type(exc).__name__}: {exc}") from exc
    finally:
        JITFunction.run = original_run
    rows: "OrderedDict[str, KernelRow]" = OrderedDict()
    with tempfile.TemporaryDirectory(prefix="tpo-kernel-report-") as tmp:
        for fn, kernel, scenario, kwargs in launches:
            key = kernel.hash
            if key in rows:
                if scenario.label not in rows[key].used_by:
                    rows[key].used_by.append(scenario.label)
                continue
            path = os.path.join(tmp, f"{key}.cubin")
            with open(path, "wb") as f:
                f.write(kernel.asm["cubin"])
            usage, sass = inspect_binary(cuobjdump, path, default_arch=f"sm_{arch}")
            (tool_arch, symbol), res = next(iter(usage.items()))
            facts = sass.get((tool_arch, symbol)) or next(iter(sass.values()), {"loads": {}, "stores": {}, "local_insts": 0})
            options = {"num_warps": getattr(kernel.metadata, "num_warps", kwargs.get("num_warps"))}
            rows[key] = KernelRow(
                source="triton", kernel=fn.__name__, arch=f"sm_{arch}" if tool_arch == "?" else tool_arch,
                dtype=scenario.dtype, spec=_spec_text(kernel.src, options), regs=res["regs"], stack=res["stack"],
                local=res["local"], local_insts=facts["local_insts"], smem_static=res["shared"],
                smem_dynamic=int(getattr(kernel.metadata, "shared", 0) or 0), loads=facts["loads"],
                stores=facts["stores"], used_by=[scenario.label], symbol=symbol, pack_loops=facts.get("pack_loops", []),
            )
            rows[key].mark_known(triton.__version__)
    return list(rows.values())


def _triton_worker(args) -> int:
    """``--triton-worker ARCH``: the Triton part for one architecture, as JSON."""
    os.environ["TRITON_INTERPRET"] = "0"
    scenarios = [s for s in triton_scenarios(args.vocab, args.dtype, args.hidden) if s.op in args.ops]
    try:
        rows = collect_triton(int(args.triton_worker), scenarios)
    except ReportError as exc:
        print(f"kernel_report: {exc}", file=sys.stderr)
        return 2
    with open(args.json, "w") as f:
        json.dump([r.to_json() for r in rows], f)
    return 0


def run_triton_workers(archs: Sequence[str], args, progress: Optional[Callable[[str], None]] = None) -> List[KernelRow]:
    """One fresh process per architecture (Triton must not be in interpreter mode, and the
    stand-in driver is process-wide); they run side by side. ``progress`` hears what is running."""
    from ..experiment import child_env

    env = child_env(TRITON_INTERPRET="0")
    parent = os.path.dirname(package_dir())
    with tempfile.TemporaryDirectory(prefix="tpo-kernel-report-") as tmp:
        procs = []
        for arch in archs:
            out = os.path.join(tmp, f"triton-{arch}.json")
            cmd = [sys.executable, "-m", "bench.kernel_report", "--triton-worker", str(arch), "--json", out,
                   "--hidden", str(args.hidden), "--vocab", ",".join(map(str, args.vocab)), "--dtype", ",".join(args.dtype), "--ops", ",".join(args.ops)]
            procs.append((arch, out, subprocess.Popen(cmd, cwd=parent, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True)))
        rows: List[KernelRow] = []
        errors = []
        for done, (arch, out, proc) in enumerate(procs):
            if progress:
                progress(f"compiling for {', '.join('sm_' + a for a, _, _ in procs[done:])} "
                         f"({len(procs) - done} worker process(es) running)")
            log, _ = proc.communicate()
            if proc.returncode != 0 or not os.path.exists(out):
                errors.append(f"Triton sm_{arch} worker exited with {proc.returncode}:\n{log[-3000:]}")
                continue
            with open(out) as f:
                rows += [KernelRow.from_json(d) for d in json.load(f)]
        if errors:
            raise ReportError("\n".join(errors))
    return rows
