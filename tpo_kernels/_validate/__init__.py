"""Every input check of the public API, one copy each.

Checks run in Python before any kernel launch and raise ``ValueError`` / ``TypeError`` naming
the argument. Checks of metadata (types, shapes, dtypes, devices, hyper-parameters) are free;
checks of values (label ranges, finite scores, empty completions, cu_seqlens order) read a
result back from the device, so ``validate=False`` skips them (for compiled and CUDA-graph use,
where a host round trip is not allowed). With ``validate=False`` bad values give wrong results,
never out-of-bounds memory access: the native backends re-check ids at their pointer boundary.
"""

from . import placement
from .batches import PreparedBatch, check_grouping, check_scores, prepare_batch, prepare_candidates
from .scalars import (
    LossSettings,
    REDUCTIONS,
    check_backend_arg,
    check_backend_device,
    check_beta,
    check_entropy_coef,
    check_flag,
    check_ignore_index,
    check_int,
    check_logit_transform,
    check_positive,
    check_reduction,
    check_settings,
    check_tile_policy,
)
from .tensors import (
    check_chunk_size,
    check_float_tensor,
    check_grad_accum_dtype,
    check_head,
    check_integer_dtype,
    check_logits,
    check_logits_cache,
    check_tensor,
    prepare_labels,
    reject_meta,
)

__all__ = [
    "LossSettings",
    "PreparedBatch",
    "REDUCTIONS",
    "check_backend_arg",
    "check_backend_device",
    "check_beta",
    "check_chunk_size",
    "check_entropy_coef",
    "check_flag",
    "check_float_tensor",
    "check_grouping",
    "check_grad_accum_dtype",
    "check_head",
    "check_ignore_index",
    "check_int",
    "check_integer_dtype",
    "check_logit_transform",
    "check_logits",
    "check_logits_cache",
    "check_positive",
    "check_reduction",
    "check_scores",
    "check_settings",
    "check_tensor",
    "check_tile_policy",
    "prepare_batch",
    "prepare_candidates",
    "placement",
    "prepare_labels",
    "reject_meta",
]
