"""The group stage sums its per-completion and per-group quantities in stacked calls: one segment
sum for every token-mean term (the k3 KL term, the entropy bonus, the counted tokens) and one group
sum for the per-group metrics of the aux, instead of one call per quantity; the stacked sums equal
the per-quantity ones."""

from __future__ import annotations

import pytest
import torch

import tpo_kernels
from tpo_kernels import group_math, reference
from tpo_kernels.ops import group as group_stage

from _batches import make_batch


class _Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("layout,grouping", [("padded", "size"), ("packed", "ids")])
def test_one_segment_sum_and_one_group_sum_per_call(monkeypatch, layout, grouping):
    segment_sum, group_sum = _Counting(group_math.segment_sum), _Counting(group_math.group_sum)
    monkeypatch.setattr(group_stage, "segment_sum", segment_sum)
    monkeypatch.setattr(group_stage, "group_sum", group_sum)
    logits, labels, scores, kwargs = make_batch(layout=layout, grouping=grouping, with_ref=True,
                                                device=torch.device("cpu"))
    loss, aux = tpo_kernels.tpo_loss(logits, labels, scores, return_aux=True, backend="torch", entropy_coef=0.01,
                                     **kwargs)
    assert segment_sum.calls == 1  # k3, entropy and the counted tokens, together
    assert group_sum.calls == 1  # kl_q_p, entropy_p, entropy_q and zero_signal, together
    want = reference.tpo_loss(logits, labels, scores, entropy_coef=0.01, **kwargs)
    torch.testing.assert_close(loss.double(), want.double(), rtol=1e-5, atol=1e-6)
    assert set(aux) >= {"kl_q_p", "entropy_p", "entropy_q", "zero_signal"}


@pytest.mark.parametrize("layout,grouping", [("padded", "size"), ("packed", "ids")])
def test_stacked_sums_equal_the_sums_of_each_column(layout, grouping):
    _, labels, _, kwargs = make_batch(layout=layout, grouping=grouping, device=torch.device("cpu"))
    shape = dict(padded_shape=tuple(labels.shape)) if layout == "padded" else dict(cu_seqlens=kwargs["cu_seqlens"])
    group = dict(group_size=kwargs["group_size"]) if grouping == "size" else dict(group_ids=kwargs["group_ids"])
    batch_layout = group_math.build_layout(labels.numel(), torch.device("cpu"), **shape, **group)
    columns = torch.randn(batch_layout.num_tokens, 3, dtype=torch.float64)
    columns[batch_layout.token_seq < 0] = 0.0
    stacked = group_math.segment_sum(columns, batch_layout)
    for c in range(3):
        torch.testing.assert_close(stacked[:, c], group_math.segment_sum(columns[:, c].contiguous(), batch_layout),
                                   rtol=1e-15, atol=0)
    per_member = torch.randn(batch_layout.num_seqs, 4, dtype=torch.float64)
    stacked = group_math.group_sum(per_member, batch_layout)
    for c in range(4):
        torch.testing.assert_close(stacked[:, c], group_math.group_sum(per_member[:, c].contiguous(), batch_layout),
                                   rtol=1e-15, atol=0)
