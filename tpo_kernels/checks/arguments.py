"""Checks of one argument each: scalars and the loss settings, tensors (types, shapes, dtypes,
devices)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ..backends.row_summary import FLOAT_DTYPES

REDUCTIONS = ("mean", "sum", "none")
_INT64_LIMIT = 2 ** 63


# ----------------------------------------------------------------------------- scalars


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def _is_int(value) -> bool:
    """A Python int or any other integral number (NumPy integers), but not a bool."""
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _is_real(value) -> bool:
    """A Python int/float or any other real number (NumPy scalars), but not a bool."""
    return isinstance(value, numbers.Real) and not _is_bool(value)


def check_int(name: str, value, minimum: int) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


# Kernels take 1 / temperature and 1 / eta as float32 scalars (Triton types float arguments as
# fp32, and fp32 is the compute dtype of every input but fp64): both reciprocals must be finite
# there, or every logit / target turns into inf and the results into NaN.
_MIN_POSITIVE = 1.0 / float(torch.finfo(torch.float32).max)


def check_positive(name: str, value) -> float:
    """A finite number > 0 whose reciprocal is finite in float32 (temperature, eta)."""
    value = _check_finite_positive(name, value)
    if 1.0 / value > float(torch.finfo(torch.float32).max):
        raise ValueError(
            f"{name} must be at least {_MIN_POSITIVE:.4g} (its reciprocal must be finite in float32, "
            f"the precision the kernels take it in), got {value}"
        )
    return value


def check_logit_transform(logit_scale, logit_softcap, inv_temperature: float) -> Tuple[float, Optional[float]]:
    """``(logit_scale, logit_softcap | None)``: a scale > 0 and a soft cap > 0 or None, such that
    the factors the kernels take in float32 (``scale / temperature`` without a cap, ``scale /
    softcap`` and ``softcap`` with one) are finite and nonzero there."""
    scale = _check_finite_positive("logit_scale", logit_scale)
    softcap = None if logit_softcap is None else _check_finite_positive("logit_softcap", logit_softcap)
    if softcap is None:
        factors = {"logit_scale / temperature": scale * inv_temperature}
    else:
        factors = {"logit_scale / logit_softcap": scale / softcap, "logit_softcap": softcap}
    fp32 = torch.finfo(torch.float32)
    for name, factor in factors.items():
        if not fp32.tiny <= factor <= fp32.max:
            raise ValueError(f"{name} must lie in [{fp32.tiny:.4g}, {fp32.max:.4g}] (a float32 factor of the "
                             f"logits), got {factor:.4g}")
    return scale, softcap


def _check_finite_positive(name: str, value) -> float:
    if not _is_real(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    # Comparisons rather than math.isfinite: under torch.compile(dynamic=True) a float default
    # is a symbolic float, which math.isfinite cannot take (NaN fails both comparisons).
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def check_score_eps(score_eps) -> float:
    """The near-tie tolerance on a group's score std: 0, or a finite number in float32's normal
    range (the Triton group kernel takes it as float32 parts)."""
    if not _is_real(score_eps):
        raise TypeError(f"score_eps must be a number, got {type(score_eps).__name__}")
    score_eps = float(score_eps)
    fp32 = torch.finfo(torch.float32)
    if not (score_eps == 0 or fp32.tiny <= score_eps <= fp32.max):
        raise ValueError(f"score_eps must be 0 or a number in [{fp32.tiny:.4g}, {fp32.max:.4g}] (a tolerance on "
                         f"the population std of a group's scores), got {score_eps!r}")
    return score_eps


def check_flag(name: str, value) -> bool:
    if not _is_bool(value):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_reduction(reduction) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def check_ignore_index(ignore_index) -> int:
    """An integral id (a float, even -100.0, is rejected by every function alike)."""
    if not _is_int(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    return int(ignore_index)


def check_beta(beta) -> float:
    if not _is_real(beta):
        raise TypeError(f"beta must be a number, got {type(beta).__name__}")
    beta = float(beta)
    if not 0 <= beta < math.inf:  # comparisons: see _check_finite_positive
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
    return beta


def check_entropy_coef(entropy_coef) -> float:
    """The weight of the entropy bonus: a finite number >= 0 (a bonus; a negative weight, an
    entropy penalty, is refused rather than silently flipping the sign a trainer meant)."""
    if not _is_real(entropy_coef):
        raise TypeError(f"entropy_coef must be a number, got {type(entropy_coef).__name__}")
    entropy_coef = float(entropy_coef)
    if not 0 <= entropy_coef < math.inf:  # comparisons: see _check_finite_positive
        raise ValueError(f"entropy_coef must be a finite number >= 0 (the weight of the mean token entropy "
                         f"subtracted from the loss), got {entropy_coef!r}")
    return entropy_coef


@dataclass(frozen=True)
class LossSettings:
    """The checked hyper-parameters every TPO loss takes."""

    eta: float
    anchor: bool
    inv_temperature: float
    reduction: str
    return_aux: bool
    validate: bool
    return_entropy: bool = False
    logit_scale: float = 1.0
    logit_softcap: Optional[float] = None
    score_eps: float = 1e-6
    length_normalize: bool = False
    entropy_coef: float = 0.0


def check_settings(*, eta, anchor, temperature, reduction, return_aux, validate, return_entropy=False,
                   logit_scale=1.0, logit_softcap=None, score_eps=1e-6, length_normalize=False,
                   entropy_coef=0.0) -> LossSettings:
    eta = check_positive("eta", eta)
    inv_temperature = 1.0 / check_positive("temperature", temperature)
    logit_scale, logit_softcap = check_logit_transform(logit_scale, logit_softcap, inv_temperature)
    settings = LossSettings(
        eta=eta,
        anchor=check_flag("anchor", anchor),
        inv_temperature=inv_temperature,
        reduction=check_reduction(reduction),
        return_aux=check_flag("return_aux", return_aux),
        validate=check_flag("validate", validate),
        return_entropy=check_flag("return_entropy", return_entropy),
        logit_scale=logit_scale,
        logit_softcap=logit_softcap,
        score_eps=check_score_eps(score_eps),
        length_normalize=check_flag("length_normalize", length_normalize),
        entropy_coef=check_entropy_coef(entropy_coef),
    )
    if settings.return_entropy and not settings.return_aux:
        raise ValueError("return_entropy=True puts the token entropy in aux['token_entropy']: pass return_aux=True too")
    return settings


def check_tile_policy(tile_policy, policy_type: type) -> None:
    if tile_policy is not None and not isinstance(tile_policy, policy_type):
        raise TypeError(f"tile_policy must be a TilePolicy or None, got {type(tile_policy).__name__}")


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


def check_integer_tensor(name: str, x, device: torch.device, reference: str) -> Tensor:
    """An integer tensor (ids) on ``reference``'s device."""
    check_integer_dtype(name, check_tensor(name, x, device, reference))
    return x


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
