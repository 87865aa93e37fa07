"""Device-to-host read-backs per call: each public function's forward + backward makes exactly
the number of read-backs DESIGN.md section 3 documents, counted by a dispatch mode that sees
inside the custom ops (scalar reads, nonzero, boolean-mask indexing, unique, tolist). With
``validate=False`` the logits path of a padded batch grouped by ``group_size`` makes none, so it
can be captured in a CUDA graph (the GPU-only test at the end)."""

import pytest
import torch

import tpo_kernels

from _backends import DEVICE, DEVICE_BACKENDS, HAS_GPU
from _dispatch import ReadBacks

N, T, V, H, K = 4, 5, 37, 8, 2  # N completions in groups of K; R = 6 states of K = 3 candidates
R, C = 6, 3

# The budget of DESIGN.md section 3: call -> (read-backs with validate=True, with validate=False).
BUDGET = {
    "tpo_loss": (1, 0),
    "tpo_loss packed": (2, 1),
    "tpo_loss group_ids": (3, 2),
    "tpo_loss_from_logprobs": (1, 0),
    "selective_logprobs": (1, 0),
    "token_tpo_loss": (1, 0),
    "fused_linear_token_tpo_loss": (2, 1),
    "fused_linear_tpo_loss": (3, 2),
    "fused_linear_logprobs": (3, 2),
}


def _leaf(*shape):
    return torch.randn(*shape, device=DEVICE, requires_grad=True)


def _call(name: str):
    """A function of (validate, backend) running ``name``'s forward on inputs made here, outside
    the recorder: padded, grouped by size, every completion with a counted token."""
    labels = torch.randint(0, V, (N, T), device=DEVICE)
    labels[0, -1] = -100
    scores = torch.randn(N, device=DEVICE)
    logits = _leaf(N, T, V) * 1  # an activation, as in training
    hidden, weight = _leaf(N, T, H), _leaf(V, H)
    candidates, cand_scores = torch.randint(0, V, (R, C), device=DEVICE), torch.randn(R, C, device=DEVICE)
    cu_seqlens = torch.tensor([0, 3, 5, 9, 12], device=DEVICE)
    calls = {
        "tpo_loss": lambda **kw: tpo_kernels.tpo_loss(logits, labels, scores, group_size=K, **kw),
        "tpo_loss packed": lambda **kw: tpo_kernels.tpo_loss(
            logits.view(-1, V)[:12], labels.view(-1)[:12].clamp(min=0), scores, cu_seqlens=cu_seqlens,
            group_size=K, **kw),
        "tpo_loss group_ids": lambda **kw: tpo_kernels.tpo_loss(
            logits, labels, scores, group_ids=torch.tensor([3, 1, 3, 1], device=DEVICE), **kw),
        "tpo_loss_from_logprobs": lambda **kw: tpo_kernels.tpo_loss_from_logprobs(
            -_leaf(N, T).abs(), scores, group_size=K, **kw),  # log-probs: <= 0
        "selective_logprobs": lambda **kw: tpo_kernels.selective_logprobs(logits, labels, **kw).sum(),
        "token_tpo_loss": lambda **kw: tpo_kernels.token_tpo_loss(_leaf(R, V), candidates, cand_scores, **kw),
        "fused_linear_token_tpo_loss": lambda **kw: tpo_kernels.fused_linear_token_tpo_loss(
            _leaf(R, H), weight, candidates, cand_scores, **kw),
        "fused_linear_tpo_loss": lambda **kw: tpo_kernels.fused_linear_tpo_loss(
            hidden, weight, labels, scores, group_size=K, **kw),
        "fused_linear_logprobs": lambda **kw: tpo_kernels.fused_linear_logprobs(hidden, weight, labels, **kw).sum(),
    }
    return calls[name]


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("validate", [True, False], ids=["validate", "no-validate"])
@pytest.mark.parametrize("name", list(BUDGET))
def test_read_backs_per_call_are_the_documented_budget(name, validate, backend):
    run = _call(name)
    recorder = ReadBacks()
    with recorder:
        run(validate=validate, backend=backend).backward()
    assert len(recorder.reads) == BUDGET[name][not validate], recorder.reads


# With a sampling_mask the kept sets' value checks join the call's one read-back; the fused paths
# form no logits tile, so their budget is the kept backward's one (the weight gradient's runs).
MASK_BUDGET = {"tpo_loss": (1, 0), "selective_logprobs": (1, 0), "fused_linear_tpo_loss": (2, 1),
               "fused_linear_logprobs": (2, 1)}


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("validate", [True, False], ids=["validate", "no-validate"])
@pytest.mark.parametrize("form", ["padded", "csr"])
@pytest.mark.parametrize("name", list(MASK_BUDGET))
def test_a_sampling_mask_adds_no_read_back(name, form, validate, backend):
    labels = torch.randint(0, V, (N, T), device=DEVICE)
    labels[0, -1] = -100
    padded = torch.stack([labels.clamp(min=0), (labels.clamp(min=0) + 5) % V], dim=-1)
    mask = padded if form == "padded" else tpo_kernels.SamplingMask.from_lists(padded.view(-1, 2).tolist(),
                                                                               device=DEVICE)
    scores, logits = torch.randn(N, device=DEVICE), _leaf(N, T, V) * 1
    hidden, weight = _leaf(N, T, H), _leaf(V, H)
    calls = {
        "tpo_loss": lambda **kw: tpo_kernels.tpo_loss(logits, labels, scores, group_size=K, **kw),
        "selective_logprobs": lambda **kw: tpo_kernels.selective_logprobs(logits, labels, **kw).sum(),
        "fused_linear_tpo_loss": lambda **kw: tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores,
                                                                                group_size=K, **kw),
        "fused_linear_logprobs": lambda **kw: tpo_kernels.fused_linear_logprobs(hidden, weight, labels, **kw).sum(),
    }
    recorder = ReadBacks()
    with recorder:
        calls[name](sampling_mask=mask, validate=validate, backend=backend).backward()
    assert len(recorder.reads) == MASK_BUDGET[name][not validate], recorder.reads


def test_a_left_out_completion_costs_three_more_read_backs():
    # The layout must learn the kept completions: nonzero, the groups, the largest group.
    labels = torch.randint(0, V, (N, T), device=DEVICE)
    labels[1] = -100
    logits, scores = _leaf(N, T, V) * 1, torch.randn(N, device=DEVICE)
    recorder = ReadBacks()
    with recorder:
        tpo_kernels.tpo_loss(logits, labels, scores, group_size=K, backend="torch").backward()
    assert len(recorder.reads) == BUDGET["tpo_loss"][0] + 3, recorder.reads


READ_BACKS = {
    "bool": lambda x: bool(x.any()),
    "item": lambda x: x.sum().item(),
    "int": lambda x: int(x.sum()),
    "tolist": lambda x: x.tolist(),
    "nonzero": lambda x: torch.nonzero(x),
    "mask index": lambda x: x[x > 0],
    "mask assignment": lambda x: x.clone().__setitem__(x > 0, 0),
    "unique": lambda x: torch.unique(x),
    "repeat_interleave": lambda x: torch.arange(3, device=x.device).repeat_interleave(x[:3].long().abs()),
}


@pytest.mark.parametrize("name", list(READ_BACKS))
def test_the_counter_sees_each_kind_of_read_back(name):
    x = torch.randn(8, device=DEVICE)
    recorder = ReadBacks()
    with recorder:
        READ_BACKS[name](x)
    assert len(recorder.reads) == 1, recorder.reads


def test_the_counter_ignores_sync_free_ops():
    x = torch.randn(8, device=DEVICE)
    recorder = ReadBacks()
    with recorder:
        torch.where(x > 0, x, 0.0).sum().exp()
        torch.arange(3, device=DEVICE).repeat_interleave(torch.tensor([1, 2, 0], device=DEVICE), output_size=3)
    assert recorder.reads == []


# ----------------------------------------------------------------------------------------------
# GPU only: the sync-free logits path inside a CUDA graph
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_GPU, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_logits_path_without_validation_is_captured_in_a_cuda_graph(backend):
    logits = torch.randn(N, T, V, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, V, (N, T), device=DEVICE)
    scores = torch.randn(N, device=DEVICE)

    def step():
        loss = tpo_kernels.tpo_loss(logits, labels, scores, group_size=K, validate=False, backend=backend)
        return (loss, *torch.autograd.grad(loss, logits))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocator, Triton compilation)
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    with torch.no_grad():  # new values in the captured input buffers, then a replay
        logits.copy_(torch.randn_like(logits))
        labels.copy_(torch.randint(0, V, (N, T), device=DEVICE))
        scores.copy_(torch.randn_like(scores))
    graph.replay()
    for replayed, eager in zip(captured, step()):
        torch.testing.assert_close(replayed, eager)
