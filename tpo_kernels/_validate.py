"""Input validation and normalization, done once in Python before any kernel launch.

Every public entry point funnels its batch description through :func:`prepare_batch`, which
checks shapes, dtypes, devices and value ranges (raising ValueError/TypeError that names the
argument) and returns flat tensors plus the :class:`~tpo_kernels.layout.BatchLayout`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from .layout import BatchLayout, build_layout
from .targets import segment_sum

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
REDUCTIONS = ("mean", "sum", "none")


@dataclass
class PreparedBatch:
    token_shape: Tuple[int, ...]  # labels.shape: (N, T) padded or (M,) packed
    labels: Tensor  # [M] int64, -1 on rows that do not count (masked, ignore_index, outside)
    valid: Tensor  # [M] bool
    num_valid: int
    layout: BatchLayout
    scores: Tensor  # [N] compute dtype
    old_seq_logprobs: Optional[Tensor]  # [N] or None (on-policy)
    ref_logprobs: Optional[Tensor]  # [M] compute dtype or None


def check_float_tensor(name: str, x, ndims: Tuple[int, ...]) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() not in ndims:
        expected = " or ".join(f"{d}-D" for d in ndims)
        raise ValueError(f"{name} must be {expected}, got shape {tuple(x.shape)}")


def check_positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_same_device(name: str, x: Tensor, device: torch.device, reference: str) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but {reference} is on {device}")


def check_reduction(reduction) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def _check_tensor(name: str, x, device: torch.device) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the logits are on {device}")
    return x


def _check_integer(name: str, x: Tensor) -> None:
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")


def check_labels(name: str, labels: Tensor, valid: Tensor, vocab_size: int) -> None:
    """Counted label ids must lie in [0, vocab_size)."""
    counted = labels[valid]
    if counted.numel() and bool(((counted < 0) | (counted >= vocab_size)).any()):
        bad = counted[(counted < 0) | (counted >= vocab_size)][0].item()
        raise ValueError(
            f"{name} must hold ids in [0, {vocab_size}) or ignore_index at counted positions; found {bad}"
        )


def prepare_batch(
    token_shape: Tuple[int, ...],
    vocab_size: int,
    device: torch.device,
    compute_dtype: torch.dtype,
    labels,
    scores,
    *,
    group_size=None,
    group_ids=None,
    cu_seqlens=None,
    mask=None,
    ignore_index: int = -100,
    old_logprobs=None,
    ref_logprobs=None,
    beta: float = 0.0,
    input_name: str = "logits",
) -> PreparedBatch:
    token_shape = tuple(token_shape)
    labels = _check_tensor("labels", labels, device)
    _check_integer("labels", labels)
    if tuple(labels.shape) != token_shape:
        raise ValueError(
            f"labels must have shape {token_shape} (the leading dims of {input_name}), got {tuple(labels.shape)}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")

    # Padded [N, T] or packed [M] + cu_seqlens.
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
        if not isinstance(cu_seqlens, Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        _check_integer("cu_seqlens", cu_seqlens)
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with N+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int64)
        num_tokens = token_shape[0]
        if int(cu_seqlens[0]) != 0 or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()) or int(cu_seqlens[-1]) > num_tokens:
            raise ValueError(
                f"cu_seqlens must start at 0, be non-decreasing and end at most at M={num_tokens}; got {cu_seqlens.tolist()[:8]}..."
            )
        num_seqs = cu_seqlens.numel() - 1
    else:
        raise ValueError(f"labels must be [N, T] (padded) or [M] (packed), got shape {token_shape}")
    if num_seqs == 0:
        raise ValueError("the batch holds no completion (N == 0)")

    # Groups: exactly one of group_size / group_ids.
    if (group_size is None) == (group_ids is None):
        raise ValueError("pass exactly one of group_size (K contiguous completions per prompt) or group_ids [N]")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
        if group_size < 1 or num_seqs % group_size != 0:
            raise ValueError(f"group_size must be >= 1 and divide the number of completions N={num_seqs}, got {group_size}")
    else:
        group_ids = _check_tensor("group_ids", group_ids, device)
        _check_integer("group_ids", group_ids)
        if tuple(group_ids.shape) != (num_seqs,):
            raise ValueError(f"group_ids must have shape [N]=({num_seqs},), got {tuple(group_ids.shape)}")

    # Scores: [N], finite.
    scores = _check_tensor("scores", scores, device)
    if scores.dtype == torch.bool or scores.dtype.is_complex:
        raise TypeError(f"scores must be a real tensor, got {scores.dtype}")
    if tuple(scores.shape) != (num_seqs,):
        raise ValueError(f"scores must have shape [N]=({num_seqs},), got {tuple(scores.shape)}")
    scores = scores.to(compute_dtype)
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("scores must be finite (found NaN or inf)")

    # Which rows count: not ignore_index, inside the mask, inside a completion.
    valid = labels != ignore_index
    if mask is not None:
        mask = _check_tensor("mask", mask, device)
        if tuple(mask.shape) != token_shape:
            raise ValueError(f"mask must have the shape of labels {token_shape}, got {tuple(mask.shape)}")
        if mask.dtype != torch.bool:
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError("mask must hold only 0 and 1 (or be a bool tensor)")
            mask = mask != 0
        valid = valid & mask
    valid = valid.reshape(-1)
    layout = build_layout(
        num_tokens,
        device,
        padded_shape=token_shape if len(token_shape) == 2 else None,
        cu_seqlens=cu_seqlens,
        group_size=group_size,
        group_ids=group_ids,
    )
    valid = valid & (layout.token_seq >= 0)
    labels_flat = labels.reshape(-1)
    check_labels("labels", labels_flat, valid, vocab_size)
    counts = segment_sum(valid.to(torch.int64), layout)
    if bool((counts == 0).any()):
        empty = int(torch.nonzero(counts == 0)[0])
        raise ValueError(
            f"completion {empty} has no counted token (all masked or ignore_index); drop it or unmask a token"
        )
    labels_flat = torch.where(valid, labels_flat.to(torch.int64), -1)

    # Old log-probs: per token (shape of labels, summed under the mask) or per sequence [N].
    old_seq = None
    if old_logprobs is not None:
        old_logprobs = _check_tensor("old_logprobs", old_logprobs, device)
        if not old_logprobs.dtype.is_floating_point:
            raise TypeError(f"old_logprobs must be a float tensor, got {old_logprobs.dtype}")
        if tuple(old_logprobs.shape) == token_shape:
            old_tokens = torch.where(valid, old_logprobs.reshape(-1).to(compute_dtype), 0.0)
            old_seq = segment_sum(old_tokens, layout)
        elif tuple(old_logprobs.shape) == (num_seqs,):
            old_seq = old_logprobs.to(compute_dtype)
        else:
            raise ValueError(
                f"old_logprobs must be per token {token_shape} or per completion ({num_seqs},), got {tuple(old_logprobs.shape)}"
            )
        if not bool(torch.isfinite(old_seq).all()):
            raise ValueError("old_logprobs must be finite at counted tokens")

    # KL-to-reference (k3) term.
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
    ref_flat = None
    if beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs (per-token log-probs under the reference policy)")
        ref_logprobs = _check_tensor("ref_logprobs", ref_logprobs, device)
        if tuple(ref_logprobs.shape) != token_shape:
            raise ValueError(f"ref_logprobs must have the shape of labels {token_shape}, got {tuple(ref_logprobs.shape)}")
        if not ref_logprobs.dtype.is_floating_point:
            raise TypeError(f"ref_logprobs must be a float tensor, got {ref_logprobs.dtype}")
        ref_flat = torch.where(valid, ref_logprobs.reshape(-1).to(compute_dtype), 0.0)
        if not bool(torch.isfinite(ref_flat).all()):
            raise ValueError("ref_logprobs must be finite at counted tokens")

    return PreparedBatch(
        token_shape=token_shape,
        labels=labels_flat.contiguous(),
        valid=valid,
        num_valid=int(valid.sum()),
        layout=layout,
        scores=scores,
        old_seq_logprobs=old_seq,
        ref_logprobs=ref_flat,
    )
