"""Checks of where a call's data lives: process groups, vocabulary shards, DTensor placements,
and the checks of a batch split over ranks that only the ranks' agreed sizes can decide (every
rank raises the same error, since every rank decides from the same gathered records). Entered
only by a call with a process group, a vocabulary group or a DTensor."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .arguments import INT64_MAX, check_int


def check_group(name: str, group) -> None:
    # What it is first (a wrong value is the caller's error whatever the state of torch.distributed),
    # saying what is missing when no group can exist yet; then whether a real group can run.
    ready = dist.is_available() and dist.is_initialized()
    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        missing = "" if ready else " (and torch.distributed is not initialized: init_process_group creates the groups)"
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}{missing}")
    if not ready:
        raise RuntimeError(f"{name} needs torch.distributed initialized (init_process_group)")


def check_vocab_start_index(start, group) -> Optional[int]:
    if start is None:
        return None
    if group is None:
        raise ValueError("vocab_start_index needs vocab_parallel_group")
    # an int64: the ranks' agreement records carry it
    return check_int("vocab_start_index", start, 0, INT64_MAX, "the first vocabulary id of this rank's shard")


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


# Two groups of one call that must not hold the same ranks, and why, by (group, group): ranks
# that split the batch hold different tokens, so they cannot also split one token's vocabulary,
# nor hold the same completions' other positions.
_APART = {
    ("vocab_parallel_group", "process_group"): (
        "the vocabulary is sharded over the ranks of process_group, which hold different completions; "
        "use a tensor-parallel group for the vocabulary (for FSDP2, call the loss inside the wrapped "
        "module's forward, where the lm_head weight is unsharded)"),
    ("context_parallel_group", "process_group"): (
        "context_parallel_group and process_group hold the same ranks: the ranks of process_group hold "
        "different completions, those of context_parallel_group other positions of the same completions; "
        "pass each dimension of the mesh as its own group (mesh.get_group(\"cp\") and mesh.get_group(\"dp\"))"),
    ("context_parallel_group", "vocab_parallel_group"): (
        "context_parallel_group and vocab_parallel_group hold the same ranks: the ranks of vocab_parallel_group "
        "hold the same tokens and split their vocabulary, those of context_parallel_group different positions; "
        "pass each dimension of the mesh as its own group (mesh.get_group(\"cp\") and mesh.get_group(\"tp\"))"),
}


def check_distinct_groups(groups: Dict[str, object]) -> None:
    """The call's groups by keyword (None: absent, or of one rank): no two of those that split
    different things hold the same ranks (a mesh gives each of its dimensions a group)."""
    present = {name: group for name, group in groups.items() if group is not None}
    if len(present) < 2:
        return
    ranks = {name: list(dist.get_process_group_ranks(group)) for name, group in present.items()}
    for (first, second), message in _APART.items():
        if first in ranks and second in ranks and ranks[first] == ranks[second]:
            raise ValueError(message)


def check_context_batch(any_counted: bool, validate: bool) -> None:
    """Completions split over context-parallel ranks (and not over data-parallel ones): with
    ``validate``, some completion has a counted token on some rank (``any_counted``: agreed)."""
    if validate and not any_counted:
        raise ValueError("no completion has a counted token on any rank of context_parallel_group "
                         "(all masked or ignore_index)")


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
