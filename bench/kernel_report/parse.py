"""What one kernel specialization uses, and the parsers of ptxas / cuobjdump output."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from collections import Counter, OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple


DEFAULT_ARCHS = ("80", "90")
DEFAULT_VOCABS = (32000, 50257, 151936)
DEFAULT_DTYPES = ("fp32", "bf16", "fp16", "fp64")
FAIL_DTYPES = ("fp32", "bf16", "fp16")  # a spill in one of these fails the report

# Local memory that one Triton release's code generation gives a kernel whose source compiles
# without any under the Triton CI tests with (3.9): recorded here as measured, it is reported as
# known under that release only, and only up to the bytes and LDL/STL instructions recorded; any
# other local memory, and any under another release, fails as before. Triton 3.6 (the GPU
# machine's, bench/gpu_machine_versions.txt): its PTX of these kernels has no .local; ptxas
# makes the frame from it, and ptxas 12.8, 12.9 and 13.0 agree (issue 23).
# (Triton major.minor, kernel, arch, dtype, specialization) -> (local bytes, LDL/STL instructions)
KNOWN_TRITON_LOCAL_MEMORY = {
    ("3.6", "_candidate_dot_kernel", "sm_90", "fp16", "HAS_BIAS=0 BLOCK_K=8 BLOCK_H=512 warps=8 not%16:num_cand"): (8, 2),
    ("3.6", "_group_targets_kernel", "sm_90", "fp32", "HAS_OLD=1 ANCHOR=1 BLOCK_K=8 BLOCK_T=128 warps=4"): (8, 2),
}


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
    known: str = ""  # "Triton 3.6": local memory recorded in KNOWN_TRITON_LOCAL_MEMORY for that release

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
        """A spill in a kernel whose dtype is not fp64 (an unknown dtype fails too), unless it is
        the local memory recorded for the Triton release that compiled it."""
        return self.spilled and self.dtype != "fp64" and not self.known

    def mark_known(self, triton_version: str) -> None:
        """Set ``known`` when this Triton row's local memory is within what
        KNOWN_TRITON_LOCAL_MEMORY records for ``triton_version`` (e.g. "3.6.0")."""
        release = ".".join(triton_version.split(".")[:2])
        recorded = KNOWN_TRITON_LOCAL_MEMORY.get((release, self.kernel, self.arch, self.dtype, self.spec))
        within = recorded is not None and self.spill_bytes <= recorded[0] and self.local_insts <= recorded[1]
        self.known = f"Triton {release}" if self.source == "triton" and self.spilled and within else ""

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
