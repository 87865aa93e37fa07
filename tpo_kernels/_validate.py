"""Every input check of the public API, one copy each.

Checks run in Python before any kernel launch and raise ``ValueError`` / ``TypeError`` naming
the argument. Checks of metadata (types, shapes, dtypes, devices, hyper-parameters) are free;
checks of values (label ranges, finite scores, empty completions, cu_seqlens order) read a
result back from the device, so ``validate=False`` skips them (for compiled and CUDA-graph use,
where a host round trip is not allowed). With ``validate=False`` bad values give wrong results,
never out-of-bounds memory access: the native backends re-check ids at their pointer boundary.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ._dtypes import FLOAT_DTYPES
from .group_op import segment_sum
from .layout import BatchLayout, build_layout

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
    if not _is_real(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    if 1.0 / value > float(torch.finfo(torch.float32).max):
        raise ValueError(
            f"{name} must be at least {_MIN_POSITIVE:.4g} (its reciprocal must be finite in float32, "
            f"the precision the kernels take it in), got {value}"
        )
    return value


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
    if not math.isfinite(beta) or beta < 0:
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
    return beta


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


def check_settings(*, eta, anchor, temperature, reduction, return_aux, validate, return_entropy=False) -> LossSettings:
    settings = LossSettings(
        eta=check_positive("eta", eta),
        anchor=check_flag("anchor", anchor),
        inv_temperature=1.0 / check_positive("temperature", temperature),
        reduction=check_reduction(reduction),
        return_aux=check_flag("return_aux", return_aux),
        validate=check_flag("validate", validate),
        return_entropy=check_flag("return_entropy", return_entropy),
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
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() not in ndims:
        expected = " or ".join(f"{d}-D" for d in ndims)
        raise ValueError(f"{name} must be {expected}, got shape {tuple(x.shape)}")
    return x


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


def _check_label_values(labels: Tensor, counted: Tensor, vocab_size: int) -> None:
    """Counted label ids must lie in [0, vocab_size) (reads back from the device)."""
    bad = counted & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        found = labels[bad][0].item()
        raise ValueError(
            f"labels must hold ids in [0, {vocab_size}) or ignore_index at counted positions; found {found}"
        )


def prepare_labels(labels, token_shape, vocab_size: int, device: torch.device, input_name: str,
                   ignore_index, validate: bool, mask: Optional[Tensor] = None) -> Tensor:
    """Flat int64 ``[M]`` labels with -1 at the positions that do not count (``ignore_index``,
    or False in the flat bool ``mask``); counted ids are checked to lie in ``[0, vocab_size)``."""
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
        _check_label_values(flat, counted, vocab_size)
    return torch.where(counted, flat.to(torch.int64), -1).contiguous()


# ----------------------------------------------------------------------------- sequence batches


@dataclass
class PreparedBatch:
    token_shape: Tuple[int, ...]  # labels.shape: (N, T) padded or (M,) packed
    labels: Tensor  # [M] int64, -1 on rows that do not count (masked, ignore_index, outside)
    layout: BatchLayout
    scores: Tensor  # [N] float64
    old_seq_logprobs: Optional[Tensor]  # [N] float64, or None (on-policy)
    beta: float
    ref_logprobs: Optional[Tensor]  # [M] compute dtype, 0 where not counted; None when beta == 0

    @property
    def valid(self) -> Tensor:
        return self.labels >= 0


def _check_cu_seqlens(cu_seqlens, device: torch.device, num_tokens: int, input_name: str,
                      validate: bool) -> Tensor:
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    check_integer_dtype("cu_seqlens", cu_seqlens)
    reject_meta("cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int64)
    if validate:
        broken = (cu_seqlens[0] != 0) | (cu_seqlens[1:] < cu_seqlens[:-1]).any() | (cu_seqlens[-1] > num_tokens)
        if bool(broken):
            raise ValueError(
                f"cu_seqlens must start at 0, be non-decreasing and end at most at M={num_tokens} "
                f"(the rows of {input_name}); got {cu_seqlens.tolist()[:8]}..."
            )
    return cu_seqlens


def _check_groups(group_size, group_ids, num_seqs: int, device: torch.device, input_name: str) -> Optional[int]:
    """The checked ``group_size`` as a Python int (None with ``group_ids``)."""
    if (group_size is None) == (group_ids is None):
        raise ValueError("pass exactly one of group_size (K contiguous completions per prompt) or group_ids [N]")
    if group_size is not None:
        if not _is_int(group_size):
            raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
        group_size = int(group_size)
        if group_size < 1 or num_seqs % group_size != 0:
            raise ValueError(f"group_size must be >= 1 and divide the number of completions N={num_seqs}, got {group_size}")
        return group_size
    check_tensor("group_ids", group_ids, device, input_name)
    check_integer_dtype("group_ids", group_ids)
    if tuple(group_ids.shape) != (num_seqs,):
        raise ValueError(f"group_ids must have shape [N]=({num_seqs},), got {tuple(group_ids.shape)}")
    return None


def check_scores(scores, shape: Tuple[int, ...], device: torch.device, input_name: str,
                 acc: torch.dtype, validate: bool, what: str) -> Tensor:
    """Scores as float64 whatever ``acc``: the group math standardizes them in float64 (fp32 would
    lose spreads below ~1e-22 or above ~1e19, and float64 scores closer than fp32 resolution)."""
    check_tensor("scores", scores, device, input_name)
    if scores.dtype == torch.bool or scores.dtype.is_complex:
        raise TypeError(f"scores must be a real tensor, got {scores.dtype}")
    if tuple(scores.shape) != shape:
        raise ValueError(f"scores must have {what}, got {tuple(scores.shape)}")
    scores = scores.to(torch.float64).contiguous()
    if validate and not bool(torch.isfinite(scores).all()):
        raise ValueError("scores must be finite (found NaN or inf)")
    return scores


def _check_mask(mask, token_shape, device: torch.device, input_name: str, validate: bool) -> Tensor:
    check_tensor("mask", mask, device, input_name)
    if tuple(mask.shape) != token_shape:
        raise ValueError(f"mask must have the shape of labels {token_shape}, got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask.reshape(-1)
    if validate and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must hold only 0 and 1 (or be a bool tensor)")
    return mask.reshape(-1) != 0


def _check_float_values(name: str, x, device, input_name: str) -> None:
    check_tensor(name, x, device, input_name)
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a float tensor, got {x.dtype}")


def prepare_batch(
    token_shape: Tuple[int, ...],
    vocab_size: int,
    device: torch.device,
    acc: torch.dtype,
    labels,
    scores,
    *,
    group_size=None,
    group_ids=None,
    cu_seqlens=None,
    mask=None,
    ignore_index=-100,
    old_logprobs=None,
    ref_logprobs=None,
    beta=0.0,
    input_name: str = "logits",
    validate: bool = True,
) -> PreparedBatch:
    """Check a sequence-level batch and describe it as flat ``[M]`` rows plus a layout."""
    token_shape = tuple(token_shape)
    if len(token_shape) == 2:
        if cu_seqlens is not None:
            raise ValueError(
                f"cu_seqlens is for packed inputs ({input_name} [M, ...], labels [M]); got padded labels {token_shape}"
            )
        num_seqs, num_tokens = token_shape[0], token_shape[0] * token_shape[1]
    elif len(token_shape) == 1:
        if cu_seqlens is None:
            raise ValueError(
                f"packed inputs ({input_name} [M, ...], labels [M]) need cu_seqlens [N+1]; "
                "for padded inputs pass labels of shape [N, T]"
            )
        num_tokens = token_shape[0]
        cu_seqlens = _check_cu_seqlens(cu_seqlens, device, num_tokens, input_name, validate)
        num_seqs = cu_seqlens.numel() - 1
    else:
        raise ValueError(f"labels must be [N, T] (padded) or [M] (packed), got shape {token_shape}")
    if num_seqs == 0:
        raise ValueError("the batch holds no completion (N == 0)")
    group_size = _check_groups(group_size, group_ids, num_seqs, device, input_name)
    layout = build_layout(
        num_tokens,
        device,
        padded_shape=token_shape if len(token_shape) == 2 else None,
        cu_seqlens=cu_seqlens,
        group_size=group_size,
        group_ids=group_ids,
    )
    counted = layout.token_seq >= 0
    if mask is not None:
        counted = counted & _check_mask(mask, token_shape, device, input_name, validate)
    flat_labels = prepare_labels(labels, token_shape, vocab_size, device, input_name, ignore_index, validate,
                                 mask=counted)
    scores = check_scores(scores, (num_seqs,), device, input_name, acc, validate, f"shape [N]=({num_seqs},)")
    valid = flat_labels >= 0
    if validate:
        # Completions with no counted token (e.g. truncated and masked) are left out of their group.
        counted_seqs = segment_sum(valid.to(torch.int64), layout) > 0
        if not bool(counted_seqs.any()):
            raise ValueError("no completion has a counted token (all masked or ignore_index)")
        if not bool(counted_seqs.all()):
            layout = build_layout(
                num_tokens, device, padded_shape=token_shape if len(token_shape) == 2 else None,
                cu_seqlens=cu_seqlens, group_size=group_size, group_ids=group_ids, members=counted_seqs,
            )

    # Old log-probs: per token (shape of labels, summed over counted tokens) or per completion,
    # in float64 like the group math (sums over long completions lose digits in fp32).
    old_seq = None
    if old_logprobs is not None:
        _check_float_values("old_logprobs", old_logprobs, device, input_name)
        if tuple(old_logprobs.shape) == token_shape:
            old_seq = segment_sum(torch.where(valid, old_logprobs.reshape(-1).to(torch.float64), 0.0), layout)
        elif tuple(old_logprobs.shape) == (num_seqs,):
            old_seq = old_logprobs.to(torch.float64).contiguous()
        else:
            raise ValueError(
                f"old_logprobs must be per token {token_shape} or per completion ({num_seqs},), got {tuple(old_logprobs.shape)}"
            )
        if validate and not bool(torch.isfinite(old_seq).all()):
            raise ValueError("old_logprobs must be finite at counted tokens")

    # KL-to-reference (k3) term.
    beta = check_beta(beta)
    ref_flat = None
    if beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs (per-token log-probs under the reference policy)")
        _check_float_values("ref_logprobs", ref_logprobs, device, input_name)
        if tuple(ref_logprobs.shape) != token_shape:
            raise ValueError(f"ref_logprobs must have the shape of labels {token_shape}, got {tuple(ref_logprobs.shape)}")
        ref_flat = torch.where(valid, ref_logprobs.reshape(-1).to(acc), 0.0)
        if validate and not bool(torch.isfinite(ref_flat).all()):
            raise ValueError("ref_logprobs must be finite at counted tokens")

    return PreparedBatch(token_shape, flat_labels, layout, scores, old_seq, beta, ref_flat)


# ----------------------------------------------------------------------------- candidates


def prepare_candidates(num_states: int, vocab_size: int, device: torch.device, acc: torch.dtype,
                       candidates, scores, old_logprobs, input_name: str, validate: bool):
    """Checked token-level inputs: ``(candidates int64 [R, K], scores, old_logprobs | None)``,
    the float ones in float64 (the group math's dtype)."""
    if num_states == 0:
        raise ValueError(f"{input_name} holds no state (R == 0)")
    check_tensor("candidates", candidates, device, input_name)
    check_integer_dtype("candidates", candidates)
    if candidates.dim() != 2 or candidates.shape[0] != num_states or candidates.shape[1] == 0:
        raise ValueError(
            f"candidates must have shape [R, K] with R={num_states} (the rows of {input_name}) and "
            f"K >= 1, got {tuple(candidates.shape)}"
        )
    shape = tuple(candidates.shape)
    if validate:
        out_of_range = (candidates < 0) | (candidates >= vocab_size)
        if bool(out_of_range.any()):
            found = candidates[out_of_range][0].item()
            raise ValueError(f"candidates must hold token ids in [0, {vocab_size}); found {found}")
    scores = check_scores(scores, shape, device, input_name, acc, validate, f"the shape of candidates {shape}")
    if old_logprobs is not None:
        _check_float_values("old_logprobs", old_logprobs, device, input_name)
        if tuple(old_logprobs.shape) != shape:
            raise ValueError(
                f"old_logprobs must have the shape of candidates {shape}, got {tuple(old_logprobs.shape)}"
            )
        old_logprobs = old_logprobs.to(torch.float64).contiguous()  # for the float64 group math
        if validate and not bool(torch.isfinite(old_logprobs).all()):
            raise ValueError("old_logprobs must be finite (found NaN or inf)")
    return candidates.to(torch.int64).contiguous(), scores, old_logprobs
