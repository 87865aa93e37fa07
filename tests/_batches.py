"""Random TPO batches for the tests: padded or packed, grouped by size or by ids."""

from __future__ import annotations

from typing import Optional

import torch

from _backends import DEVICE


def make_batch(
    *,
    layout: str = "padded",
    grouping: str = "size",
    num_groups: int = 2,
    group_size: int = 3,
    max_len: int = 5,
    vocab: int = 37,
    dtype: torch.dtype = torch.float32,
    old: Optional[str] = None,
    with_ref: bool = False,
    tie_groups: int = 0,
    device: torch.device = DEVICE,
):
    """Returns (logits, labels, scores, kwargs for tpo_loss) describing one random batch.

    Completions have random lengths in [1, max_len]; padded batches mark padding with -100
    labels, packed ones concatenate the completions and pass cu_seqlens. ``grouping="ids"``
    shuffles completions into groups of varying sizes. The first ``tie_groups`` groups get
    tied scores.
    """
    n = num_groups * group_size
    lengths = torch.randint(1, max_len + 1, (n,))
    kwargs = {}
    if grouping == "size":
        kwargs["group_size"] = group_size
        group_of = torch.arange(n) // group_size
    else:
        # Variable sizes: move one member of group 0 to the last group, then shuffle the order.
        group_of = torch.arange(n) // group_size
        if num_groups > 1 and group_size > 1:
            group_of[0] = num_groups - 1
        group_of = group_of[torch.randperm(n)]
        kwargs["group_ids"] = (group_of * 7 + 3).to(device)  # arbitrary id values
    scores = torch.randn(n, dtype=torch.float64)
    for g in range(tie_groups):
        scores[group_of == g] = 0.5

    if layout == "padded":
        labels = torch.randint(0, vocab, (n, max_len))
        for i in range(n):
            labels[i, lengths[i]:] = -100
        logits = torch.randn(n, max_len, vocab, dtype=torch.float64) * 2
    else:
        total = int(lengths.sum())
        labels = torch.randint(0, vocab, (total,))
        labels[0] = -100 if lengths[0] > 1 else labels[0]  # an ignored token inside a completion
        logits = torch.randn(total, vocab, dtype=torch.float64) * 2
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        kwargs["cu_seqlens"] = cu.to(device)
    token_shape = labels.shape
    if old == "token":
        kwargs["old_logprobs"] = (-torch.rand(token_shape, dtype=torch.float64) * 3).to(device, dtype)
    elif old == "seq":
        kwargs["old_logprobs"] = (-torch.rand(n, dtype=torch.float64) * 10).to(device, dtype)
    if with_ref:
        kwargs["ref_logprobs"] = (-torch.rand(token_shape, dtype=torch.float64) * 3).to(device, dtype)
        kwargs["beta"] = 0.1
    return logits.to(device, dtype), labels.to(device), scores.to(device, dtype), kwargs
