"""Compiling Triton kernels from a test, GPU or not (test_kept_kernels.py, test_candidate_kernels.py,
test_triton_kernels.py, test_kernel_report.py): a script run in a fresh Python with the Triton
interpreter off, and the kernel report's rows it writes checked.

Why a subprocess: conftest.py sets ``TRITON_INTERPRET=1`` in this process when there is no GPU,
and Triton reads it once, at import; only a process that starts with it off compiles the kernels
to cubins (Triton's NVIDIA compiler needs no GPU for that). Which compilers are present, for the
skip marks: tests/_backends.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _backends import ROOT

COMPILE_ARCHS = ("sm_80", "sm_90")  # what the compile scripts build for: Ampere and Hopper


def run_compiled_python(*args, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python3 *args`` (``"-c", script, ...`` or a file and its arguments) with the Triton
    interpreter off and this checkout first on the import path; asserts it exits 0, with the tail
    of its stderr as the message. Returns the finished process (its stdout, for the caller)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    result = subprocess.run([sys.executable, *map(str, args)], env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def compiled_kernel_rows(script: str, out: Path) -> list:
    """The kernel report's rows (``bench.kernel_report.KernelRow``) that ``script``, run as
    ``python3 -c script out``, writes to ``out`` as a JSON list."""
    from bench import kernel_report

    run_compiled_python("-c", script, out)
    return [kernel_report.KernelRow.from_json(d) for d in json.loads(out.read_text())]


def assert_kernels_compile_without_spills(script: str, kernels: set, out: Path) -> None:
    """``script`` (see ``compiled_kernel_rows``) compiles exactly ``kernels`` for each of
    ``COMPILE_ARCHS``, none of them spilling registers to local memory in any dtype."""
    rows = compiled_kernel_rows(script, out)
    for arch in COMPILE_ARCHS:
        compiled = {r.kernel for r in rows if r.arch.startswith(arch)}
        # Spelled out: pytest rewrites the asserts of test modules only, not of this helper.
        assert compiled == kernels, f"{arch}: missing {sorted(kernels - compiled)}, extra {sorted(compiled - kernels)}"
    spilled = [(r.kernel, r.arch, r.dtype) for r in rows if r.spilled]
    assert not spilled, f"spilled (kernel, arch, dtype): {spilled}"
