"""Instructions per 16-byte pack in the main loops of the CUDA row kernels, from their SASS: the
measure of whether a row kernel is bound by memory or by instruction issue, without a GPU.

    python -m bench.kernel_report.loops                               # the built extension, sm_90
    python -m bench.kernel_report.loops old/_C_cuda.so --arch 80              # any binaries

A kernel's pack loop is its loop (a backward branch) with the most 128-bit global loads; the
backward has one per variant, the one with the entropy term being the loop with FMNMX (the floor
of log2 p). ``loop``: its instructions; ``packs``: 128-bit loads per iteration; ``per pack``:
the two divided; ``common``: per pack without the regions that forward branches inside the loop
skip, which in these kernels guard rare events only (a group raising the running max, the group
holding the label); ``skipped``: those regions' sizes. Budget: an SM issues 128 thread
instructions per cycle, so a 16-byte pack stays bound by memory on an H100 / H200 (3.35-4.8 TB/s,
132 SMs at ~1.8-2 GHz) below about 100 instructions.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from .cuda import built_cuda_extensions
from .parse import ELEMENTS_PER_PACK, ReportError, cuda_label, demangle, main_loops, pack_loop_facts
from .tools import _run, find_cuobjdump, load_toolkit

_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s*([^;]*);")


@dataclasses.dataclass
class PackLoop:
    kernel: str  # row_forward_kernel | row_backward_kernel
    dtype: str
    variant: str  # template arguments (forward) or ge == 0 / ge != 0 (backward)
    insts: int
    packs: int
    skipped: List[int]  # sizes of the branch-skipped regions

    @property
    def per_pack(self) -> float:
        return self.insts / self.packs

    @property
    def common_per_pack(self) -> float:
        return (self.insts - sum(self.skipped)) / self.packs

    @property
    def common_per_element(self) -> float:
        return self.common_per_pack / ELEMENTS_PER_PACK[self.dtype]


def functions(sass: str) -> Dict[str, List[Tuple[int, str]]]:
    """``cuobjdump -sass`` of one architecture -> {symbol: [(address, instruction)]}."""
    out: Dict[str, List[Tuple[int, str]]] = {}
    current = None
    for line in sass.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def _loop(kernel: str, dtype: str, variant: str, facts: dict) -> PackLoop:
    return PackLoop(kernel, dtype, variant, facts["insts"], facts["packs"], facts["skipped"])


def pack_loops(sass: str) -> List[PackLoop]:
    """The pack loops of the fp32 / bf16 / fp16 row kernels (the 512-thread specializations; fp64
    is bound by its software exp2, not by memory) in one architecture's SASS."""
    funcs = functions(sass)
    names = demangle(sorted(funcs))
    out = []
    for symbol, insts in funcs.items():
        kernel, dtype, spec = cuda_label(names.get(symbol, symbol), symbol)
        if kernel not in ("row_forward_kernel", "row_backward_kernel") or not spec.startswith("<512") \
                or dtype == "fp64":
            continue
        loops = pack_loop_facts(insts)
        if kernel == "row_forward_kernel":
            (main,) = main_loops(loops)
            out.append(_loop(kernel, dtype, "entropy" if "true" in spec else "plain", main))
            continue
        for main in main_loops(loops):
            out.append(_loop(kernel, dtype, "entropy" if main["has_max"] else "plain", main))
    out.sort(key=lambda l: (l.kernel, l.dtype, l.variant))
    return out


def binary_loops(path: str, arch: str = "90") -> List[PackLoop]:
    cuobjdump = find_cuobjdump(load_toolkit())
    return pack_loops(_run([cuobjdump, "-sass", "-arch", f"sm_{arch}", path], "cuobjdump -sass"))


def format_table(loops: Sequence[PackLoop]) -> str:
    lines = [f"{'kernel':20s} {'dtype':5s} {'variant':8s} {'loop':>5s} {'packs':>5s} {'per pack':>8s} "
             f"{'common':>7s} {'per elem':>8s}  skipped"]
    for l in loops:
        lines.append(f"{l.kernel:20s} {l.dtype:5s} {l.variant:8s} {l.insts:5d} {l.packs:5d} {l.per_pack:8.1f} "
                     f"{l.common_per_pack:7.1f} {l.common_per_element:8.2f}  {l.skipped}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernel_report.loops",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("binaries", nargs="*", help="cubins / objects / extensions (default: the built _C_cuda)")
    parser.add_argument("--arch", default="90", help="compute capability of the SASS to read (default 90)")
    args = parser.parse_args(argv)
    try:
        paths = args.binaries or built_cuda_extensions()
        if not paths:
            raise ReportError("no built CUDA extension (tpo_kernels/_C_cuda*.so) and no binary given")
        for path in paths:
            print(f"{path} (sm_{args.arch})\n{format_table(binary_loops(path, args.arch))}\n")
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
