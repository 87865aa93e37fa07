"""Checks of tensor arguments: types, shapes, dtypes, devices; labels."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._dtypes import FLOAT_DTYPES
from .deferred import ValueChecks
from .scalars import _is_int, check_ignore_index

_INT64_LIMIT = 2 ** 63


# ----------------------------------------------------------------------------- tensors


def check_tensor(name: str, x, device: Optional[torch.device] = None, reference: str = "") -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if device is not None:
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but {reference} is on {device}")
        reject_meta(name, x)
    return x


def reject_meta(name: str, x: Tensor) -> None:
    """Meta tensors carry no data; every function reads values."""
    if x.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device (no data): the loss reads values; pass a tensor on a real device"
        )


def check_float_tensor(name: str, x, ndims: Tuple[int, ...]) -> Tensor:
    check_tensor(name, x)
    reject_function_transforms(name, x)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() not in ndims:
        expected = " or ".join(f"{d}-D" for d in ndims)
        raise ValueError(f"{name} must be {expected}, got shape {tuple(x.shape)}")
    return x


def reject_function_transforms(name: str, x: Tensor) -> None:
    """torch.func.grad / jacrev / jvp wrap their inputs; the losses' gradients are classic
    autograd.Function rules, which those transforms cannot run (vmap's batched tensors pass)."""
    if torch.compiler.is_compiling():
        return
    functorch = torch._C._functorch
    if functorch.is_functorch_wrapped_tensor(x) and not functorch.is_batchedtensor(x):
        raise NotImplementedError(
            f"{name} comes from a torch.func transform (grad, jacrev, jvp, ...): tpo_kernels does not "
            "support function transforms other than vmap; use torch.autograd.grad or .backward()"
        )


def check_integer_dtype(name: str, x: Tensor) -> None:
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")


def check_logits(logits, ndims: Tuple[int, ...] = (2, 3)) -> Tensor:
    check_float_tensor("logits", logits, ndims)
    reject_meta("logits", logits)
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    return logits


def check_head(hidden, weight, bias, hidden_ndims: Tuple[int, ...] = (2, 3), same_dtype: bool = False) -> None:
    """hidden ``[..., H]``, weight ``[V, H]`` with V >= 1, bias ``[V]`` in the weight's dtype, one
    device. Hidden states may have another float dtype than the head unless ``same_dtype``."""
    check_float_tensor("hidden", hidden, hidden_ndims)
    reject_meta("hidden", hidden)
    if hidden.shape[-1] == 0:
        raise ValueError(f"hidden must have a non-empty hidden dimension (shape [..., H] with H > 0), "
                         f"got {tuple(hidden.shape)}")
    check_float_tensor("weight", weight, (2,))
    if weight.shape[0] == 0:
        raise ValueError("weight must have a non-empty vocabulary dimension (shape [V, H] with V > 0)")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape [V, H] with H={hidden.shape[-1]} (the last dim of hidden), "
            f"got {tuple(weight.shape)}"
        )
    if same_dtype and weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have the dtype of hidden ({hidden.dtype}), got {weight.dtype}")
    check_tensor("weight", weight, hidden.device, "hidden")
    if bias is None:
        return
    check_float_tensor("bias", bias, (1,))
    if tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape [V]=({weight.shape[0]},), got {tuple(bias.shape)}")
    if bias.dtype != weight.dtype:
        raise TypeError(f"bias must have the dtype of weight ({weight.dtype}), got {bias.dtype}")
    check_tensor("bias", bias, hidden.device, "hidden")


def check_chunk_size(chunk_size) -> Optional[int]:
    """``chunk_size``: a budget of ``chunk_size * V`` logits per tile, or None (per device)."""
    if chunk_size is None:
        return None
    if not _is_int(chunk_size):
        raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}")
    chunk_size = int(chunk_size)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (a budget of chunk_size * V logits per tile), got {chunk_size}")
    return chunk_size


def check_grad_accum_dtype(grad_accum_dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of dW and db, never narrower than the weight's own dtype."""
    if grad_accum_dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"grad_accum_dtype must be torch.float32, float64 or the weight dtype, got {grad_accum_dtype!r}"
        )
    return torch.promote_types(grad_accum_dtype, weight_dtype)


# ----------------------------------------------------------------------------- labels


def _label_error(labels: Tensor, bad: Tensor, vocab_size: int) -> ValueError:
    found = labels[bad][0].item()  # reads back, on the error path only
    return ValueError(
        f"labels must hold ids in [0, {vocab_size}) or ignore_index at counted positions; found {found}"
    )


def prepare_labels(labels, token_shape, vocab_size: Optional[int], device: torch.device, input_name: str,
                   ignore_index, validate: bool, mask: Optional[Tensor] = None,
                   checks: Optional[ValueChecks] = None) -> Tensor:
    """Flat int64 ``[M]`` labels with -1 at the positions that do not count (``ignore_index``,
    or False in the flat bool ``mask``); with ``validate``, counted ids are checked to lie in
    ``[0, vocab_size)`` (``[0, inf)`` for ``vocab_size`` None, a shard's vocabulary before the
    shards are placed): added to ``checks`` when given, else read back here."""
    check_tensor("labels", labels, device, input_name)
    check_integer_dtype("labels", labels)
    if tuple(labels.shape) != tuple(token_shape):
        raise ValueError(
            f"labels must have shape {tuple(token_shape)} (the leading dims of {input_name}), got {tuple(labels.shape)}"
        )
    ignore_index = check_ignore_index(ignore_index)
    flat = labels.reshape(-1)
    counted = flat != ignore_index
    if mask is not None:
        counted = counted & mask
    if validate:
        pending = ValueChecks() if checks is None else checks
        bad = counted & (flat < 0) if vocab_size is None else counted & ((flat < 0) | (flat >= vocab_size))
        pending.require(~bad.any(), lambda: _label_error(flat, bad, vocab_size))
        if checks is None:
            pending.read()
    return torch.where(counted, flat.to(torch.int64), -1).contiguous()


def check_logits_cache(logits_cache_bytes, policy_bytes, vocab_parallel: bool) -> int:
    """The bytes of logits the fused head's forward may keep for its backward: an int >= 0 given
    as the keyword or on the tile policy (not both, unless equal); 0 with a vocabulary shard."""
    budgets = []
    for name, value in (("logits_cache_bytes", logits_cache_bytes), ("tile_policy.logits_cache_bytes", policy_bytes)):
        if not _is_int(value):  # a Python or NumPy integer, as every integer keyword
            raise TypeError(f"{name} must be an int (bytes of logits the forward may keep for the backward), "
                            f"got {type(value).__name__}")
        value = int(value)
        if not 0 <= value < _INT64_LIMIT:  # the ops take it as an int64
            raise ValueError(f"{name} must be an int in [0, 2**63) (bytes of logits the forward may keep for "
                             f"the backward), got {value}")
        budgets.append(value)
    logits_cache_bytes, policy_bytes = budgets
    if logits_cache_bytes and policy_bytes not in (0, logits_cache_bytes):
        raise ValueError(f"logits_cache_bytes={logits_cache_bytes} disagrees with "
                         f"tile_policy.logits_cache_bytes={policy_bytes}; give one of them")
    if (logits_cache_bytes or policy_bytes) and vocab_parallel:
        raise ValueError("logits_cache_bytes is not supported with a vocabulary-parallel head "
                         "(vocab_parallel_group / DTensor shards); pass 0")
    return logits_cache_bytes
