"""Kernel report: registers, spills, shared memory and global load widths of every Triton and CUDA
kernel of tpo_kernels, compiled for sm_80 and sm_90 on a machine without a GPU.

    python -m tpo_kernels.bench.kernel_report                 # sm_80 and sm_90, the table, exit status
    python -m tpo_kernels.bench.kernel_report --arch 90 --json report.json
    python -m tpo_kernels.bench.kernel_report --triton-only   # or --cuda-only

**Triton.** Each operation of the Triton backend is called through the backend interface
(``TritonBackend().row_forward(...)`` and so on) on small CPU tensors of representative shapes:
2 rows of each vocabulary in ``--vocab`` (default 32000, 50257, 151936: block sizes and warp counts
as at training shapes, and a vocabulary that is not a multiple of 16), K=8 candidates, H=4096,
16 groups of 8 sequences of 128 tokens, in every dtype the launcher takes. A stand-in Triton
driver names the target GPU and turns each launch into a compile only
(``JITFunction.run(..., warmup=True)``), so every kernel is built exactly as its launcher
specializes it: constexprs, block sizes, ``num_warps``, argument dtypes, and which pointers and
integers are divisible by 16. Nothing runs. One process per architecture, with
``TRITON_INTERPRET`` off.

**CUDA.** The kernels of ``csrc/cuda``: read from the built extension ``tpo_kernels/_C_cuda*.so``
when it carries code for every requested architecture, else compiled from ``csrc/cuda/*.cu`` with
nvcc and the flags setup.py uses, one architecture at a time with ``-Xptxas -v`` (which gives the
exact spill bytes). nvcc, the toolkit and cuobjdump come from ``csrc/cuda_toolkit.py``; cuobjdump
may be the copy the Triton wheel bundles. A missing cuobjdump is an error, never a skip.

**Columns.** ``regs``: registers per thread. ``spill``: bytes of register spill stores (ptxas,
when the kernel was compiled here) or else the local-memory frame (cuobjdump's STACK + LOCAL),
then the number of local-memory instructions (LDL/STL) in the SASS; any local memory counts as a
spill. ``smem``: static shared bytes in the cubin (sm_90 cubins include the 1 KiB the driver
reserves per block) + dynamic bytes the launch requests (Triton). ``loads``: the global loads in
the SASS by width in bits (``128x2`` = two 128-bit LDG instructions; LDG.E.128 is a 16-byte vector
load), then the stores. ``launched for``: the calls that produced this specialization.

Exit status: 0 when no fp32, bf16 or fp16 kernel spills (fp64 kernels are reported, not
failed); 1 when one does; 2 when the report could not be made (a missing tool, a compile error).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, OrderedDict
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

DEFAULT_ARCHS = ("80", "90")
DEFAULT_VOCABS = (32000, 50257, 151936)
DEFAULT_DTYPES = ("fp32", "bf16", "fp16", "fp64")
FAIL_DTYPES = ("fp32", "bf16", "fp16")  # a spill in one of these fails the report


class ReportError(RuntimeError):
    """The report could not be made (exit status 2)."""


# --------------------------------------------------------------------------- one kernel


@dataclasses.dataclass
class KernelRow:
    source: str  # "triton" | "cuda"
    kernel: str  # short name (Triton function, or CUDA template name with its arguments)
    arch: str  # as the tools name it: sm_80, sm_90, sm_90a
    dtype: str  # fp32 | bf16 | fp16 | fp64 | "?"
    spec: str  # the specialization: constexprs and num_warps, or template arguments
    regs: int
    stack: int = 0  # cuobjdump STACK (bytes per thread)
    local: int = 0  # cuobjdump LOCAL (bytes per thread)
    spill_stores: Optional[int] = None  # ptxas -v, when compiled here
    spill_loads: Optional[int] = None
    local_insts: int = 0  # LDL/STL instructions in the SASS
    smem_static: int = 0
    smem_dynamic: int = 0
    loads: Dict[int, int] = dataclasses.field(default_factory=dict)  # LDG width in bits -> count
    stores: Dict[int, int] = dataclasses.field(default_factory=dict)  # STG width in bits -> count
    used_by: List[str] = dataclasses.field(default_factory=list)
    symbol: str = ""  # the (mangled) symbol in the binary

    @property
    def spill_bytes(self) -> int:
        if self.spill_stores is not None:
            return int(self.spill_stores) + int(self.spill_loads or 0)
        return int(self.stack) + int(self.local)

    @property
    def spilled(self) -> bool:
        return self.spill_bytes > 0 or self.local_insts > 0

    @property
    def fails(self) -> bool:
        """A spill in a kernel whose dtype is not fp64 (an unknown dtype fails too)."""
        return self.spilled and self.dtype != "fp64"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["loads"] = {str(k): v for k, v in self.loads.items()}
        d["stores"] = {str(k): v for k, v in self.stores.items()}
        d.update(spill_bytes=self.spill_bytes, spilled=self.spilled, fails=self.fails)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "KernelRow":
        fields = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in fields}
        d["loads"] = {int(k): v for k, v in d.get("loads", {}).items()}
        d["stores"] = {int(k): v for k, v in d.get("stores", {}).items()}
        return cls(**d)


# --------------------------------------------------------------------------- tool output parsers

_ARCH_LINE = re.compile(r"^\s*(?:arch = |code for )(sm_\d+[a-z]?)\s*$")


def parse_resource_usage(text: str, default_arch: str = "?") -> Dict[Tuple[str, str], dict]:
    """``cuobjdump --dump-resource-usage`` output -> ``{(arch, symbol): {regs, stack, shared,
    local}}``. An object or library holds one ELF per architecture, each headed by
    ``arch = sm_NN``; a lone cubin has no header (its arch is ``default_arch``)."""
    out: Dict[Tuple[str, str], dict] = {}
    arch, name = default_arch, None
    for line in text.splitlines():
        m = _ARCH_LINE.match(line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"^\s*Function (\S+?):\s*$", line)
        if m:
            name = m.group(1)
            continue
        if name is not None and "REG:" in line:
            fields = dict(re.findall(r"(\w+):(\d+)", line))
            out[(arch, name)] = {
                "regs": int(fields.get("REG", 0)),
                "stack": int(fields.get("STACK", 0)),
                "shared": int(fields.get("SHARED", 0)),
                "local": int(fields.get("LOCAL", 0)),
            }
            name = None
    return out


_SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s*([^;]*);")  # "/*0f30*/  @P0 LDG.E.128 R4, desc[UR4][R2.64] ;"
_MEM_OP = re.compile(r"\b(LDG|STG|LDL|STL)((?:\.[A-Z0-9_]+)*)")
_WIDTHS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128, "256": 256}


def _width(modifiers: str) -> int:
    for part in modifiers.split("."):
        if part in _WIDTHS:
            return _WIDTHS[part]
    return 32


def parse_sass(text: str, default_arch: str = "?") -> Dict[Tuple[str, str], dict]:
    """``cuobjdump -sass`` output -> ``{(arch, symbol): {loads, stores, local_insts}}`` with
    ``loads``/``stores`` = {width in bits: number of LDG/STG instructions}."""
    out: Dict[Tuple[str, str], dict] = {}
    arch, current = default_arch, None
    for line in text.splitlines():
        m = _ARCH_LINE.match(line)
        if m:
            arch, current = m.group(1), None
            continue
        m = re.match(r"^\s*Function : (\S+)\s*$", line)
        if m:
            current = out.setdefault((arch, m.group(1)), {"loads": Counter(), "stores": Counter(), "local_insts": 0})
            continue
        m = _SASS_INSTRUCTION.match(line) if current is not None else None
        if m is None:
            continue
        for op, modifiers in _MEM_OP.findall(m.group(1)):
            if op == "LDG":
                current["loads"][_width(modifiers)] += 1
            elif op == "STG":
                current["stores"][_width(modifiers)] += 1
            else:
                current["local_insts"] += 1
    return {k: {"loads": dict(v["loads"]), "stores": dict(v["stores"]), "local_insts": v["local_insts"]} for k, v in out.items()}


def parse_ptxas_log(text: str) -> Dict[Tuple[str, str], dict]:
    """``ptxas -v`` (``nvcc -Xptxas -v``) output -> ``{(arch, symbol): {regs, stack, spill_stores,
    spill_loads, smem}}``."""
    out: Dict[Tuple[str, str], dict] = {}
    current = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\d+[a-z]?)'", line)
        if m:
            current = out.setdefault((m.group(2), m.group(1)), {"regs": 0, "stack": 0, "spill_stores": 0, "spill_loads": 0, "smem": 0})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current["stack"], current["spill_stores"], current["spill_loads"] = (int(g) for g in m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["regs"] = int(m.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(smem.group(1)) if smem else 0
    return out


# --------------------------------------------------------------------------- CUDA symbol names

_CXX_TYPES = OrderedDict([("tpo::bf16_t", "bf16"), ("tpo::half_t", "fp16"), ("__nv_bfloat16", "bf16"), ("__half", "fp16"),
                          ("double", "fp64"), ("float", "fp32")])


def demangle(symbols: Sequence[str]) -> Dict[str, str]:
    """Demangled names by c++filt (binutils) or cu++filt (CUDA toolkit); symbols stay as they are
    when neither is installed."""
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if not tool or not symbols:
        return {s: s for s in symbols}
    proc = subprocess.run([tool], input="\n".join(symbols) + "\n", capture_output=True, text=True, timeout=60)
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or len(lines) != len(symbols):
        return {s: s for s in symbols}
    return dict(zip(symbols, lines))


def cuda_label(demangled: str, symbol: str) -> Tuple[str, str, str]:
    """``(kernel, dtype, spec)`` of a CUDA kernel, e.g. ``void tpo::cuda::(anonymous
    namespace)::row_forward_kernel<tpo::bf16_t, 512, true>(...)`` ->
    ``("row_forward_kernel", "bf16", "<512, true>")``."""
    m = re.search(r"(\w+)<(.*?)>\(", demangled)
    if m:
        name, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        dtype = _CXX_TYPES.get(args[0], "?")
        rest = args[1:] if dtype != "?" else args
        return name, dtype, ("<" + ", ".join(rest) + ">") if rest else ""
    m = re.search(r"(\w+)\(", demangled)
    if m:  # not a template
        return m.group(1), "?", ""
    # still mangled (no demangler): the length-prefixed name followed by template arguments ("I"),
    # and the first argument's type code
    for m in re.finditer(r"(\d+)(?=[A-Za-z_])", symbol):
        start, length = m.end(), int(m.group(1))
        name, rest = symbol[start:start + length], symbol[start + length:]
        if len(name) == length and rest.startswith("I"):
            rest = rest[1:]
            dtype = "bf16" if "bf16_t" in rest[:16] else "fp16" if "half_t" in rest[:16] else \
                {"d": "fp64", "f": "fp32"}.get(rest[:1], "?")
            return name, dtype, "(mangled)"
    return symbol, "?", ""


# --------------------------------------------------------------------------- tools


def package_dir() -> str:
    import tpo_kernels

    return os.path.dirname(os.path.abspath(tpo_kernels.__file__))


def load_toolkit():
    """``csrc/cuda_toolkit.py`` of the source checkout next to the imported package (None when
    the package is installed without its sources)."""
    path = os.path.join(os.path.dirname(package_dir()), "csrc", "cuda_toolkit.py")
    if not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("_tpo_cuda_toolkit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def triton_tool(name: str) -> Optional[str]:
    """A tool the Triton wheel bundles for its own use (``triton/backends/nvidia/bin``)."""
    spec = importlib.util.find_spec("triton")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "backends", "nvidia", "bin", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def find_cuobjdump(toolkit=None) -> str:
    """cuobjdump as csrc/cuda_toolkit.py finds it (``CUOBJDUMP``, the toolkit, PATH, the CUDA tool
    wheels, Triton's copy); without the sources: ``CUOBJDUMP``, PATH, Triton's copy. Raises
    :class:`ReportError` when there is none."""
    if os.environ.get("CUOBJDUMP"):
        chosen = os.environ["CUOBJDUMP"]
        if os.path.isfile(chosen) and os.access(chosen, os.X_OK):
            return chosen
        raise ReportError(f"CUOBJDUMP={chosen} is not an executable file")
    found = None
    if toolkit is not None:
        nvcc = toolkit.find_nvcc()
        if nvcc:
            found = toolkit.find_tool("cuobjdump", nvcc, toolkit.cuda_root(nvcc))
    found = found or shutil.which("cuobjdump") or triton_tool("cuobjdump")
    if not found:
        raise ReportError("cuobjdump not found (looked at CUOBJDUMP, the CUDA toolkit, PATH and Triton's bundled "
                          "tools); install it (e.g. pip install nvidia-cuda-cuobjdump) or point CUOBJDUMP at it")
    return found


def _run(cmd: List[str], what: str, timeout: float = 600) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ReportError(f"{what}: {exc}") from exc
    if proc.returncode != 0:
        raise ReportError(f"{what} failed ({proc.returncode}): {' '.join(cmd)}\n{(proc.stderr or proc.stdout)[-3000:]}")
    return proc.stdout + proc.stderr


def inspect_binary(cuobjdump: str, path: str, default_arch: str = "?"):
    """(resource usage, SASS facts) of every function in a cubin, object or shared library."""
    usage = parse_resource_usage(_run([cuobjdump, "--dump-resource-usage", path], "cuobjdump --dump-resource-usage"),
                                 default_arch)
    sass = parse_sass(_run([cuobjdump, "-sass", path], "cuobjdump -sass"), default_arch)
    if not usage:
        raise ReportError(f"cuobjdump found no functions in {path}")
    return usage, sass


# --------------------------------------------------------------------------- Triton


@dataclasses.dataclass
class Scenario:
    """One call of a backend operation; every kernel it launches is attributed to ``label``."""

    label: str
    dtype: str
    call: Callable[[object], None]  # receives the TritonBackend


def triton_scenarios(vocabs: Sequence[int] = DEFAULT_VOCABS, dtypes: Sequence[str] = DEFAULT_DTYPES,
                     hidden: int = 4096, num_cand: int = 8) -> List[Scenario]:
    """The calls whose launches are compiled: every operation of the Triton backend, in every dtype
    its launcher takes, at representative shapes (see the module docstring)."""
    import torch

    from tpo_kernels.layout import build_layout, pair_runs

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
                lse, _, ent = backend.row_forward(logits, labels, inv_temperature=1.0, with_entropy=entropy)
                g = torch.ones(2, dtype=acc)
                backend.row_backward(logits, labels, lse, g, grad_entropy=g if entropy else None, entropy=ent,
                                     inv_temperature=1.0, out=logits)

            out.append(Scenario(f"row fwd+bwd V={vocab}", name, row_ops))
            out.append(Scenario(f"row fwd+bwd V={vocab} entropy", name,
                                lambda b, f=row_ops: f(b, entropy=True)))

            def candidates(backend, dt=dt, acc=acc, vocab=vocab):
                cand = torch.randint(0, vocab, (4, num_cand))
                backend.candidate_forward(torch.randn(4, vocab).to(dt), cand, inv_temperature=1.0)
                backend.candidate_backward(torch.ones(4, num_cand, dtype=acc), cand, inv_temperature=1.0,
                                           out=torch.empty(4, vocab, dtype=dt))

            out.append(Scenario(f"candidate gather/scatter K={num_cand} V={vocab}", name, candidates))

        def linear(backend, dt=dt, acc=acc, bias=False):
            rows_w = 64  # the weight's row count does not enter the specialization
            h = torch.randn(4, hidden).to(dt)
            w = torch.randn(rows_w, hidden).to(dt)
            b = torch.randn(rows_w).to(dt) if bias else None
            cand = torch.randint(0, rows_w, (4, num_cand))
            backend.candidate_linear_forward(h, w, cand, bias=b, inv_temperature=1.0)
            backend.candidate_linear_backward(torch.ones(4, num_cand, dtype=acc), h, w, cand, runs=pair_runs(cand),
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
    to be multiples of 16 (those decide vector widths)."""
    names = list(src.signature)
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
        if ty in ("i32", "i64", "u32", "u64"):
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
                stores=facts["stores"], used_by=[scenario.label], symbol=symbol,
            )
    return list(rows.values())


def _triton_worker(args) -> int:
    """``--triton-worker ARCH``: the Triton part for one architecture, as JSON."""
    os.environ["TRITON_INTERPRET"] = "0"
    scenarios = triton_scenarios(args.vocab, args.dtype, args.hidden)
    try:
        rows = collect_triton(int(args.triton_worker), scenarios)
    except ReportError as exc:
        print(f"kernel_report: {exc}", file=sys.stderr)
        return 2
    with open(args.json, "w") as f:
        json.dump([r.to_json() for r in rows], f)
    return 0


def run_triton_workers(archs: Sequence[str], args) -> List[KernelRow]:
    """One fresh process per architecture (Triton must not be in interpreter mode, and the
    stand-in driver is process-wide); they run side by side."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    parent = os.path.dirname(package_dir())
    env["PYTHONPATH"] = parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory(prefix="tpo-kernel-report-") as tmp:
        procs = []
        for arch in archs:
            out = os.path.join(tmp, f"triton-{arch}.json")
            cmd = [sys.executable, "-m", "tpo_kernels.bench.kernel_report", "--triton-worker", str(arch), "--json", out,
                   "--hidden", str(args.hidden), "--vocab", ",".join(map(str, args.vocab)), "--dtype", ",".join(args.dtype)]
            procs.append((arch, out, subprocess.Popen(cmd, cwd=parent, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True)))
        rows: List[KernelRow] = []
        errors = []
        for arch, out, proc in procs:
            log, _ = proc.communicate()
            if proc.returncode != 0 or not os.path.exists(out):
                errors.append(f"Triton sm_{arch} worker exited with {proc.returncode}:\n{log[-3000:]}")
                continue
            with open(out) as f:
                rows += [KernelRow.from_json(d) for d in json.load(f)]
        if errors:
            raise ReportError("\n".join(errors))
    return rows


# --------------------------------------------------------------------------- CUDA


def built_cuda_extensions() -> List[str]:
    return sorted(os.path.join(package_dir(), n) for n in os.listdir(package_dir())
                  if n.startswith("_C_cuda") and n.endswith((".so", ".pyd")))


def elf_archs(cuobjdump: str, path: str) -> List[str]:
    listing = _run([cuobjdump, "--list-elf", path], "cuobjdump --list-elf")
    return sorted(set(re.findall(r"sm_(\d+[a-z]?)\.cubin", listing)))


def _cuda_rows(usage, sass, ptxas, archs: Sequence[str], origin: str) -> List[KernelRow]:
    wanted = {f"sm_{a}" for a in archs}
    names = demangle(sorted({symbol for _, symbol in usage}))
    rows = []
    for (arch, symbol), res in usage.items():
        if arch not in wanted:
            continue
        kernel, dtype, spec = cuda_label(names.get(symbol, symbol), symbol)
        facts = sass.get((arch, symbol), {"loads": {}, "stores": {}, "local_insts": 0})
        log = ptxas.get((arch, symbol))
        rows.append(KernelRow(
            source="cuda", kernel=kernel, arch=arch, dtype=dtype, spec=spec, regs=res["regs"], stack=res["stack"],
            local=res["local"], spill_stores=log["spill_stores"] if log else None,
            spill_loads=log["spill_loads"] if log else None, local_insts=facts["local_insts"],
            smem_static=res["shared"], loads=facts["loads"], stores=facts["stores"], used_by=[origin], symbol=symbol,
        ))
    rows.sort(key=lambda r: (r.arch, r.kernel, DEFAULT_DTYPES.index(r.dtype) if r.dtype in DEFAULT_DTYPES else 9, r.spec))
    return rows


def collect_cuda(archs: Sequence[str], *, from_source: bool = False, jobs: int = 4) -> Tuple[List[KernelRow], List[str]]:
    """``(rows, notes)`` for the CUDA kernels: from the built extension when it has every arch
    (unless ``from_source``), else compiled from csrc/cuda with nvcc. Raises ReportError when
    neither is possible or a tool is missing."""
    toolkit = load_toolkit()
    cuobjdump = find_cuobjdump(toolkit)
    notes = [f"cuobjdump: {cuobjdump}"]
    rows: List[KernelRow] = []
    missing = list(archs)
    if not from_source:
        for so in built_cuda_extensions():
            have = elf_archs(cuobjdump, so)
            use = [a for a in missing if a in have]
            if not use:
                continue
            usage, sass = inspect_binary(cuobjdump, so)
            rows += _cuda_rows(usage, sass, {}, use, os.path.basename(so))
            notes.append(f"CUDA kernels for {', '.join('sm_' + a for a in use)}: read from the built extension {so}")
            missing = [a for a in missing if a not in use]
    if not missing:
        return rows, notes
    if toolkit is None:
        raise ReportError(f"no built CUDA extension with code for {', '.join('sm_' + a for a in missing)} and no csrc/ "
                          "next to the package to compile")
    nvcc = toolkit.find_nvcc()
    if not nvcc:
        raise ReportError(f"nvcc not found, and no built CUDA extension with code for {', '.join('sm_' + a for a in missing)}")
    csrc = os.path.join(os.path.dirname(package_dir()), "csrc")
    sources = sorted(os.path.join(csrc, "cuda", n) for n in os.listdir(os.path.join(csrc, "cuda")) if n.endswith(".cu"))
    if not sources:
        raise ReportError(f"no .cu files under {csrc}/cuda")
    notes.append(f"CUDA kernels for {', '.join('sm_' + a for a in missing)}: compiled here from csrc/cuda/*.cu with {nvcc} "
                 "(setup.py's flags, -Xptxas -v)")
    with tempfile.TemporaryDirectory(prefix="tpo-kernel-report-") as tmp:
        pending = []
        for arch in missing:
            for src in sources:
                obj = os.path.join(tmp, f"{os.path.basename(src)}.sm_{arch}.o")
                cmd = [nvcc, "-c", src, "-o", obj] + toolkit.nvcc_flags(csrc, [arch]) + ["-Xptxas", "-v"]
                pending.append((arch, src, obj, cmd))
        done = []
        running: List[tuple] = []
        while pending or running:
            while pending and len(running) < max(1, jobs):
                arch, src, obj, cmd = pending.pop(0)
                running.append((arch, src, obj, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                                      text=True, cwd=os.path.dirname(csrc))))
            arch, src, obj, cmd, proc = running.pop(0)
            log, _ = proc.communicate()
            if proc.returncode != 0:
                for *_, other in running:
                    other.kill()
                raise ReportError(f"nvcc failed ({proc.returncode}) on {src} for sm_{arch}:\n{log[-3000:]}")
            done.append((arch, src, obj, log))
        for arch, src, obj, log in sorted(done):
            usage, sass = inspect_binary(cuobjdump, obj)
            rows += _cuda_rows(usage, sass, parse_ptxas_log(log), [arch], f"{os.path.basename(src)} (nvcc here)")
    return rows, notes


# --------------------------------------------------------------------------- the table


def _widths(counts: Dict[int, int]) -> str:
    return " ".join(f"{w}x{n}" for w, n in sorted(counts.items(), key=lambda kv: -kv[0])) or "-"


def _spill_text(row: KernelRow) -> str:
    if not row.spilled:
        return "0"
    if row.spill_stores is not None:  # ptxas -v: exact spill traffic
        text = f"st {row.spill_stores}B ld {row.spill_loads}B"
    else:  # cuobjdump: the local-memory frame
        text = f"{row.spill_bytes}B local"
    text += f" {row.local_insts} LDL/STL" if row.local_insts else ""
    return text + ("" if row.fails else " (fp64)")


def format_table(rows: Sequence[KernelRow]) -> str:
    header = ("kernel", "arch", "dtype", "specialization", "regs", "spill", "smem", "loads (bits x LDG)", "stores (STG)",
              "launched for")
    lines = []
    for r in rows:
        smem = f"{r.smem_static}+{r.smem_dynamic}" if r.smem_dynamic else str(r.smem_static)
        lines.append((r.kernel, r.arch, r.dtype, r.spec, str(r.regs), _spill_text(r), smem, _widths(r.loads),
                      _widths(r.stores), "; ".join(r.used_by)))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    widths[-1] = 0  # the last column is not padded
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    out = [fmt.format(*header).rstrip(), fmt.format(*("-" * max(w, 3) for w in widths)).rstrip()]
    out += [fmt.format(*line).rstrip() for line in lines]
    return "\n".join(out)


def verdict(rows: Sequence[KernelRow]) -> Tuple[int, str]:
    """``(exit status, text)``: 1 when a fp32/bf16/fp16 (or unknown-dtype) kernel spills."""
    failing = [r for r in rows if r.fails]
    fp64 = [r for r in rows if r.spilled and not r.fails]
    text = [f"{len(rows)} kernel specializations checked ({sum(r.source == 'triton' for r in rows)} Triton, "
            f"{sum(r.source == 'cuda' for r in rows)} CUDA)."]
    if fp64:
        text.append("fp64 kernels with local memory (reported, allowed): "
                    + ", ".join(sorted({f'{r.kernel} {r.spec} {r.arch}'.replace('  ', ' ') for r in fp64})))
    if failing:
        text.append("SPILLS in fp32/bf16/fp16 kernels (fails):")
        text += [f"  {r.source} {r.kernel} {r.arch} {r.dtype} {r.spec}: {_spill_text(r)}" for r in failing]
        return 1, "\n".join(text)
    text.append("No spills in fp32, bf16 or fp16 kernels.")
    return 0, "\n".join(text)


# --------------------------------------------------------------------------- command line


def _csv(text: str) -> List[str]:
    return [p.strip() for p in str(text).replace(";", ",").split(",") if p.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tpo_kernels.bench.kernel_report", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default=",".join(DEFAULT_ARCHS), help="compute capabilities, e.g. 80,90 (default)")
    p.add_argument("--vocab", default=",".join(map(str, DEFAULT_VOCABS)), help="vocabularies of the Triton calls")
    p.add_argument("--dtype", default=",".join(DEFAULT_DTYPES), help="dtypes of the Triton calls")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size of the candidate-linear calls")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--triton-only", action="store_true")
    which.add_argument("--cuda-only", action="store_true")
    p.add_argument("--cuda-from-source", action="store_true", help="compile csrc/cuda even when a built extension exists")
    p.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)), help="parallel nvcc runs")
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--triton-worker", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.vocab = [int(v) for v in _csv(args.vocab)]
    args.dtype = _csv(args.dtype)
    unknown = [d for d in args.dtype if d not in DEFAULT_DTYPES]
    if unknown:
        print(f"kernel_report: unknown dtype(s) {unknown}; use {','.join(DEFAULT_DTYPES)}", file=sys.stderr)
        return 2
    if args.triton_worker:
        return _triton_worker(args)
    archs = [a.replace("sm_", "").replace(".", "") for a in _csv(args.arch)]
    t0 = time.perf_counter()
    rows: List[KernelRow] = []
    notes: List[str] = []
    try:
        import concurrent.futures

        cuda_rows: List[KernelRow] = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            triton_future = None
            if not args.cuda_only:  # Triton workers (one process per arch) run beside the CUDA part
                import triton

                notes.append(f"Triton {triton.__version__}: kernels compiled as the launchers specialize them "
                             f"(V in {args.vocab}, dtypes {','.join(args.dtype)}, H={args.hidden}); ptxas "
                             f"{triton_tool('ptxas') or '(Triton default)'}")
                triton_future = pool.submit(run_triton_workers, archs, args)
            if not args.triton_only:
                cuda_rows, cuda_notes = collect_cuda(archs, from_source=args.cuda_from_source, jobs=args.jobs)
                notes += cuda_notes
            if triton_future is not None:
                rows += triton_future.result()
        rows += cuda_rows
    except ReportError as exc:
        print(f"kernel_report: {exc}", file=sys.stderr)
        return 2
    print(f"tpo_kernels kernel report: {', '.join('sm_' + a for a in archs)}, no GPU needed ({time.perf_counter() - t0:.0f} s)")
    for note in notes:
        print(f"  {note}")
    for source in ("triton", "cuda"):
        part = [r for r in rows if r.source == source]
        if part:
            print(f"\n{'Triton' if source == 'triton' else 'CUDA'} kernels\n")
            print(format_table(part))
    status, text = verdict(rows)
    print("\n" + text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"archs": archs, "notes": notes, "status": status, "rows": [r.to_json() for r in rows]}, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
