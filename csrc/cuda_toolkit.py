"""CUDA toolkit discovery for the native build: the one implementation that setup.py (which loads
this file by path) and .ci/build_native.sh (``python csrc/cuda_toolkit.py --shell``) share.

Standard library only, so it runs before any build dependency is installed. Environment:

  NVCC, CUDA_HOME / CUDA_PATH   where nvcc / the toolkit are (else PATH, then /usr/local/cuda)
  TPO_CUDA_ARCHS                compute capabilities, e.g. "80;90" (default) or "80 90 100"
  CUOBJDUMP                     a cuobjdump to use instead of searching for one
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import List, Optional

DEFAULT_ARCHS = "80;90"
# Static CUDA runtime: the extension then needs only libcuda (the driver), loaded at first use.
LINK_LIBRARIES = ["cudart_static", "dl", "pthread", "rt"]


def find_nvcc() -> Optional[str]:
    candidates = [os.environ.get("NVCC")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for cand in candidates:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def cuda_root(nvcc: str) -> str:
    """The toolkit root. nvcc may be a wrapper script (e.g. /usr/local/bin/nvcc), so ask nvcc
    itself (--dryrun prints TOP=<root>) before guessing from its path."""
    try:
        out = subprocess.run(
            [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
            capture_output=True, text=True, timeout=60,
        )
        match = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
        if match:
            return os.path.realpath(match.group(1).strip())
    except (OSError, subprocess.SubprocessError):
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def cuda_lib_dir(root: str) -> str:
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                os.path.join("targets", "sbsa-linux", "lib")):
        path = os.path.join(root, sub)
        if os.path.isfile(os.path.join(path, "libcudart_static.a")):
            return path
    raise RuntimeError(f"libcudart_static.a not found under the CUDA toolkit at {root}")


def cuda_archs() -> List[str]:
    """TPO_CUDA_ARCHS as a list like ["80", "90"] (an arch-specific "90a" / "100f" stays as is)."""
    raw = os.environ.get("TPO_CUDA_ARCHS", DEFAULT_ARCHS)
    archs = [a.replace(".", "").strip() for a in re.split(r"[;, ]+", raw) if a.strip()]
    if not archs or any(not re.fullmatch(r"\d+[af]?", a) for a in archs):
        raise RuntimeError(f"TPO_CUDA_ARCHS={raw!r}: expected compute capabilities like '80;90'")
    return archs


def arch_flags(archs: List[str]) -> List[str]:
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    # PTX of the newest plain arch (not an arch-specific 90a/100f), for JIT on newer GPUs.
    plain = [a for a in archs if a.isdigit()]
    if plain:
        top = max(plain, key=int)
        flags.append(f"-gencode=arch=compute_{top},code=compute_{top}")
    return flags


def nvcc_flags(include_dir: str, archs: List[str]) -> List[str]:
    """Everything nvcc gets besides ``-c source -o object``."""
    return [
        "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
        "--expt-relaxed-constexpr", "-lineinfo", f"-I{include_dir}",
    ] + arch_flags(archs)


def find_tool(name: str, nvcc: str, root: str) -> Optional[str]:
    """A CUDA binary tool (e.g. ``cuobjdump``): the env var ``NAME`` when set (and then only
    that), else the toolkit (next to nvcc, or the root's bin/), then PATH, then the CUDA tool
    wheels of this Python (``nvidia/*/bin``, e.g. from ``pip install nvidia-cuda-cuobjdump``),
    then the copy the Triton wheel bundles for its own use (``triton/backends/nvidia/bin``).
    None when there is none."""
    if os.environ.get(name.upper()):
        chosen = os.environ[name.upper()]
        return chosen if os.path.isfile(chosen) and os.access(chosen, os.X_OK) else None
    candidates = []
    for folder in (os.path.dirname(nvcc), os.path.dirname(os.path.realpath(nvcc)),
                   os.path.join(root, "bin")):
        candidates.append(os.path.join(folder, name))
    candidates.append(shutil.which(name))
    for entry in sys.path:
        if os.path.isdir(os.path.join(entry, "nvidia")):
            candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "bin", name)))
    triton = importlib.util.find_spec("triton")  # locates the package without importing it
    if triton is not None and triton.submodule_search_locations:
        for folder in triton.submodule_search_locations:
            candidates.append(os.path.join(folder, "backends", "nvidia", "bin", name))
    for cand in candidates:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _shell() -> int:
    """Print the discovery results as bash assignments (for ``eval``); exit 1 on a bad
    TPO_CUDA_ARCHS. Without nvcc only ``NVCC=''`` is meaningful."""
    archs = cuda_archs()
    nvcc = find_nvcc()
    values = {"NVCC": nvcc or "", "CUDA_ROOT": "", "CUDA_LIB": "", "CUOBJDUMP": ""}
    flags: List[str] = []
    if nvcc:
        root = cuda_root(nvcc)
        values["CUDA_ROOT"] = root
        try:
            values["CUDA_LIB"] = cuda_lib_dir(root)
        except RuntimeError:
            pass
        values["CUOBJDUMP"] = find_tool("cuobjdump", nvcc, root) or ""
        flags = nvcc_flags("csrc", archs)
    for key, value in values.items():
        print(f"{key}={shlex.quote(value)}")
    print(f"CUDA_ARCHS=({' '.join(shlex.quote(a) for a in archs)})")
    print(f"NVCC_FLAGS=({' '.join(shlex.quote(f) for f in flags)})")
    print(f"CUDA_LINK_LIBS=({' '.join('-l' + lib for lib in LINK_LIBRARIES)})")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--shell"]:
        sys.exit("usage: python csrc/cuda_toolkit.py --shell")
    try:
        sys.exit(_shell())
    except RuntimeError as exc:
        sys.exit(f"cuda_toolkit: {exc}")
