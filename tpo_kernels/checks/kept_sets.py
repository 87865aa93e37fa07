"""The checks of ``sampling_mask=`` (kept-set replay) and the one place that builds a
:class:`~tpo_kernels.backends.kept_sets.KeptSets` from it.

A call checks the mask in two steps, because which tokens count depends on it and the labels'
checks depend on which tokens count:

1. :func:`check_sampling_mask` (metadata only: form, integer dtype, device, shapes) gives a
   :class:`CheckedMask` whose ``nonempty [M]`` says which tokens have a set: the others do not
   count (the labels' mask is ANDed with it);
2. :meth:`CheckedMask.build` takes the flat labels (-1 where not counted) and gives the kept
   sets, adding its value checks to the call's :class:`~tpo_kernels.checks.batches.ValueChecks`
   (read back with the others: no read-back of its own): offsets from 0 to P without
   decreasing, ids in ``[0, V)`` (padded: or negative), no id twice in a set, and every counted
   token's label in its set. With a vocabulary shard the ids are global (the whole vocabulary's,
   the same on every rank): the upper bound is checked once the shards are placed
   (:func:`check_ids_below`), and every rank checks the labels against the same sets.

The pairs' rows are found by a binary search of the offsets instead of ``repeat_interleave`` of
the counts: the search gives a row for any offsets, so malformed ones reach the value check (a
ValueError) instead of failing inside the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backends.kept_sets import LABEL_OUTSIDE, KeptSets, label_slots
from .arguments import check_integer_dtype, check_tensor

NAME = "sampling_mask"


@dataclass(frozen=True)
class CheckedMask:
    """A mask whose metadata is checked: the CSR ``(ids, offsets)`` or the padded ``[M, S]`` ids."""

    ids: Tensor  # CSR: [P]; padded: [M, S]
    offsets: Optional[Tensor]  # CSR: [M + 1]; padded: None
    nonempty: Tensor  # [M] bool: the token has a kept set

    def build(self, flat_labels: Tensor, vocab_size: Optional[int], checks) -> KeptSets:
        """The kept sets of the tokens with ``flat_labels >= 0``; with ``checks`` (validate=True)
        the value checks are added to it (see the module docstring)."""
        if self.offsets is None:
            width = self.ids.shape[-1]
            sets = KeptSets.from_padded(self.ids, flat_labels)
            ids = sets.ids
        else:
            width, ids = None, self.ids.to(torch.int64)
            offsets = self.offsets.to(torch.int64)
            pair_index = torch.arange(ids.numel(), device=ids.device)
            rows = torch.searchsorted(offsets[1:], pair_index, right=True).clamp(max=max(flat_labels.numel() - 1, 0))
            counts = offsets[1:] - offsets[:-1]
            sets = KeptSets(ids=ids, offsets=offsets, rows=rows,
                            label_slot=label_slots(ids, rows, flat_labels, counts))
        if checks is not None:
            _require_values(checks, sets, width, vocab_size, flat_labels)
        return sets


def check_sampling_mask(mask, token_shape: Tuple[int, ...], device: torch.device,
                        input_name: str) -> Optional[CheckedMask]:
    """The metadata checks of ``sampling_mask`` (None: no mask) for labels of ``token_shape``."""
    if mask is None:
        return None
    from ..requests import SamplingMask  # noqa: PLC0415 - requests imports ops; checks stay below it

    num_tokens = 1
    for size in token_shape:
        num_tokens *= size
    if isinstance(mask, SamplingMask):
        mask = (mask.token_ids, mask.offsets)
    if isinstance(mask, tuple):
        if len(mask) != 2:
            raise ValueError(f"{NAME} as a tuple must be (token_ids, offsets), got {len(mask)} items")
        ids, offsets = mask
        for name, x in ((f"{NAME}.token_ids", ids), (f"{NAME}.offsets", offsets)):
            check_tensor(name, x, device, input_name)
            check_integer_dtype(name, x)
            if x.dim() != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        if offsets.numel() != num_tokens + 1:
            raise ValueError(f"{NAME}.offsets must have M + 1 = {num_tokens + 1} entries (M = labels.numel(), "
                             f"every token of the call), got {offsets.numel()}")
        nonempty = (offsets[1:] - offsets[:-1]) > 0
        return CheckedMask(ids=ids, offsets=offsets, nonempty=nonempty)
    if not isinstance(mask, Tensor):
        raise TypeError(f"{NAME} must be a tpo_kernels.SamplingMask, a (token_ids, offsets) tuple or an int "
                        f"tensor [*labels.shape, S], got {type(mask).__name__}")
    check_tensor(NAME, mask, device, input_name)
    check_integer_dtype(NAME, mask)
    if mask.dim() != len(token_shape) + 1 or tuple(mask.shape[:-1]) != tuple(token_shape):
        raise ValueError(f"{NAME} as a padded tensor must have shape [*labels.shape, S] = "
                         f"[{', '.join(map(str, token_shape))}, S], got {tuple(mask.shape)}")
    ids = mask.reshape(num_tokens, mask.shape[-1])
    return CheckedMask(ids=ids, offsets=None, nonempty=(ids >= 0).any(-1))


def check_ids_below(sets: Optional[KeptSets], vocab_size: int, validate: bool) -> None:
    """The kept ids below the vocabulary size, once a sharded vocabulary's size is known (the
    mask holds global ids, the same on every rank: so is this verdict; one read-back)."""
    if validate and sets is not None and bool((sets.ids >= vocab_size).any()):
        found = sets.ids[sets.ids >= vocab_size][0].item()
        raise ValueError(f"{NAME} must hold token ids in [0, {vocab_size}) (global ids of the whole vocabulary, "
                         f"the same on every rank of vocab_parallel_group); found {found}")


def _require_values(checks, sets: KeptSets, width: Optional[int], vocab_size: Optional[int],
                    flat_labels: Tensor) -> None:
    ids, offsets = sets.ids, sets.offsets
    if width is None:  # CSR: offsets from 0 to P, non-decreasing; ids in [0, V)
        num_pairs = ids.numel()
        well_formed = (offsets[0] == 0) & (offsets[-1] == num_pairs) & (offsets[1:] >= offsets[:-1]).all()
        checks.require(well_formed, lambda: ValueError(
            f"{NAME}.offsets must run from 0 to len(token_ids) = {num_pairs} without decreasing"))
        low = ids < 0
    else:  # padded: a negative id is no entry
        low = torch.zeros_like(ids, dtype=torch.bool)
    bad = low | (ids >= vocab_size) if vocab_size is not None else low
    checks.require(~bad.any(), lambda: ValueError(
        f"{NAME} must hold token ids in [0, {vocab_size})" + ("" if width is None else " (or negative: none)")
        + f"; found {ids[bad][0].item()}"))
    # No id twice in a set: one sort of (row, id) keys; holes get distinct negative keys.
    vocab = int(vocab_size) if vocab_size is not None else 1 << 40
    keys = torch.where(ids >= 0, sets.rows * vocab + ids.clamp(max=vocab - 1),
                       -1 - torch.arange(ids.numel(), device=ids.device))
    ordered = keys.sort().values
    checks.require(~(ordered[1:] == ordered[:-1]).any(), lambda: ValueError(
        f"{NAME} holds an id twice in one token's kept set; a kept set is a set"))
    outside = sets.label_slot == LABEL_OUTSIDE
    checks.require(~outside.any(), lambda: _label_outside_error(flat_labels, outside))


def _label_outside_error(flat_labels: Tensor, outside: Tensor) -> ValueError:
    token = int(outside.nonzero()[0, 0])  # on the error path only
    return ValueError(f"{NAME}: the label of token {token} (flat row-major index; id {int(flat_labels[token])}) "
                      f"is not in its kept set; a kept set must hold the token sampled from it")


__all__ = ["CheckedMask", "check_ids_below", "check_sampling_mask"]
