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
OPS = ("row", "candidate", "group")  # the kernels' families, by the op they serve (--ops)


def op_of_kernel(kernel: str) -> str:
    """The op a kernel serves, from its name: ``row_forward_kernel`` and Triton's
    ``_row_forward_kernel`` -> row; the candidate ops' weight-gradient passes -> candidate."""
    name = kernel.lstrip("_")
    return next((op for op in OPS if name.startswith(op)), "candidate")

# Local memory that one Triton release's code generation gives a kernel whose source compiles
# without any under the Triton CI tests with (3.9): recorded here as measured, it is reported as
# known under that release only, and only up to the bytes and LDL/STL instructions recorded; any
# other local memory, and any under another release, fails as before. Triton 3.6 (the GPU
# machine's, bench/gpu_machine_versions.txt): its PTX of these kernels has no .local; ptxas
# makes the frame from it, and ptxas 12.8, 12.9 and 13.0 agree.
# (Triton major.minor, kernel, arch, dtype, specialization) -> (local bytes, LDL/STL instructions)
KNOWN_TRITON_LOCAL_MEMORY = {
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
    pack_loops: List[dict] = dataclasses.field(default_factory=list)  # the SASS loops holding 128-bit loads

    @property
    def loop_insts_per_element(self) -> List[float]:
        """A row kernel's SASS instructions per element in its main loop (:func:`main_loops`), on
        the loop's common path; one value per main loop (the CUDA backward has two: without and
        with the entropy term). Empty for other kernels and for a dtype of unknown width."""
        per_pack = ELEMENTS_PER_PACK.get(self.dtype)
        if self.kernel.strip("_") not in ROW_KERNELS or not per_pack:
            return []
        return [(loop["insts"] - sum(loop["skipped"])) / (loop["packs"] * per_pack) for loop in main_loops(self.pack_loops)]

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


# --------------------------------------------------------------------------- loops in SASS
# A row kernel is bound by memory or by instruction issue depending on the instructions its main
# loop issues per element; they are counted from the SASS, without a GPU (loops.py has the
# per-pack view of the CUDA row kernels).

ROW_KERNELS = ("row_forward_kernel", "row_backward_kernel")  # CUDA names; Triton's start with "_"
ELEMENTS_PER_PACK = {"fp32": 4, "bf16": 8, "fp16": 8, "fp64": 2}  # per 16-byte (128-bit) load
_MAX = re.compile(r"^(@!?P\w+\s+)?(FMNMX|DSETP\.MAX)")
_BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")


def loop_bodies(insts: Sequence[Tuple[int, str]]) -> List[List[Tuple[int, str]]]:
    """Bodies (head to backward branch) of the loops of one function's ``(address, instruction)``
    list that hold 128-bit global loads."""
    index = {a: i for i, (a, _) in enumerate(insts)}
    bodies = []
    for i, (addr, text) in enumerate(insts):
        m = _BRANCH.match(text)
        if m and int(m.group(2), 16) <= addr and int(m.group(2), 16) in index:
            body = list(insts[index[int(m.group(2), 16)]:i + 1])
            if any("LDG.E.128" in t for _, t in body):
                bodies.append(body)
    return bodies


def skipped_regions(body: Sequence[Tuple[int, str]]) -> List[int]:
    """Sizes of the regions forward conditional branches inside the loop jump over (nested
    regions counted once, in the outermost): in the row kernels they guard rare events only (a
    group raising the running max, fp64's exp2 special cases), so the rest is the common path."""
    sizes, end = [], -1
    for addr, text in body:
        m = _BRANCH.match(text)
        if not (m and m.group(1)) or addr < end:
            continue
        target = int(m.group(2), 16)
        if addr < target <= body[-1][0]:
            sizes.append(sum(1 for a, _ in body if addr < a < target))
            end = target
    return sizes


def pack_loop_facts(insts: Sequence[Tuple[int, str]]) -> List[dict]:
    """``{insts, packs, skipped, has_max}`` of every loop holding 128-bit loads: its instructions,
    its 128-bit loads (packs), the sizes of its branch-skipped regions, and whether it takes a max
    (FMNMX, fp64's DSETP.MAX: the forward's running max, the backward's floor of log2 p, which
    only the entropy term has)."""
    return [dict(insts=len(body), packs=sum("LDG.E.128" in t for _, t in body), skipped=skipped_regions(body),
                 has_max=any(_MAX.match(t) for _, t in body)) for body in loop_bodies(insts)]


def main_loops(loops: Sequence[dict]) -> List[dict]:
    """A kernel's main loops: of the loops without a max, then of those with one, the one with the
    most 128-bit loads (the unrolled one), fewest instructions first. A Triton kernel, and the CUDA
    forward, has one; the CUDA backward one per variant (without, with the entropy term)."""
    groups = [[l for l in loops if not l["has_max"]], [l for l in loops if l["has_max"]]]
    return [min(group, key=lambda l: (-l["packs"], l["insts"])) for group in groups if group]


_SASS_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s*([^;]*);")  # "/*0f30*/  @P0 LDG.E.128 R4, desc[UR4][R2.64] ;"
_MEM_OP = re.compile(r"\b(LDG|STG|LDL|STL)((?:\.[A-Z0-9_]+)*)")
_WIDTHS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128, "256": 256}


def _width(modifiers: str) -> int:
    for part in modifiers.split("."):
        if part in _WIDTHS:
            return _WIDTHS[part]
    return 32


def parse_sass(text: str, default_arch: str = "?") -> Dict[Tuple[str, str], dict]:
    """``cuobjdump -sass`` output -> ``{(arch, symbol): {loads, stores, local_insts, pack_loops}}``
    with ``loads``/``stores`` = {width in bits: number of LDG/STG instructions} and ``pack_loops``
    the loops holding 128-bit loads (:func:`pack_loop_facts`)."""
    out: Dict[Tuple[str, str], dict] = {}
    listings: Dict[Tuple[str, str], List[Tuple[int, str]]] = {}
    arch, current = default_arch, None
    for line in text.splitlines():
        m = _ARCH_LINE.match(line)
        if m:
            arch, current = m.group(1), None
            continue
        m = re.match(r"^\s*Function : (\S+)\s*$", line)
        if m:
            current = out.setdefault((arch, m.group(1)), {"loads": Counter(), "stores": Counter(), "local_insts": 0})
            listing = listings.setdefault((arch, m.group(1)), [])
            continue
        m = _SASS_INSTRUCTION.match(line) if current is not None else None
        if m is None:
            continue
        listing.append((int(m.group(1), 16), m.group(2).strip()))
        for op, modifiers in _MEM_OP.findall(m.group(2)):
            if op == "LDG":
                current["loads"][_width(modifiers)] += 1
            elif op == "STG":
                current["stores"][_width(modifiers)] += 1
            else:
                current["local_insts"] += 1
    return {k: {"loads": dict(v["loads"]), "stores": dict(v["stores"]), "local_insts": v["local_insts"],
                "pack_loops": pack_loop_facts(listings[k])} for k, v in out.items()}


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
