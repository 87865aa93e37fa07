"""Checks of tensor arguments (types, shapes, dtypes, devices; labels), the value checks read
back once per call, and the checks of where a call's data lives (process groups, vocabulary
shards, DTensor placements, a batch split over ranks)."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .._dtypes import FLOAT_DTYPES
from .arguments import _is_int, check_ignore_index


# ----------------------------------------------------------------------------- value checks

# Value checks read back from the device together, once per call.
#
# A check of values (label ranges, finite scores, ...) needs its result on the host to raise an
# error, and every read-back makes the host wait for the device. The value checks of one call are
# therefore computed on the device as 0-d bool tensors, stacked and read back with one
# ``tolist()``; only when a check fails is more read, to word its error.


class ValueChecks:
    """Conditions gathered during a call and read back by :meth:`read`, in the order added."""

    def __init__(self) -> None:
        self._conditions: List[Tensor] = []
        self._errors: List[Optional[Callable[[], Exception]]] = []

    def require(self, holds: Tensor, error: Callable[[], Exception]) -> None:
        """At :meth:`read`, raise ``error()`` unless the 0-d bool ``holds`` is True."""
        self._conditions.append(holds)
        self._errors.append(error)

    def observe(self, value: Tensor) -> int:
        """Read the 0-d bool ``value`` back with the checks; returns its index in :meth:`read`."""
        self._conditions.append(value)
        self._errors.append(None)
        return len(self._conditions) - 1

    def read(self) -> List[bool]:
        """One read-back of every condition; raises the error of the first that fails."""
        if not self._conditions:
            return []
        values = torch.stack([c.reshape(()) for c in self._conditions]).tolist()
        for holds, error in zip(values, self._errors):
            if error is not None and not holds:
                raise error()
        return values


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


# ----------------------------------------------------------------------------- placement

# Checks of where a call's data lives: process groups, vocabulary shards, DTensor placements,
# and the checks of a batch split over ranks that only the ranks' agreed sizes can decide (every
# rank raises the same error, since every rank decides from the same gathered records).


def check_group(name: str, group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name} needs torch.distributed initialized (init_process_group)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")


def check_vocab_start_index(start, group) -> Optional[int]:
    if start is None:
        return None
    if group is None:
        raise ValueError("vocab_start_index needs vocab_parallel_group")
    if not _is_int(start) or int(start) < 0:
        raise ValueError(f"vocab_start_index must be an int >= 0 or None, got {start!r}")
    return int(start)


def check_shard_size(name: str, x, dim: int) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[dim] == 0:
        raise ValueError(f"{name} must hold at least one vocabulary entry on every rank")


def check_dtensor_vocab(name: str, dim: int, placements, sharded: List[int], others_replicated: bool) -> None:
    if len(sharded) != 1 or not others_replicated:
        raise ValueError(
            f"{name} as a DTensor must be sharded on the vocabulary (dim {dim}) over one mesh dimension and "
            f"replicated on the others, got placements {placements}"
        )


def check_dtensor_shard(name: str, group, mesh_group, start: Optional[int], shard_start: int, local_size: int,
                        expected_size: int, vocab: int, world: int) -> None:
    if group is not None and group is not mesh_group:
        raise ValueError(f"vocab_parallel_group differs from the mesh dimension {name} is sharded over")
    if local_size != expected_size:
        raise ValueError(f"{name}: unexpected DTensor shard size {local_size} for {vocab} ids over {world} ranks")
    if start is not None and start != shard_start:
        raise ValueError(f"vocab_start_index={start} but {name}'s DTensor shard starts at {shard_start}")


def check_replicated(name: str, placements, replicated: bool) -> None:
    if not replicated:
        raise ValueError(f"{name} as a DTensor must be replicated (the tokens of every vocabulary shard), "
                         f"got placements {placements}")


def check_bias_shard(bias_span: Tuple[int, int], weight_span: Tuple[int, int]) -> None:
    if bias_span != weight_span:
        raise ValueError("bias must be sharded on the vocabulary like weight")


def check_shard_tiling(sizes: Sequence[int], starts: Sequence[int]) -> List[int]:
    """Every rank's shard start (given on every rank or on none: -1), such that the shards tile
    ``[0, V)``; in rank order when not given."""
    if any((s == -1) != (starts[0] == -1) for s in starts):
        raise ValueError("vocab_start_index must be given on every rank of vocab_parallel_group or on none")
    if starts[0] == -1:
        starts = [sum(sizes[:r]) for r in range(len(sizes))]
    spans = sorted(zip(starts, sizes))
    vocab = sum(sizes)
    if [s for s, _ in spans] != [sum(n for _, n in spans[:i]) for i in range(len(spans))]:
        raise ValueError(f"vocabulary shards (start, size) must tile [0, {vocab}) without gaps or overlap, got {spans}")
    return list(starts)


def check_groups_apart(vocab_group, process_group) -> None:
    """Ranks splitting the batch hold different tokens, so they cannot also split one token's
    vocabulary: the two groups must differ (a 2-D mesh)."""
    if list(dist.get_process_group_ranks(vocab_group)) == list(dist.get_process_group_ranks(process_group)):
        raise ValueError(
            "the vocabulary is sharded over the ranks of process_group, which hold different completions; "
            "use a tensor-parallel group for the vocabulary (for FSDP2, call the loss inside the wrapped "
            "module's forward, where the lm_head weight is unsharded)"
        )


def check_split_batch(sizes: Sequence[int], group_size: Optional[int], any_kept: Sequence[int], validate: bool,
                      what: str = "completion") -> None:
    """The batch over all ranks of process_group: not empty, ``group_size`` dividing it, and (with
    ``validate``) some completion with a counted token."""
    total = sum(sizes)
    if total == 0:
        raise ValueError(f"the batch holds no {what} on any rank of process_group (N == 0)")
    if group_size is not None and total % group_size != 0:
        raise ValueError(f"group_size must divide the number of completions over all ranks, N={total} "
                         f"(per rank {list(sizes)}), got {group_size}")
    if validate and not any(any_kept):
        raise ValueError("no completion on any rank of process_group has a counted token "
                         "(all masked or ignore_index)")


def check_labels_below(flat_labels: Tensor, vocab_size: int, validate: bool) -> None:
    """Counted labels (``>= 0``) below the vocabulary size, once a sharded vocabulary's size is
    known (one read-back)."""
    if validate and bool((flat_labels >= vocab_size).any()):
        found = flat_labels[flat_labels >= vocab_size][0].item()
        raise ValueError(f"labels must hold ids in [0, {vocab_size}) or ignore_index at counted positions; "
                         f"found {found}")


def fingerprint(x: Tensor) -> Tensor:
    """A 0-d int64 checksum of an integer tensor, position-weighted, computed on its device."""
    flat = x.reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 1_000_003 + 1
    return (flat * weights).sum() + flat.numel()
