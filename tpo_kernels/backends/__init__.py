"""Backends (layer 1): one small module each behind :class:`~.interface.Backend`.

========  =============================================  =========================================
name      module                                         runs on
========  =============================================  =========================================
torch     :mod:`.pytorch` (chunked PyTorch)              any device
triton    :mod:`.triton` (Triton kernels)                CUDA; CPU under ``TRITON_INTERPRET=1``
cpu       :mod:`.cpu` (C++ extension ``_C_cpu``)         CPU
cuda      :mod:`.cuda` (CUDA extension ``_C_cuda``)      CUDA
========  =============================================  =========================================

Backend modules are imported on first use, so ``import tpo_kernels`` never imports Triton or
loads an extension. ``backend="auto"`` prefers cuda > triton > torch on CUDA tensors and
cpu > torch on CPU tensors. A :class:`Backend` instance may be passed wherever a name is
accepted (e.g. a backend of your own, or one wrapped for testing).
"""

from __future__ import annotations

import importlib
import os
from typing import Dict, Optional, Union

import torch

from ..checks import check_backend_arg, check_backend_device
from .interface import Backend

BACKEND_NAMES = ("torch", "triton", "cpu", "cuda")
_MODULES = {"torch": ("pytorch", "TorchBackend"), "triton": ("triton", "TritonBackend"),
            "cpu": ("cpu", "CpuBackend"), "cuda": ("cuda", "CudaBackend")}
_AUTO_ORDER = {"cuda": ("cuda", "triton", "torch")}
_AUTO_ORDER_DEFAULT = ("cpu", "torch")

# Every backend a call may dispatch to, by key: the built-in ones by name, user instances under a
# key of their own. The custom ops of tpo_kernels.ops take this key (a string) as an argument.
_REGISTRY: Dict[str, Backend] = {}


def _load(name: str) -> Backend:
    if name not in _REGISTRY:
        module, cls = _MODULES[name]
        _REGISTRY[name] = getattr(importlib.import_module(f".{module}", __name__), cls)()
    return _REGISTRY[name]


def _reason(name: str) -> Optional[str]:
    try:
        return _load(name).unavailable_reason()
    except ImportError as exc:  # a backend module whose dependency is missing
        return f"not importable: {exc}"


def backend_status() -> dict:
    """Map every backend name to ``"available"`` or a one-line reason it is not usable here."""
    return {name: (_reason(name) or "available") for name in BACKEND_NAMES}


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def get_backend(backend: Union[str, Backend], device: torch.device) -> Backend:
    """Resolve ``backend`` (a name, ``"auto"`` or a :class:`Backend`) to a usable backend for
    ``device``; raises naming ``backend`` when it cannot run there."""
    check_backend_arg(backend, BACKEND_NAMES, Backend)
    if isinstance(backend, Backend):
        reason = backend.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"backend {backend.name!r} is not usable here: {reason}")
        check_backend_device(backend.name, backend.supports_device(device), device)
        return backend
    return _REGISTRY[_usable_backend_name(backend, device.type)]


@torch.compiler.assume_constant_result
def _usable_backend_name(backend: str, device_type: str) -> str:
    """The built-in backend that ``backend`` (a name or "auto") resolves to on ``device_type``,
    loaded into the registry. Under torch.compile this runs once at trace time and its result is a
    constant of the graph: loading a backend imports a module, which Dynamo cannot trace, so a
    compiled step works from the first tpo_kernels call of a process."""
    device = torch.device(device_type)
    if backend == "auto":
        for name in _AUTO_ORDER.get(device_type, _AUTO_ORDER_DEFAULT):
            if _reason(name) is None and _load(name).supports_device(device):
                return name
        _load("torch")
        return "torch"
    reason = _reason(backend)
    if reason is not None:
        raise RuntimeError(f"backend {backend!r} is not usable here: {reason}")
    check_backend_device(backend, _load(backend).supports_device(device), device)
    return backend


def backend_key(backend: Backend) -> str:
    """The string under which the custom ops find ``backend`` (registering it if needed)."""
    if _REGISTRY.get(backend.name) is backend:
        return backend.name
    key = f"{backend.name}@{id(backend):x}"
    _REGISTRY[key] = backend
    return key


def backend_by_key(key: str) -> Backend:
    return _REGISTRY[key] if key in _REGISTRY else _load(key)


__all__ = ["BACKEND_NAMES", "Backend", "backend_by_key", "backend_key", "backend_status",
           "get_backend", "triton_interpreter_enabled"]
