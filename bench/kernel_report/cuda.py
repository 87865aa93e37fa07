"""The CUDA kernels: from the built extension, or compiled here with nvcc -Xptxas -v."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Callable, List, Optional, Sequence, Tuple
from .parse import DEFAULT_DTYPES, KernelRow, ReportError, cuda_label, demangle, parse_ptxas_log
from .tools import _run, find_cuobjdump, inspect_binary, load_toolkit, package_dir


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
            pack_loops=facts.get("pack_loops", []),
        ))
    rows.sort(key=lambda r: (r.arch, r.kernel, DEFAULT_DTYPES.index(r.dtype) if r.dtype in DEFAULT_DTYPES else 9, r.spec))
    return rows


def collect_cuda(archs: Sequence[str], *, from_source: bool = False, jobs: int = 4,
                 progress: Optional[Callable[[str], None]] = None) -> Tuple[List[KernelRow], List[str]]:
    """``(rows, notes)`` for the CUDA kernels: from the built extension when it has every arch
    (unless ``from_source``), else compiled from csrc/cuda with nvcc. Raises ReportError when
    neither is possible or a tool is missing. ``progress`` hears what is running."""
    progress = progress or (lambda text: None)
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
            progress(f"reading {os.path.basename(so)} with cuobjdump")
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
        total = len(pending)
        while pending or running:
            while pending and len(running) < max(1, jobs):
                arch, src, obj, cmd = pending.pop(0)
                running.append((arch, src, obj, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                                      text=True, cwd=os.path.dirname(csrc))))
            progress(f"nvcc: {len(done)} of {total} compiles done, {len(running)} running")
            arch, src, obj, cmd, proc = running.pop(0)
            log, _ = proc.communicate()
            if proc.returncode != 0:
                for *_, other in running:
                    other.kill()
                raise ReportError(f"nvcc failed ({proc.returncode}) on {src} for sm_{arch}:\n{log[-3000:]}")
            done.append((arch, src, obj, log))
        for inspected, (arch, src, obj, log) in enumerate(sorted(done)):
            progress(f"cuobjdump: {inspected} of {total} objects read")
            usage, sass = inspect_binary(cuobjdump, obj)
            rows += _cuda_rows(usage, sass, parse_ptxas_log(log), [arch], f"{os.path.basename(src)} (nvcc here)")
    return rows, notes
