"""Build script for the native extensions (metadata lives in pyproject.toml).

* ``tpo_kernels._C_cpu`` is always built: csrc/cpu/*.cpp + csrc/bindings_cpu.cpp, g++ -O3 with
  -fopenmp-simd (the `omp simd` loop hints only: no OpenMP runtime is linked; the row ops run on
  the extension's own thread pool, csrc/cpu/parallel.h). The kernels are compiled for the baseline ISA and, on x86-64, additionally for AVX2 and
  AVX-512 (chosen at run time), so the result is a portable wheel.
* ``tpo_kernels._C_cuda`` is built when nvcc is found: csrc/cuda/*.cu compiled by nvcc, the
  pybind11 bindings by the host compiler, linked with the host linker against the static CUDA
  runtime (so importing it needs no libcudart on the library path, and no GPU).

Build-time requirements: setuptools (64 or newer), pybind11 and the compilers. torch is never imported here.

Environment variables:
  TPO_CUDA_ARCHS     compute capabilities, e.g. "80;90" (default) or "80 90 100"; PTX for the
                     highest is embedded too, so newer GPUs can JIT it.
  TPO_REQUIRE_CUDA=1 a missing nvcc or a failed CUDA build fails the install (CI sets this).
  TPO_SKIP_CUDA=1    do not build the CUDA extension.
  TPO_NO_OPENMP=1    build the CPU extension without -fopenmp-simd (the `omp simd` hints are
                     then ignored; threading is unaffected).
  CUDA_HOME / CUDA_PATH, NVCC   where to find the CUDA toolkit / nvcc (csrc/cuda_toolkit.py).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from pybind11.setup_helpers import build_ext as pybind11_build_ext
from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


def _log(message: str) -> None:
    print(f"[tpo_kernels setup] {message}", flush=True)


def _rel(paths):
    return sorted(str(p.relative_to(ROOT)) for p in paths)


# --------------------------------------------------------------------------------------------
# CUDA toolkit discovery: csrc/cuda_toolkit.py, shared with .ci/build_native.sh
# --------------------------------------------------------------------------------------------


def _load_toolkit():
    spec = importlib.util.spec_from_file_location("tpo_cuda_toolkit", ROOT / CSRC / "cuda_toolkit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


toolkit = _load_toolkit()


# --------------------------------------------------------------------------------------------
# Extensions
# --------------------------------------------------------------------------------------------

use_openmp = sys.platform.startswith("linux") and not _flag("TPO_NO_OPENMP")
# -fopenmp-simd, not -fopenmp: libgomp's threads spin while they wait, and on a loaded machine
# that made the row ops collapse (csrc/cpu/parallel.h); the row ops' threads are std::threads (-pthread).
openmp_flags = ["-fopenmp-simd"] if use_openmp else []
thread_flags = ["-pthread"] if sys.platform.startswith("linux") else []

cpu_extension = Pybind11Extension(
    "tpo_kernels._C_cpu",
    sources=[f"{CSRC}/bindings_cpu.cpp"] + _rel((ROOT / CSRC / "cpu").glob("*.cpp")),
    include_dirs=[CSRC],
    depends=_rel((ROOT / CSRC).rglob("*.h")) + _rel((ROOT / CSRC).rglob("*.inl")),
    extra_compile_args=["-O3"] + openmp_flags + thread_flags,
    extra_link_args=thread_flags,
    cxx_std=17,
)

cuda_sources = _rel((ROOT / CSRC / "cuda").glob("*.cu"))
cuda_extension = Pybind11Extension(
    "tpo_kernels._C_cuda",
    sources=[f"{CSRC}/bindings_cuda.cpp"],
    include_dirs=[CSRC],
    # The .cu files are listed here too so that they are shipped in the sdist.
    depends=_rel((ROOT / CSRC).rglob("*.h")) + _rel((ROOT / CSRC).rglob("*.cuh")) + cuda_sources
    + [f"{CSRC}/cuda_toolkit.py"],
    extra_compile_args=["-O3"],
    cxx_std=17,
)
cuda_extension.cuda_sources = cuda_sources


class BuildExt(pybind11_build_ext):
    """build_ext that compiles ``ext.cuda_sources`` with nvcc and links the objects into the
    extension. A CUDA failure skips that extension (with a message) unless TPO_REQUIRE_CUDA."""

    def build_extensions(self):
        for ext in list(self.extensions):
            if getattr(ext, "cuda_sources", None) is None:
                continue
            reason = None
            if _flag("TPO_SKIP_CUDA"):
                reason = "TPO_SKIP_CUDA is set"
            elif toolkit.find_nvcc() is None:
                reason = "nvcc not found (set CUDA_HOME or NVCC, or put nvcc on PATH)"
            if reason is not None:
                if _flag("TPO_REQUIRE_CUDA") and not _flag("TPO_SKIP_CUDA"):
                    raise RuntimeError(f"TPO_REQUIRE_CUDA=1 but {reason}")
                _log(f"skipping the CUDA extension {ext.name}: {reason}. "
                     "The cpu, torch and triton backends are unaffected.")
                self.extensions.remove(ext)
        self._failed_cuda = []
        super().build_extensions()
        for ext in self._failed_cuda:  # so that later steps (inplace copy, outputs) skip it
            self.extensions.remove(ext)

    def build_extension(self, ext):
        if getattr(ext, "cuda_sources", None) is None:
            return super().build_extension(ext)
        try:
            self._build_cuda_extension(ext)
        except Exception as exc:  # noqa: BLE001 - any failure: report, then skip or re-raise
            if _flag("TPO_REQUIRE_CUDA"):
                raise
            _log(f"building the CUDA extension {ext.name} FAILED, skipping it: {exc}")
            _log("set TPO_REQUIRE_CUDA=1 to make this an error.")
            self._failed_cuda.append(ext)

    def _build_cuda_extension(self, ext):
        nvcc = toolkit.find_nvcc()
        root = toolkit.cuda_root(nvcc)
        lib_dir = toolkit.cuda_lib_dir(root)
        flags = toolkit.nvcc_flags(CSRC, toolkit.cuda_archs())
        _log(f"building {ext.name} with {nvcc} (toolkit {root}), {' '.join(flags)}")
        obj_dir = Path(self.build_temp) / "cuda_objects"
        obj_dir.mkdir(parents=True, exist_ok=True)
        objects, jobs = [], []
        for source in ext.cuda_sources:
            obj = obj_dir / (Path(source).stem + ".o")
            deps = [source] + list(ext.depends)
            if self.force or not obj.exists() or any(
                os.path.getmtime(d) > obj.stat().st_mtime for d in deps if os.path.exists(d)
            ):
                cmd = [nvcc, "-c", source, "-o", str(obj)] + flags
                _log(" ".join(cmd))
                jobs.append((cmd, subprocess.Popen(cmd)))  # the .cu files compile concurrently
            objects.append(str(obj))
        failed = [cmd for cmd, proc in jobs if proc.wait() != 0]
        if failed:
            raise RuntimeError("nvcc failed: " + "; ".join(" ".join(cmd) for cmd in failed))
        ext.extra_objects = list(ext.extra_objects or []) + objects
        ext.library_dirs = list(ext.library_dirs or []) + [lib_dir]
        ext.libraries = list(ext.libraries or []) + toolkit.LINK_LIBRARIES
        ext.include_dirs = list(ext.include_dirs or []) + [os.path.join(root, "include")]
        super().build_extension(ext)


# --------------------------------------------------------------------------------------------
# Build information (read by the benchmark harness): every build writes the generated,
# git-ignored module tpo_kernels/_build_info.py with the commit it was built from, so results
# name the installed package's commit. Without git (e.g. from an sdist) an existing file is kept,
# else COMMIT = "unknown".
# --------------------------------------------------------------------------------------------
from setuptools.command.build_py import build_py as _setuptools_build_py  # noqa: E402


def _git(*args):
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def write_build_info(package_dir=ROOT / "tpo_kernels"):
    path = Path(package_dir) / "_build_info.py"
    commit = _git("rev-parse", "HEAD")
    if commit is None and path.exists():
        return
    dirty = None if commit is None else bool(_git("status", "--porcelain", "--untracked-files=no"))
    try:
        path.write_text('"""Generated by setup.py at build time (not tracked by git)."""\n\n'
                        f"COMMIT = {commit or 'unknown'!r}\nDIRTY = {dirty!r}  # uncommitted changes to tracked files\n")
    except OSError as exc:  # a read-only source tree: the harness then reports 'unknown'
        _log(f"could not write {path}: {exc}")


class BuildPy(_setuptools_build_py):
    def run(self):
        write_build_info()  # before the copy, so the wheel (and an editable install) holds it
        super().run()


# --------------------------------------------------------------------------------------------
# License metadata. setuptools 77 and newer take PEP 639's SPDX expression (and deprecate the
# free-text field); older ones reject it in pyproject.toml, and a machine with torch 2.11 (which
# accepts any setuptools < 82) may have one: a new Python 3.11 venv has 65.5. So pyproject.toml
# declares the license dynamic, and it is given here in the form the running setuptools reads.
# --------------------------------------------------------------------------------------------
import setuptools  # noqa: E402


def license_metadata(setuptools_version: str = setuptools.__version__) -> dict:
    if int(setuptools_version.split(".")[0]) >= 77:
        return {"license_expression": "Apache-2.0", "license_files": ["LICENSE"]}
    return {"license": "Apache-2.0", "license_files": ["LICENSE"]}


setup(
    **license_metadata(),
    ext_modules=[cpu_extension, cuda_extension],
    cmdclass={"build_ext": BuildExt, "build_py": BuildPy},
    zip_safe=False,
)
