"""Finding the CUDA tools (cuobjdump, ptxas) and reading compiled binaries."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from typing import List, Optional
from .parse import ReportError, parse_resource_usage, parse_sass


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
