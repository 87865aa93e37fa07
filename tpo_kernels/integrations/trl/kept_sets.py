"""The kept sets of a truncating sampler (top-k, top-p, min-p, any logits processor that sets
scores to -inf), recorded during transformers generation and replayed by the loss.

A truncating sampler draws each token from the tempered softmax renormalized over its kept set S
(the finite entries of the processed scores); training on full-vocabulary log-probs would fit
another distribution than the one sampled. :class:`KeptSetRecorder`, appended as the *last* logits
processor of ``generate`` (:func:`install_kept_set_recorder`), keeps each step's finite support as
compact ``(row, id)`` pairs (nothing when every row keeps the whole vocabulary); after generation
:func:`kept_set_rows` turns them into two per-row tensors that move with the rows of TRL's batch
like any other (shuffles, micro-batch splits, gathers over processes):

* ``tpo_kept_ids [N, P]`` int32: row ``n``'s kept ids, token after token, then ``-1`` padding
  (``P`` the largest per-row total, the sum of the row's set sizes);
* ``tpo_kept_counts [N, C]`` int32: each token's set size, 0 for a token that does not count
  (after EOS, padding, a completion TRL masks).

:func:`sampling_mask_of` makes the loss call's :class:`tpo_kernels.SamplingMask` (a CSR over the
call's tokens, row-major) from them. No recorded truncation: no keys, no mask.
"""

from __future__ import annotations

import functools
import types
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ... import SamplingMask

KEPT_IDS, KEPT_COUNTS = "tpo_kept_ids", "tpo_kept_counts"
# TRL's "no truncation" values of its config fields (vLLM also reads top_k=-1 as none).
_NO_TOP_K = (None, 0, -1)


def truncating_settings(args) -> List[str]:
    """The sampling settings of a GRPOConfig that truncate the vocabulary (``generation_kwargs``
    overriding the fields, as TRL lets it), as ``"name=value"``; empty when none does."""
    values = {"top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    extra = args.generation_kwargs
    if isinstance(extra, dict):
        values.update({name: extra[name] for name in values if name in extra})
    found = []
    if values["top_p"] is not None and values["top_p"] < 1.0:
        found.append(f"top_p={values['top_p']}")
    if values["top_k"] not in _NO_TOP_K:
        found.append(f"top_k={values['top_k']}")
    if values["min_p"] not in (None, 0, 0.0):
        found.append(f"min_p={values['min_p']}")
    return found


class KeptSetRecorder:
    """A transformers ``LogitsProcessor`` that records the finite support of the scores it is
    given, step after step, and returns them unchanged (sampling is untouched). One generation per
    recorder: a second ``generate`` call while it is active is an error (rows could not be matched)."""

    def __init__(self):
        self.steps: List[Optional[Tensor]] = []  # per step: None (every row keeps all), or [P, 2] (row, id)
        self.vocab_size: Optional[int] = None
        self.generations = 0

    def start(self) -> "KeptSetRecorder":
        self.generations += 1
        if self.generations > 1:
            raise RuntimeError("the kept-set recorder saw a second generate() call in one generation batch; "
                               "TargetPOTrainer records the kept sets of one transformers generation per batch")
        return self

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        finite = torch.isfinite(scores)
        self.vocab_size = scores.shape[-1]
        # Read-backs per step: one (all kept), two on a truncating step (the check, then nonzero's
        # size); transformers' sampling loop already waits for one per step (its stopping check).
        self.steps.append(None if bool(finite.all()) else finite.nonzero().to(torch.int32))
        return scores

    def truncated(self) -> bool:
        """True when some step left some row less than the whole vocabulary."""
        return any(step is not None for step in self.steps)


class RecorderSlot:
    """Where the patched ``_get_logits_processor`` finds the active recorder (None: none)."""

    recorder: Optional[KeptSetRecorder] = None


def install_kept_set_recorder(model) -> RecorderSlot:
    """Patch ``model._get_logits_processor`` (transformers' builder of ``generate``'s processor
    list; checked in :mod:`.private_api`) to append the slot's recorder, when one is set, after
    every other processor and warper: ``generate(logits_processor=...)`` would place it before
    the temperature / top-k / top-p warpers. Idempotent; returns the model's slot."""
    slot = getattr(model, "_tpo_recorder_slot", None)
    if slot is not None:
        return slot
    slot = RecorderSlot()
    previous = model._get_logits_processor

    @functools.wraps(previous)
    def get_logits_processor(self, *args, **kwargs):
        processors = previous(*args, **kwargs)
        if slot.recorder is not None:
            processors.append(slot.recorder.start())
        return processors

    model._get_logits_processor = types.MethodType(get_logits_processor, model)
    model._tpo_recorder_slot = slot
    return slot


def kept_set_rows(recorder: KeptSetRecorder, token_mask: Tensor, *, always: bool = False
                  ) -> Optional[Tuple[Tensor, Tensor]]:
    """``(tpo_kept_ids [N, P], tpo_kept_counts [N, C])`` (see the module docstring) of the recorded
    generation, for the completions' ``token_mask [N, C]`` (row n of the generation is row n of the
    batch, step t its token t); None when no step truncated any row, unless ``always`` (every set
    then the whole vocabulary: another process's sampler truncated, and rows move between
    processes with the same keys). Tokens outside ``token_mask`` get empty sets; steps beyond the
    recorded ones (padding) too."""
    if not recorder.truncated() and not always:
        return None
    num_rows, width = token_mask.shape
    device, vocab = token_mask.device, recorder.vocab_size or 0
    all_ids = torch.arange(vocab, device=device, dtype=torch.int32)
    rows, steps, ids = [], [], []
    for t, pairs in enumerate(recorder.steps[:width]):
        if pairs is None:  # every row kept the whole vocabulary at this step
            pairs = torch.stack(torch.meshgrid(torch.arange(num_rows, device=device, dtype=torch.int32), all_ids,
                                               indexing="ij"), dim=-1).reshape(-1, 2)
        pairs = pairs.to(device)
        kept = token_mask[pairs[:, 0].long(), t]
        rows.append(pairs[kept, 0].long())
        steps.append(torch.full_like(rows[-1], t))
        ids.append(pairs[kept, 1])
    rows, steps, ids = torch.cat(rows), torch.cat(steps), torch.cat(ids)
    counts = torch.bincount(rows * width + steps, minlength=num_rows * width).view(num_rows, width)
    # Pairs in (row, step, id) order: steps came in order and ids ascend within a step's row.
    order = torch.sort(rows, stable=True).indices
    rows, ids = rows[order], ids[order]
    totals = counts.sum(dim=1)
    first = totals.cumsum(0) - totals  # each row's first pair
    position = torch.arange(rows.numel(), device=device) - first[rows]
    kept_ids = torch.full((num_rows, int(totals.max()) if num_rows else 0), -1, dtype=torch.int32, device=device)
    kept_ids[rows, position] = ids
    return kept_ids, counts.to(torch.int32)


def sampling_mask_of(kept_ids: Tensor, kept_counts: Tensor) -> SamplingMask:
    """The loss call's kept sets of rows carrying ``tpo_kept_ids`` / ``tpo_kept_counts``: a CSR over
    their ``[N, C]`` tokens, row-major (each row's ids are its tokens' sets in order, -1 after)."""
    offsets = torch.cat([kept_counts.new_zeros(1, dtype=torch.int64), kept_counts.reshape(-1).long().cumsum(0)])
    return SamplingMask(token_ids=kept_ids[kept_ids >= 0].long(), offsets=offsets)
