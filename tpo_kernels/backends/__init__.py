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

from .._validate import check_backend_arg, check_backend_device
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
    if backend == "auto":
        for name in _AUTO_ORDER.get(device.type, _AUTO_ORDER_DEFAULT):
            if _reason(name) is None and _load(name).supports_device(device):
                return _load(name)
        return _load("torch")
    chosen = backend if isinstance(backend, Backend) else None
    reason = chosen.unavailable_reason() if chosen is not None else _reason(backend)
    if reason is not None:
        raise RuntimeError(f"backend {getattr(chosen, 'name', backend)!r} is not usable here: {reason}")
    chosen = chosen or _load(backend)
    check_backend_device(chosen.name, chosen.supports_device(device), device)
    return chosen


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
