"""The checks of token-level TPO's inputs (:func:`tpo_kernels.token_tpo_loss`,
:func:`tpo_kernels.fused_linear_token_tpo_loss`): K candidate ids per state, their scores and old
log-probs, by the rules of a sequence batch's (:mod:`.batches`)."""

from __future__ import annotations

import torch

from .arguments import check_integer_tensor
from .batches import LabelSpace, ValueChecks, check_float_values, check_scores


def prepare_candidates(candidates, scores, old_logprobs, space: LabelSpace, *, validate: bool, whole: bool = True):
    """Checked token-level inputs: ``(candidates int64 [R, K], scores, old_logprobs | None)``,
    the float ones in float64 (the group math's dtype); ``space.token_shape`` is ``(R,)``, the
    states. ``whole=False``: this rank's part of states split over ranks, which may be empty."""
    (num_states,), vocab_size, device, acc, input_name = (space.token_shape, space.vocab_size, space.device,
                                                          space.dtype, space.input_name)
    if num_states == 0 and whole:
        raise ValueError(f"{input_name} holds no state (R == 0)")
    check_integer_tensor("candidates", candidates, device, input_name)
    if candidates.dim() != 2 or candidates.shape[0] != num_states or candidates.shape[1] == 0:
        raise ValueError(
            f"candidates must have shape [R, K] with R={num_states} (the rows of {input_name}) and "
            f"K >= 1, got {tuple(candidates.shape)}"
        )
    shape = tuple(candidates.shape)
    checks = ValueChecks() if validate else None
    if validate:
        out_of_range = (candidates < 0) | (candidates >= vocab_size)
        checks.require(~out_of_range.any(), lambda: ValueError(
            f"candidates must hold token ids in [0, {vocab_size}); found {candidates[out_of_range][0].item()}"))
    scores = check_scores(scores, shape, device, input_name, acc, checks, "the shape of candidates")
    if old_logprobs is not None:
        check_float_values("old_logprobs", old_logprobs, device, input_name)
        if tuple(old_logprobs.shape) != shape:
            raise ValueError(
                f"old_logprobs must have the shape of candidates {shape}, got {tuple(old_logprobs.shape)}"
            )
        old_logprobs = old_logprobs.to(torch.float64).contiguous()  # for the float64 group math
        if validate:
            checks.require(torch.isfinite(old_logprobs).all(),
                           lambda: ValueError("old_logprobs must be finite (found NaN or inf)"))
    if validate:
        checks.read()
    return candidates.to(torch.int64).contiguous(), scores, old_logprobs


__all__ = ["prepare_candidates"]
