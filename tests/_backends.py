"""Where the tests run: the device, the backends usable here (as pytest params and marks that
skip with the reason when a backend cannot run), and the compilers and built extensions present.

Import order matters for Triton: tests/conftest.py sets ``TRITON_INTERPRET=1`` when there is no
CUDA device, before anything imports Triton, so that the triton backend runs here on CPU under
the Triton interpreter (slowly: interpreted cases are kept tiny). conftest.py is loaded before
any test module, so every value below already sees that setting.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from tpo_kernels.backends import BACKEND_NAMES, backend_status

ROOT = Path(__file__).resolve().parents[1]  # the source checkout: csrc/, README.md, .ci/

# ----------------------------------------------------------------------------------------------
# Device
# ----------------------------------------------------------------------------------------------

HAS_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_GPU else "cpu")

# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------

BACKEND_STATUS = backend_status()  # name -> "available" or a one-line reason it is not


def backend_available(name: str) -> bool:
    return BACKEND_STATUS[name] == "available"


def _skip_unless_available(name: str):
    return pytest.mark.skipif(not backend_available(name), reason=f"{name} backend: {BACKEND_STATUS[name]}")


def backend_param(name: str):
    """pytest.param for a backend, skipped with the reason when it cannot run here."""
    return pytest.param(name, marks=[_skip_unless_available(name)], id=name)


def backend_params(*names: str) -> list:
    return [backend_param(name) for name in names]


needs_triton = _skip_unless_available("triton")  # Triton importable, and a GPU or the interpreter
needs_cpu = _skip_unless_available("cpu")  # the C++ CPU extension is built and loads
needs_cuda = _skip_unless_available("cuda")  # the CUDA extension is built and sees a GPU

# Every backend, each skipped where it cannot run.
ALL_BACKENDS = backend_params(*BACKEND_NAMES)

# The backends that run DEVICE tensors as compiled code (the cpu backend takes CPU tensors only,
# cuda CUDA tensors only), and the ones that run them interpreted: the triton backend on CPU,
# for tiny cases only.
if HAS_GPU:
    DEVICE_BACKENDS = backend_params("torch", "triton", "cuda")
    INTERPRETED_BACKENDS = []
else:
    DEVICE_BACKENDS = backend_params("torch", "cpu")
    INTERPRETED_BACKENDS = backend_params("triton")

# ----------------------------------------------------------------------------------------------
# Compilers and built extensions
# ----------------------------------------------------------------------------------------------


def load_cuda_toolkit():
    """csrc/cuda_toolkit.py, the CUDA discovery setup.py and .ci/build_native.sh use; None when
    the source tree is not here (an installed package tested on its own)."""
    path = ROOT / "csrc" / "cuda_toolkit.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("tpo_cuda_toolkit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CUDA_TOOLKIT = load_cuda_toolkit()
NVCC = None if CUDA_TOOLKIT is None else CUDA_TOOLKIT.find_nvcc()  # path of nvcc, or None
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def _cuda_extension_or_none():
    try:
        from tpo_kernels import _C_cuda
    except ImportError:
        return None
    return _C_cuda


# The built CUDA extension module (importable without a GPU), or None when it is not built.
CUDA_EXTENSION = _cuda_extension_or_none()
needs_cuda_extension = pytest.mark.skipif(CUDA_EXTENSION is None, reason="the CUDA extension is not built")


def _triton_nvidia_compiler_present() -> bool:
    """Triton's NVIDIA backend and its ptxas: Triton kernels compile to cubins, GPU or not."""
    try:
        import triton
        from triton.backends import backends
    except ImportError:
        return False

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return "nvidia" in backends and os.path.exists(ptxas)


TRITON_NVIDIA_COMPILER = _triton_nvidia_compiler_present()
needs_triton_nvidia_compiler = pytest.mark.skipif(
    not TRITON_NVIDIA_COMPILER, reason="Triton's NVIDIA compiler is absent"
)


# ----------------------------------------------------------------------------------------------
# Row-op results
# ----------------------------------------------------------------------------------------------


def stats_logprob_entropy(summary):
    """``(stats [2, M] = (row_max; log_sum), label_logprob, entropy | None)`` of a backend's
    ``RowSummary``: the three values the kernel tests compare, whatever fields the record adds."""
    return torch.stack([summary.row_max, summary.log_sum]), summary.label_logprob, summary.entropy
