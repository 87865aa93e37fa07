"""Every bad input raises a ValueError/TypeError that names the argument, before any kernel runs."""

import pytest
import torch

import tpo_kernels

_DROP = object()
N, T, V = 4, 5, 37

BAD_INPUTS = [
    ("logits", TypeError, dict(logits=torch.zeros(N, T, V, dtype=torch.int64))),
    ("logits", ValueError, dict(logits=torch.zeros(N, T, 1, V))),
    ("logits", TypeError, dict(logits=[[0.0]])),
    ("labels", ValueError, dict(labels=torch.zeros(N, T + 1, dtype=torch.int64))),
    ("labels", TypeError, dict(labels=torch.zeros(N, T))),
    ("labels", ValueError, dict(labels=torch.full((N, T), V, dtype=torch.int64))),
    ("labels", ValueError, dict(labels=torch.full((N, T), -5, dtype=torch.int64))),
    ("group_size", ValueError, dict(group_size=3)),
    ("group_size", ValueError, dict(group_size=0)),
    ("group_size", TypeError, dict(group_size=2.0)),
    ("group_size", ValueError, dict(group_size=_DROP)),
    ("group_size", ValueError, dict(group_ids=torch.zeros(N, dtype=torch.int64))),
    ("group_ids", ValueError, dict(group_size=_DROP, group_ids=torch.zeros(N + 1, dtype=torch.int64))),
    ("group_ids", TypeError, dict(group_size=_DROP, group_ids=torch.zeros(N))),
    ("scores", ValueError, dict(scores=torch.tensor([0.0, float("nan"), 1.0, 2.0]))),
    ("scores", ValueError, dict(scores=torch.tensor([0.0, float("inf"), 1.0, 2.0]))),
    ("scores", ValueError, dict(scores=torch.zeros(N + 1))),
    ("eta", ValueError, dict(eta=0.0)),
    ("eta", ValueError, dict(eta=-1.0)),
    ("eta", TypeError, dict(eta="1")),
    ("temperature", ValueError, dict(temperature=0.0)),
    ("temperature", ValueError, dict(temperature=float("inf"))),
    ("reduction", ValueError, dict(reduction="avg")),
    ("beta", ValueError, dict(beta=-0.1)),
    ("ref_logprobs", ValueError, dict(beta=0.1)),
    ("ref_logprobs", ValueError, dict(beta=0.1, ref_logprobs=torch.zeros(N))),
    ("old_logprobs", ValueError, dict(old_logprobs=torch.zeros(N, T + 1))),
    ("old_logprobs", TypeError, dict(old_logprobs=torch.zeros(N, dtype=torch.int64))),
    ("mask", ValueError, dict(mask=torch.ones(N, T + 1))),
    ("mask", ValueError, dict(mask=torch.full((N, T), 2))),
    ("cu_seqlens", ValueError, dict(cu_seqlens=torch.tensor([0, 1, 2, 3, 4]))),
    ("anchor", TypeError, dict(anchor=1)),
    ("backend", ValueError, dict(backend="jax")),
]


@pytest.mark.parametrize("argument,error,overrides", BAD_INPUTS, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(argument, error, overrides):
    labels = torch.randint(0, V, (N, T))  # all counted, so only the override is wrong
    args = dict(logits=torch.randn(N, T, V), labels=labels, scores=torch.randn(N), group_size=2)
    args.update(overrides)
    for key in [k for k, v in overrides.items() if v is _DROP]:
        del args[key]
    with pytest.raises(error, match=argument):
        tpo_kernels.tpo_loss(args.pop("logits"), args.pop("labels"), args.pop("scores"), **{"backend": "torch", **args})


def test_completion_without_counted_tokens_is_rejected():
    labels = torch.randint(0, V, (N, T))
    labels[2] = -100
    with pytest.raises(ValueError, match="completion 2 has no counted token"):
        tpo_kernels.tpo_loss(torch.randn(N, T, V), labels, torch.randn(N), group_size=2)


def test_packed_inputs_need_cu_seqlens():
    with pytest.raises(ValueError, match="cu_seqlens"):
        tpo_kernels.tpo_loss(torch.randn(10, V), torch.randint(0, V, (10,)), torch.randn(2), group_size=2)


@pytest.mark.parametrize("cu", [[1, 4, 10], [0, 6, 4], [0, 4, 11]])
def test_malformed_cu_seqlens_are_rejected(cu):
    with pytest.raises(ValueError, match="cu_seqlens"):
        tpo_kernels.tpo_loss(torch.randn(10, V), torch.randint(0, V, (10,)), torch.randn(2), group_size=2,
                             cu_seqlens=torch.tensor(cu))


def test_labels_under_the_mask_are_not_range_checked():
    labels = torch.randint(0, V, (N, T))
    labels[:, -1] = V + 100  # out of range but masked out
    mask = torch.ones(N, T, dtype=torch.bool)
    mask[:, -1] = False
    loss = tpo_kernels.tpo_loss(torch.randn(N, T, V), labels, torch.randn(N), group_size=2, mask=mask)
    assert torch.isfinite(loss)


def test_unusable_backend_explains_why():
    status = tpo_kernels.backend_status()
    unusable = [name for name, s in status.items() if s != "available"]
    if not unusable:
        pytest.skip("every backend is usable here")
    with pytest.raises((RuntimeError, ValueError), match=unusable[0]):
        tpo_kernels.tpo_loss(torch.randn(N, T, V), torch.randint(0, V, (N, T)), torch.randn(N), group_size=2,
                             backend=unusable[0])


def test_selective_logprobs_rejects_out_of_range_labels():
    with pytest.raises(ValueError, match="labels"):
        tpo_kernels.selective_logprobs(torch.randn(3, V), torch.tensor([0, V, 1]))


def test_selective_logprobs_rejects_bad_temperature():
    with pytest.raises(ValueError, match="temperature"):
        tpo_kernels.selective_logprobs(torch.randn(3, V), torch.tensor([0, 1, 2]), temperature=-1.0)
