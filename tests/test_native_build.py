"""Build checks of the native extensions: the CPU extension is built and dispatches per
instruction set, the CUDA extension is built wherever nvcc is and carries code for every
configured architecture (checked with cuobjdump, which must then be found), the CUDA discovery
shared by setup.py and .ci/build_native.sh, and the element-type codes agreeing across the
C++ / Python boundary."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tpo_kernels.backends import backend_status
from tpo_kernels.backends.native import DTYPE_CODES

from _backends import (
    CUDA_EXTENSION,
    CUDA_TOOLKIT,
    HAS_GPU,
    NVCC,
    ROOT,
    backend_available,
    needs_cpu,
    needs_nvcc,
)
from _native_helpers import PACKAGE_DIR, cpu_ext

needs_source = pytest.mark.skipif(CUDA_TOOLKIT is None, reason="not a source checkout (no csrc/)")
CUDA_SKIPPED = os.environ.get("TPO_SKIP_CUDA", "0") not in ("", "0")
ISAS = ("generic", "avx2", "avx512")


def cuda_so_files():
    return sorted(PACKAGE_DIR.glob("_C_cuda*.so"))


# ----------------------------------------------------------------------------------------------
# CPU extension
# ----------------------------------------------------------------------------------------------


def test_cpu_extension_built():
    assert list(PACKAGE_DIR.glob("_C_cpu*.so")) or list(PACKAGE_DIR.glob("_C_cpu*.pyd")), backend_status()["cpu"]
    assert backend_available("cpu"), backend_status()["cpu"]


@needs_cpu
def test_isa_dispatch_and_fallback():
    ext = cpu_ext()
    previous = ext.isa()
    try:
        best = ext.set_isa("")  # empty: the best the CPU supports
        assert best in ISAS
        for name in ISAS:
            # A supported ISA is used as asked; a wider one falls back to the best supported.
            want = name if ISAS.index(name) <= ISAS.index(best) else best
            assert ext.set_isa(name) == want == ext.isa()
        with pytest.raises(ValueError, match="set_isa: name must be"):  # unknown names are refused
            ext.set_isa("sse9")
    finally:
        ext.set_isa(previous)


@needs_cpu
def test_isa_chosen_by_environment():
    """TPO_CPU_ISA picks the kernels' instruction set at first use (a fresh process each)."""
    so = next(iter(PACKAGE_DIR.glob("_C_cpu*.so")))
    load = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('_C_cpu', {str(so)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(m.isa())\n"
    )
    seen = {}
    for name in ("generic", "avx512", ""):
        env = {**os.environ, "TPO_CPU_ISA": name}
        out = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, check=True)
        seen[name] = out.stdout.strip()
    assert seen["generic"] == "generic"
    best = seen[""]
    assert best in ISAS
    assert seen["avx512"] == ("avx512" if best == "avx512" else best)


# ----------------------------------------------------------------------------------------------
# The native ABI: one definition per language, and they agree
# ----------------------------------------------------------------------------------------------


@needs_source
def test_dtype_codes_match_the_abi_header():
    header = (ROOT / "csrc" / "tpo_abi.h").read_text()
    enum = re.search(r"enum DType : int \{([^}]*)\}", header)
    assert enum, "tpo::DType not found in csrc/tpo_abi.h"
    codes = {name: int(value) for name, value in re.findall(r"k(\w+) = (\d+)", enum.group(1))}
    names = {"Float32": "float32", "Float16": "float16", "BFloat16": "bfloat16", "Float64": "float64"}
    assert {names[k]: v for k, v in codes.items()} == {str(d).split(".")[1]: c for d, c in DTYPE_CODES.items()}
    # Nothing else in the package or csrc spells the codes out.
    for path in list((ROOT / "tpo_kernels").rglob("*.py")) + list((ROOT / "csrc").rglob("*.*")):
        if path.name in ("native.py", "tpo_abi.h") or path.suffix not in (".py", ".h", ".cuh", ".cu", ".cpp", ".inl"):
            continue
        text = path.read_text()
        assert "DTYPE_CODES = " not in text and "enum DType" not in text, path


# ----------------------------------------------------------------------------------------------
# CUDA discovery (csrc/cuda_toolkit.py) and the CUDA extension
# ----------------------------------------------------------------------------------------------


@needs_source
def test_cuda_archs_follow_the_environment(monkeypatch):
    monkeypatch.delenv("TPO_CUDA_ARCHS", raising=False)
    assert CUDA_TOOLKIT.cuda_archs() == ["80", "90"]
    monkeypatch.setenv("TPO_CUDA_ARCHS", "8.0 90a;100")
    archs = CUDA_TOOLKIT.cuda_archs()
    assert archs == ["80", "90a", "100"]
    assert CUDA_TOOLKIT.arch_flags(archs) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_100,code=sm_100",
        "-gencode=arch=compute_100,code=compute_100",  # PTX of the newest plain arch
    ]
    monkeypatch.setenv("TPO_CUDA_ARCHS", "sm_90")
    with pytest.raises(RuntimeError, match="TPO_CUDA_ARCHS"):
        CUDA_TOOLKIT.cuda_archs()


@needs_source
@needs_nvcc
def test_build_script_uses_the_shared_discovery(tmp_path):
    """.ci/build_native.sh reads csrc/cuda_toolkit.py's answers (TPO_CUDA_ARCHS included) and
    stops, before compiling anything, when the cuobjdump it is pointed at does not exist."""
    env = {**os.environ, "TPO_CUDA_ARCHS": "75;86"}
    shell = subprocess.run([sys.executable, str(ROOT / "csrc" / "cuda_toolkit.py"), "--shell"], env=env,
                           capture_output=True, text=True, check=True).stdout
    probe = subprocess.run(["bash", "-c", shell + '\necho "$NVCC|${CUDA_ARCHS[*]}|${NVCC_FLAGS[*]}"'],
                           capture_output=True, text=True, check=True).stdout.strip()
    nvcc, archs, flags = probe.split("|")
    assert nvcc == NVCC and archs == "75 86"
    assert "-gencode=arch=compute_86,code=sm_86" in flags and "compute_80" not in flags
    missing = str(tmp_path / "no-cuobjdump")
    run = subprocess.run(["bash", str(ROOT / ".ci" / "build_native.sh")], env={**env, "CUOBJDUMP": missing},
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode != 0
    assert f"CUOBJDUMP={missing} is not an executable file" in run.stdout


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA extension is not built")
@pytest.mark.skipif(CUDA_SKIPPED, reason="TPO_SKIP_CUDA set")
def test_cuda_extension_built_when_nvcc_present():
    assert cuda_so_files(), "nvcc is present but tpo_kernels/_C_cuda*.so was not built"
    ext = CUDA_EXTENSION
    if ext is None:  # pragma: no cover - e.g. a loader without libcuda support
        pytest.skip("built but not importable here")
    assert ext.device_count() >= 0
    reason = backend_status()["cuda"]
    if HAS_GPU:
        assert reason == "available"
    else:
        assert reason == "built, but no CUDA device"


@needs_source
@needs_nvcc
@pytest.mark.skipif(not cuda_so_files(), reason="the CUDA extension is not built")
def test_cuda_extension_carries_every_configured_arch():
    root = CUDA_TOOLKIT.cuda_root(NVCC)
    cuobjdump = CUDA_TOOLKIT.find_tool("cuobjdump", NVCC, root)
    assert cuobjdump, "nvcc is here but no cuobjdump was found (see csrc/cuda_toolkit.py find_tool)"
    for so in cuda_so_files():
        elves = subprocess.run([cuobjdump, "--list-elf", str(so)], capture_output=True, text=True,
                               check=True).stdout
        for arch in CUDA_TOOLKIT.cuda_archs():
            assert f"sm_{arch}.cubin" in elves, f"{so.name} lacks sm_{arch} code:\n{elves}"


# ----------------------------------------------------------------------------------------------
# Package metadata with the setuptools installed (CI's compatibility job: an old one)
# ----------------------------------------------------------------------------------------------


@needs_source
def test_metadata_builds_with_the_installed_setuptools(tmp_path):
    """setup.py gives the license in the form the running setuptools reads: PEP 639's
    License-Expression from setuptools 77 on, the License field before (a new Python 3.11 venv
    has 65.5, which rejects a license string in pyproject.toml and fails the whole build)."""
    import setuptools

    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fields = (tmp_path / "tpo_kernels.egg-info" / "PKG-INFO").read_text().splitlines()
    modern = int(setuptools.__version__.split(".")[0]) >= 77
    assert ("License-Expression: Apache-2.0" if modern else "License: Apache-2.0") in fields, fields
    assert "License-File: LICENSE" in fields


# ----------------------------------------------------------------------------------------------
# The sdist


def _shipped_by_manifest(path: str, manifest: str) -> bool:
    """Whether MANIFEST.in's ``include`` / ``recursive-include`` lines take ``path`` (relative,
    POSIX) and no ``global-exclude`` drops it: the subset of its grammar this project uses."""
    import fnmatch

    taken = False
    for line in manifest.splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        command, args = words[0], words[1:]
        if command == "include" and any(fnmatch.fnmatch(path, pattern) for pattern in args):
            taken = True
        elif command == "recursive-include" and path.startswith(args[0].rstrip("/") + "/"):
            taken = taken or any(fnmatch.fnmatch(path.rsplit("/", 1)[-1], pattern) for pattern in args[1:])
        elif command == "global-exclude" and any(fnmatch.fnmatch(path.rsplit("/", 1)[-1], p) for p in args):
            return False
    return taken


@pytest.mark.skipif(not (ROOT / "MANIFEST.in").exists(), reason="no MANIFEST.in (not a source tree)")
def test_sdist_ships_every_repository_file_the_tests_read():
    """Each file a test names as ``ROOT / ...`` outside the package (which the wheel carries) is
    in the sdist, so that the tests of an unpacked sdist find it."""
    manifest = (ROOT / "MANIFEST.in").read_text()
    named = set()
    for test_file in (ROOT / "tests").glob("*.py"):
        for match in re.finditer(r'ROOT((?:\s*/\s*"[^"]+")+)', test_file.read_text()):
            named.add("/".join(re.findall(r'"([^"]+)"', match.group(1))))
    files = sorted(p for p in named if (ROOT / p).is_file() and not p.startswith("tpo_kernels/")
                   and p not in ("pyproject.toml", "MANIFEST.in", "setup.py"))  # every sdist has them
    assert ".ci/run" in files and "bench/gpu_machine_versions.txt" in files  # the scan finds them
    assert [p for p in files if not _shipped_by_manifest(p, manifest)] == []
