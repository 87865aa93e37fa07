"""Checks of one argument each: scalars, tensors (types, shapes, dtypes, devices); and the settings
of a call checked in one pass into its stages' records (:func:`check_options`)."""

from __future__ import annotations

import math
import numbers
import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ..backends.rows import FLOAT_DTYPES, RowRequest
from ..group_math import GroupRule
from ..ops.group import LossWeights

REDUCTIONS = ("mean", "sum", "none")
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1  # the ops, the agreement records and the labels hold int64
_FP32 = torch.finfo(torch.float32)


# ----------------------------------------------------------------------------- scalars

# What a scalar keyword takes. An integer keyword: a Python int or a NumPy integer (never a bool,
# a float, even 2.0, or an array). A real keyword: any numbers.Real (int, float, NumPy integer and
# float scalars of every width, fractions.Fraction) but a bool, converted once by float(); an int
# too large for a float is a ValueError naming the keyword, not the bare OverflowError of float().
# Refused with a TypeError naming the keyword: decimal.Decimal (not a numbers.Real: Python keeps
# it apart from binary floats), complex numbers, and 0-d NumPy arrays and torch tensors (a tensor
# may live on a device, carry autograd history or be traced: the caller says which number it means,
# with .item()). A flag: a bool or a NumPy bool.


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def _is_int(value) -> bool:
    """A Python int or any other integral number (NumPy integers), but not a bool."""
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _is_real(value) -> bool:
    """A Python int/float or any other real number (NumPy scalars), but not a bool."""
    return isinstance(value, numbers.Real) and not _is_bool(value)


def _kind(value) -> str:
    """The type of a refused value, with a hint for the arrays a number was probably meant from."""
    name = type(value).__name__
    if isinstance(value, (Tensor, np.ndarray)):
        return f"{name} (pass a Python value: x.item())"
    return name


def _shown(value) -> str:
    """``value`` for a message. An int too long to print (Python refuses to format one of over
    4300 digits, with a ValueError of its own) by its magnitude."""
    if _is_int(value) and abs(int(value)) >= 10 ** 30:
        return f"{'-' if value < 0 else ''}an int of about 10**{int(math.log10(abs(int(value))))}"
    try:
        return repr(value)
    except ValueError:  # a Fraction of such ints
        return f"a {type(value).__name__} too large to print"


def _real(name: str, value, requirement: str) -> float:
    """``value`` as a float; a TypeError naming ``name`` when it is no real number, a ValueError
    saying ``requirement`` when it does not fit a float."""
    if not _is_real(value):
        raise TypeError(f"{name} must be a number (int, float or a NumPy scalar), got {_kind(value)}")
    try:
        return float(value)
    except (OverflowError, ValueError):
        raise ValueError(f"{name} must be {requirement}, got {_shown(value)} (beyond the range of a float)") from None


def check_int(name: str, value, minimum: int, maximum: Optional[int] = None, meaning: str = "") -> int:
    """An integer in ``[minimum, maximum]`` (no upper bound for None); ``meaning`` says what it is."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {_kind(value)}")
    value = int(value)
    if not (minimum <= value and (maximum is None or value <= maximum)):
        bounds = f">= {minimum}" if maximum is None else f"an int in [{_bound(minimum)}, {_bound(maximum + 1)})"
        raise ValueError(f"{name} must be {bounds}{f' ({meaning})' if meaning else ''}, got {_shown(value)}")
    return value


def _bound(limit: int) -> str:
    return {2 ** 63: "2**63", -(2 ** 63): "-2**63"}.get(limit, str(limit))


# Kernels take 1 / temperature and 1 / eta as float32 scalars (Triton types float arguments as
# fp32, and fp32 is the compute dtype of every input but fp64): both reciprocals must be finite
# there, or every logit / target turns into inf and the results into NaN.
_MIN_POSITIVE = 1.0 / float(_FP32.max)


def check_positive(name: str, value) -> float:
    """A finite number > 0 whose reciprocal is finite in float32 (temperature, eta)."""
    value = _check_finite_positive(name, value)
    if 1.0 / value > float(_FP32.max):
        raise ValueError(
            f"{name} must be at least {_MIN_POSITIVE:.4g} (its reciprocal must be finite in float32, "
            f"the precision the kernels take it in), got {value}"
        )
    return value


def check_logit_transform(logit_scale, logit_softcap, inv_temperature: float) -> Tuple[float, Optional[float]]:
    """``(logit_scale, logit_softcap | None)``: a scale > 0 and a soft cap > 0 or None, such that
    the factors the kernels take in float32 (``scale / temperature`` without a cap, ``scale /
    softcap`` and ``softcap`` with one) are finite and nonzero there. With a cap the tempered
    logits lie in ``[-softcap / temperature, softcap / temperature]``: their span (the largest
    difference the log-softmax forms) must be finite in float32 too, whatever the logits."""
    scale = _check_finite_positive("logit_scale", logit_scale)
    softcap = None if logit_softcap is None else _check_finite_positive("logit_softcap", logit_softcap)
    if softcap is None:
        factors = {"logit_scale / temperature": (scale * inv_temperature, _FP32.max)}
    else:
        factors = {"logit_scale / logit_softcap": (scale / softcap, _FP32.max), "logit_softcap": (softcap, _FP32.max),
                   "logit_softcap / temperature": (softcap * inv_temperature, _FP32.max / 2)}
    for name, (factor, largest) in factors.items():
        if not _FP32.tiny <= factor <= largest:
            raise ValueError(f"{name} must lie in [{_FP32.tiny:.4g}, {largest:.4g}] (a float32 factor of the "
                             f"logits{', twice it their span' if largest < _FP32.max else ''}), got {factor:.4g}")
    return scale, softcap


def _check_finite_positive(name: str, value) -> float:
    value = _real(name, value, "a finite number > 0")
    # Comparisons rather than math.isfinite: under torch.compile(dynamic=True) a float default
    # is a symbolic float, which math.isfinite cannot take (NaN fails both comparisons).
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


# Formatted once: under torch.compile(dynamic=True) a float formatted in traced code may be symbolic,
# which Dynamo cannot put in a string; messages format values only on failure.
_SCORE_EPS_RANGE = f"0 or a number in [{_FP32.tiny:.4g}, {_FP32.max:.4g}]"


def check_score_eps(score_eps) -> float:
    """The near-tie tolerance on a group's score std: 0, or a finite number in float32's normal
    range (the Triton group kernel takes it as float32 parts)."""
    score_eps = _real("score_eps", score_eps, _SCORE_EPS_RANGE)
    if not (score_eps == 0 or _FP32.tiny <= score_eps <= _FP32.max):
        raise ValueError(f"score_eps must be {_SCORE_EPS_RANGE} (a tolerance on the population std of a group's "
                         f"scores), got {score_eps!r}")
    return score_eps


def check_flag(name: str, value) -> bool:
    if not _is_bool(value):
        raise TypeError(f"{name} must be a bool, got {_kind(value)}")
    return bool(value)


def check_reduction(reduction) -> str:
    if not isinstance(reduction, str):
        raise TypeError(f"reduction must be a str, one of {REDUCTIONS}, got {_kind(reduction)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def check_ignore_index(ignore_index) -> int:
    """An integral id (a float, even -100.0, is rejected by every function alike) that an int64
    label can equal: labels are compared as int64 (in their own dtype an int32 label would equal
    ``ignore_index + 2**32``)."""
    return check_int("ignore_index", ignore_index, INT64_MIN, INT64_MAX, "the label id of positions that do not count")


# The weights of the token-mean terms beside the group term (beta: the k3 KL term; entropy_coef:
# the entropy bonus). A weight multiplies a per-token term averaged (or, for reduction="sum",
# summed) over at most 2**63 tokens; the loss is float32 for every input but float64. A token's
# entropy is below ln(2**63) < 64 nats for any vocabulary an int64 id can index, so a weight of at
# most float32.max / (64 * 2**63) (about 5.8e17) keeps weight * (entropy term) finite for every
# input and every reduction. The k3 term exp(d) - d - 1 (d = ref - policy log-prob) has no upper
# bound, so no bound on beta keeps every loss finite; the same one keeps beta * k3 finite while
# every token's k3 is below 64, as large as any entropy term (d < 4.2: the policy at most e^4.2
# times less likely than the reference). Weights far beyond any practical one (1e-3 .. 1) are
# refused instead of turning the loss into inf.
MAX_TERM_WEIGHT = float(_FP32.max) / (64.0 * 2.0 ** 63)
_TERM_WEIGHT_RANGE = f"a finite number >= 0 and at most {MAX_TERM_WEIGHT:.4g}"  # formatted once: see _SCORE_EPS_RANGE


def _check_term_weight(name: str, value, term: str) -> float:
    value = _real(name, value, _TERM_WEIGHT_RANGE)
    if not 0 <= value <= MAX_TERM_WEIGHT:  # comparisons: see _check_finite_positive
        raise ValueError(f"{name} must be {_TERM_WEIGHT_RANGE} (the weight of {term}; larger weights overflow the "
                         f"float32 loss), got {value!r}")
    return value


def check_beta(beta) -> float:
    return _check_term_weight("beta", beta, "the mean k3 KL-to-reference term added to the loss")


def check_entropy_coef(entropy_coef) -> float:
    """The weight of the entropy bonus: a finite number >= 0 (a bonus; a negative weight, an
    entropy penalty, is refused rather than silently flipping the sign a trainer meant)."""
    return _check_term_weight("entropy_coef", entropy_coef, "the mean token entropy subtracted from the loss")


# ----------------------------------------------------------------------------- the settings records


@dataclass(frozen=True)
class CallFlags:
    """What a call returns beside its result, and whether its values are checked."""

    validate: bool = True
    return_aux: bool = False
    return_entropy: bool = False

    @property
    def returned_fields(self) -> Tuple[str, ...]:
        """The per-token fields of the row op a call returns (in aux, or beside the log-probs)."""
        return ("entropy",) if self.return_entropy else ()


def check_options(options, batch=None, temperature: Optional[float] = None):
    """``(RowRequest, GroupRule, LossWeights, CallFlags, batch)`` of a loss's settings (a
    :class:`tpo_kernels.requests.Options`), each checked and built once, in one pass; ``batch``
    (a :class:`tpo_kernels.requests.Batch`, or None for token-level TPO) comes back with its
    scalars checked (``beta`` joins the weights). ``temperature``: in place of the options' (1 for
    log-probs a trainer computed)."""
    eta = check_positive("eta", options.eta)
    inv_temperature = 1.0 / check_positive("temperature", options.temperature if temperature is None else temperature)
    scale, cap = check_logit_transform(options.logit_scale, options.logit_softcap, inv_temperature)
    anchor = check_flag("anchor", options.anchor)
    reduction = check_reduction(options.reduction)
    flags = CallFlags(return_aux=check_flag("return_aux", options.return_aux),
                      validate=check_flag("validate", options.validate),
                      return_entropy=check_flag("return_entropy", options.return_entropy))
    rule = GroupRule(eta=eta, anchor=anchor, score_eps=check_score_eps(options.score_eps),
                     length_normalize=check_flag("length_normalize", options.length_normalize))
    weights = LossWeights(reduction=reduction, entropy_coef=check_entropy_coef(options.entropy_coef))
    if batch is not None:
        batch = _check_batch_scalars(batch)
        weights = LossWeights(reduction=reduction, beta=batch.beta, entropy_coef=weights.entropy_coef)
    if flags.return_entropy and not flags.return_aux:
        raise ValueError("return_entropy=True puts the token entropy in aux['token_entropy']: pass return_aux=True too")
    # The entropy bonus reads the token entropy (and sends its gradient) through the row op's own
    # vocabulary pass: no second pass, no [tokens, vocab] tensor.
    needed = ("entropy",) if weights.entropy_coef > 0 else ()
    row = RowRequest(inv_temperature=inv_temperature, logit_scale=scale, logit_softcap=cap,
                     token_fields=tuple(sorted(set(flags.returned_fields + needed))))
    return row, rule, weights, flags, batch


def _check_batch_scalars(batch):
    """``batch`` with its scalar arguments checked (the tensors are checked with the batch)."""
    group_size = batch.group_size
    if group_size is not None and batch.group_ids is None:
        # An int64 (the ranks' agreement records carry it): a larger one can divide no batch.
        group_size = check_int("group_size", group_size, 1, INT64_MAX, "K contiguous completions per prompt")
    checked = {"group_size": group_size, "ignore_index": check_ignore_index(batch.ignore_index),
               "beta": check_beta(batch.beta)}
    if all(type(value) is type(getattr(batch, name)) and value == getattr(batch, name)  # noqa: E721
           for name, value in checked.items()):
        return batch  # already as checked (the defaults): no copy
    return dataclasses.replace(batch, **checked)


def check_row_options(options, ignore_index):
    """``(RowRequest, CallFlags, ignore_index)`` of the per-token log-probs' settings, checked: no
    group stage."""
    inv_temperature = 1.0 / check_positive("temperature", options.temperature)
    scale, cap = check_logit_transform(options.logit_scale, options.logit_softcap, inv_temperature)
    flags = CallFlags(validate=check_flag("validate", options.validate),
                      return_entropy=check_flag("return_entropy", options.return_entropy))
    row = RowRequest(inv_temperature=inv_temperature, logit_scale=scale, logit_softcap=cap,
                     token_fields=flags.returned_fields)
    return row, flags, check_ignore_index(ignore_index)


def check_tile_policy(tile_policy, policy_type: type) -> None:
    """None or a TilePolicy whose sizes the ops can take (int64; ``logits_cache_bytes`` is checked
    with the keyword of that name)."""
    if tile_policy is None:
        return
    if not isinstance(tile_policy, policy_type):
        raise TypeError(f"tile_policy must be a TilePolicy or None, got {_kind(tile_policy)}")
    for field in ("logits_bytes", "min_tile_tokens", "accum_bytes"):
        check_int(f"tile_policy.{field}", getattr(tile_policy, field), 0, INT64_MAX)
    if tile_policy.matmul_out_dtype is not None:
        check_flag("tile_policy.matmul_out_dtype", tile_policy.matmul_out_dtype)
    check_flag("tile_policy.batch_invariant", tile_policy.batch_invariant)


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


def check_batch_tensors(labels, scores, device: torch.device, input_name: str) -> None:
    """A sequence batch's labels (an integer tensor) and scores (a tensor) on ``device``: their
    metadata in one pass; their shapes and values are the batch's (:mod:`tpo_kernels.checks.batches`)."""
    check_integer_tensor("labels", labels, device, input_name)
    check_tensor("scores", scores, device, input_name)


def check_logits(logits, ndims: Tuple[int, ...] = (2, 3)) -> Tensor:
    check_float_tensor("logits", logits, ndims)
    reject_meta("logits", logits)
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    return logits


def check_logits_source(logits, inplace_backward) -> Tuple[Tensor, bool]:
    """``(logits, inplace_backward)`` of a :class:`tpo_kernels.requests.Logits` source, checked."""
    return check_logits(logits), check_flag("inplace_backward", inplace_backward)


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
        raise TypeError(f"chunk_size must be an int or None, got {_kind(chunk_size)}")
    # The ops take it as an int64: a larger one would fail inside the op, on one rank of a
    # distributed call while its peers wait in a collective. Here it fails the check pass.
    return check_int("chunk_size", chunk_size, 1, INT64_MAX, "a budget of chunk_size * V logits per tile")


def check_grad_accum_dtype(grad_accum_dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of dW and db, never narrower than the weight's own dtype."""
    if grad_accum_dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"grad_accum_dtype must be torch.float32, float64 or the weight dtype, got {grad_accum_dtype!r}"
        )
    return torch.promote_types(grad_accum_dtype, weight_dtype)


def check_head_dtype(head_dtype, inputs_dtype: torch.dtype) -> torch.dtype:
    """The dtype the fused head forms its logits in: None (the inputs'), float32 or float64, never
    narrower than the inputs' (``inputs_dtype``: hidden and weight promoted)."""
    if head_dtype is None:
        return inputs_dtype
    if not isinstance(head_dtype, torch.dtype):
        raise TypeError(f"head_dtype must be None, torch.float32 or torch.float64, got {_kind(head_dtype)}")
    if head_dtype not in (torch.float32, torch.float64) or torch.promote_types(head_dtype, inputs_dtype) != head_dtype:
        raise ValueError(f"head_dtype must be None, torch.float32 or torch.float64 and at least the inputs' "
                         f"{inputs_dtype}, got {head_dtype}")
    return head_dtype


def check_logits_cache(logits_cache_bytes, policy_bytes, vocab_parallel: bool) -> int:
    """The bytes of logits the fused head's forward may keep for its backward: an int >= 0 given
    as the keyword or on the tile policy (not both, unless equal); 0 with a vocabulary shard."""
    budgets = []
    for name, value in (("logits_cache_bytes", logits_cache_bytes), ("tile_policy.logits_cache_bytes", policy_bytes)):
        # a Python or NumPy integer, as every integer keyword; the ops take it as an int64
        budgets.append(check_int(name, value, 0, INT64_MAX, "bytes of logits the forward may keep for the backward"))
    logits_cache_bytes, policy_bytes = budgets
    if logits_cache_bytes and policy_bytes not in (0, logits_cache_bytes):
        raise ValueError(f"logits_cache_bytes={logits_cache_bytes} disagrees with "
                         f"tile_policy.logits_cache_bytes={policy_bytes}; give one of them")
    if (logits_cache_bytes or policy_bytes) and vocab_parallel:
        raise ValueError("logits_cache_bytes is not supported with a vocabulary-parallel head "
                         "(vocab_parallel_group / DTensor shards); pass 0")
    return logits_cache_bytes
