"""Property tests (hypothesis): random batch structures, torch backend vs reference in float64."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpo_kernels
from tpo_kernels import reference


@st.composite
def batches(draw):
    num_groups = draw(st.integers(1, 3))
    group_sizes = draw(st.lists(st.integers(1, 4), min_size=num_groups, max_size=num_groups))
    lengths = draw(st.lists(st.integers(1, 4), min_size=sum(group_sizes), max_size=sum(group_sizes)))
    vocab = draw(st.integers(2, 9))
    scores = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, -2.0]), min_size=len(lengths), max_size=len(lengths)))
    eta = draw(st.sampled_from([0.25, 1.0, 3.0]))
    anchor = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return group_sizes, lengths, vocab, scores, eta, anchor, seed


@settings(max_examples=40, deadline=None)
@given(batches())
def test_packed_variable_groups_match_reference(batch):
    group_sizes, lengths, vocab, scores, eta, anchor, seed = batch
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    logits = torch.randn(total, vocab, dtype=torch.float64, generator=gen)
    labels = torch.randint(0, vocab, (total,), generator=gen)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    group_ids = torch.cat([torch.full((k,), g) for g, k in enumerate(group_sizes)])
    group_ids = group_ids[torch.randperm(len(group_ids), generator=gen)]
    scores = torch.tensor(scores, dtype=torch.float64)
    kwargs = dict(cu_seqlens=cu, group_ids=group_ids, eta=eta, anchor=anchor, reduction="none")

    x = logits.clone().requires_grad_(True)
    loss = tpo_kernels.tpo_loss(x, labels, scores, backend="torch", **kwargs)
    loss.sum().backward()
    y = logits.clone().requires_grad_(True)
    expected = reference.tpo_loss(y, labels, scores, **kwargs)
    expected.sum().backward()
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(x.grad, y.grad, atol=1e-12, rtol=1e-10)
