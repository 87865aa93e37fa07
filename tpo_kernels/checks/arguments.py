"""Checks of scalar arguments, the loss settings, and what a traced call may hold."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch


REDUCTIONS = ("mean", "sum", "none")


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


def check_backend_arg(backend, names: Tuple[str, ...], backend_type: type) -> None:
    """``backend`` is "auto", a backend name or a Backend instance."""
    if isinstance(backend, backend_type):
        return
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string or a tpo_kernels Backend, got {type(backend).__name__}")
    if backend != "auto" and backend not in names:
        raise ValueError(f"backend must be 'auto' or one of {names} (or a Backend instance), got {backend!r}")


def check_backend_device(name: str, supported: bool, device: torch.device) -> None:
    if not supported:
        raise ValueError(f"backend {name!r} does not run on {device.type} tensors")


def check_tile_policy(tile_policy, policy_type: type) -> None:
    if tile_policy is not None and not isinstance(tile_policy, policy_type):
        raise TypeError(f"tile_policy must be a TilePolicy or None, got {type(tile_policy).__name__}")


# ----------------------------------------------------------------------------- compiling

# What a call checks when Dynamo traces it (``torch.compile``).
#
# Two things cannot be part of a single graph: the value checks of ``validate=True`` (they read a
# result back to the host to decide whether to raise) and the collectives of a distributed call
# (the agreement of the ranks and the gathers run eagerly). Without ``fullgraph=True`` Dynamo
# breaks the graph there and runs them eagerly, which works; with it, Dynamo stops with an error
# about ``Tensor.tolist()`` or a skipped function that names neither cause. A call traced as one
# graph therefore stops first, with an error that says what to change.


@torch.compiler.assume_constant_result
def _refuse_in_one_graph(message: str) -> bool:
    """Raise ``RuntimeError(message)`` while Dynamo traces with ``fullgraph=True`` (or under
    ``torch._dynamo.error_on_graph_break(True)``), where a graph break is an error; False
    otherwise. Runs at trace time (``assume_constant_result``): Dynamo's current frame can be
    read there, and an error raised there reaches the user with its own words first (inside
    Dynamo's ``InternalTorchDynamoError``; traced code raising would read "Observed exception").
    A Dynamo without these fields gives no verdict (False), which leaves Dynamo's own error."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator  # noqa: PLC0415

        tx = InstructionTranslator.current_tx()
        one_graph = bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))
    except Exception:  # noqa: BLE001 - another Dynamo: no verdict
        return False
    if one_graph:
        raise RuntimeError(message)
    return False


def check_traceable(function: str, validate: bool, distributed_keywords: tuple) -> None:
    """Raise one clear error when ``function`` is traced as a single graph with value checks
    (``validate=True``) or distributed keywords (``distributed_keywords``: the names of those
    that are set); nothing outside ``torch.compile``. Runs before any other check."""
    if not torch.compiler.is_compiling():
        return
    if distributed_keywords:
        names = " and ".join(distributed_keywords)
        _refuse_in_one_graph(
            f"{function} with {names} cannot be traced into one graph: distributed calls run eagerly (the ranks "
            f"agree on their inputs and gather rows with collectives). Call it outside the compiled region, or "
            f"compile without fullgraph=True so that Dynamo runs it eagerly between graphs")
    elif validate is True:
        _refuse_in_one_graph(
            f"{function} with validate=True cannot be traced into one graph: its value checks read results back "
            f"to the host. Pass validate=False under torch.compile(fullgraph=True) (or compile without "
            f"fullgraph, which runs the checks eagerly between graphs)")
