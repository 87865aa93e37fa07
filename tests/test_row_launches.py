"""Row-op launches per call: a ``[B, T, V]`` logits view whose rows do not flatten into one row
stride (``logits[:, :-1]``, or a view that starts one position in) is one row-op launch forward
and one backward, read in place, as a contiguous batch is; before, ``ops/logprobs.py`` walked it
one batch entry at a time (B launches each way).

Launches are counted at the backend boundary (the backend's ``row_forward`` / ``row_backward``,
wrapped), and the results are bitwise those of the per-entry path on the same backend: each batch
entry's ``[T, V]`` slice (one row stride) run on its own. V and the batch stride are odd, so the
entries start off 16-byte boundaries: the Triton kernels cut each row at the same columns in both
paths because they take the view's start rounded down to 16 bytes as their base
(``row_layout.aligned_base``), not the start itself.
"""

import pytest
import torch

import tpo_kernels
from tpo_kernels.backends import get_backend

from _backends import DEVICE, backend_params

BACKENDS = backend_params("torch", "cpu", "triton")
B, T_FULL, V = 3, 7, 37  # odd V and an odd batch stride (T_FULL * V = 259): entries start unaligned
VIEWS = {
    "contiguous": lambda full: full,
    "drop_last": lambda full: full[:, :-1],
    "offset": lambda full: full[:, 1:],
}


class LaunchCounter:
    """Counts calls of a backend's row ops (each is one kernel launch on the native backends)."""

    def __init__(self, monkeypatch, backend):
        self.forward = self.backward = 0
        forward, backward = backend.row_forward, backend.row_backward

        def counted_forward(*args, **kwargs):
            self.forward += 1
            return forward(*args, **kwargs)

        def counted_backward(*args, **kwargs):
            self.backward += 1
            return backward(*args, **kwargs)

        monkeypatch.setattr(backend, "row_forward", counted_forward)
        monkeypatch.setattr(backend, "row_backward", counted_backward)

    def reset(self):
        self.forward = self.backward = 0


def _case(dtype, positions=T_FULL - 1):
    """``(full [B, T_FULL, V], labels [B, positions], weights [2, B, positions])``."""
    gen = torch.Generator().manual_seed(0)
    full = (torch.randn(B, T_FULL, V, generator=gen) * 3).to(dtype).to(DEVICE)
    labels = torch.randint(0, V, (B, positions), generator=gen)
    labels[1, 2] = -100  # an ignored position
    weights = torch.randn(2, B, positions, generator=gen)
    return full, labels.to(DEVICE), weights.to(DEVICE)


def _run(logits_of, full, labels, weights, backend):
    """``(logprobs, entropy, grad of full)`` of one call on the view ``logits_of(leaf)``."""
    leaf = full.detach().clone().requires_grad_(True)
    lp, ent = tpo_kernels.selective_logprobs(logits_of(leaf), labels, return_entropy=True, backend=backend)
    (grad,) = torch.autograd.grad((lp * weights[0]).sum() + (ent * weights[1]).sum(), leaf)
    return lp, ent, grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("view", list(VIEWS))
def test_one_row_launch_each_way_bitwise_equal_to_the_per_entry_path(backend, dtype, view, monkeypatch):
    counter = LaunchCounter(monkeypatch, get_backend(backend, DEVICE))
    full, labels, weights = _case(dtype, T_FULL if view == "contiguous" else T_FULL - 1)
    got = _run(VIEWS[view], full, labels, weights, backend)
    assert (counter.forward, counter.backward) == (1, 1)

    counter.reset()
    per_entry = [_run(lambda leaf, b=b: VIEWS[view](leaf)[b], full, labels[b], weights[:, b], backend)
                 for b in range(B)]
    assert (counter.forward, counter.backward) == (B, B)  # the path the batch replaces
    assert torch.equal(got[0], torch.stack([lp for lp, _, _ in per_entry]))
    assert torch.equal(got[1], torch.stack([ent for _, ent, _ in per_entry]))
    assert torch.equal(got[2], sum(grad for _, _, grad in per_entry))


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_row_backward_in_place_leaves_the_rest_of_the_buffer(backend):
    """The backend's row backward on a ``[:, :-1]`` view, in place (``out`` is the view): the
    view's rows get the gradient the out-of-place call writes, the dropped positions keep their
    logits."""
    ops = get_backend(backend, DEVICE)
    full, labels, _ = _case(torch.float32)
    view = full[:, :-1]
    flat_labels = labels.reshape(-1)
    summary = ops.row_forward(view, flat_labels, inv_temperature=1.3, with_entropy=True)
    grad = torch.linspace(-1.0, 1.0, B * (T_FULL - 1), device=DEVICE)
    grad_ent = torch.linspace(0.5, -0.5, B * (T_FULL - 1), device=DEVICE)
    args = (flat_labels, summary, torch.where(flat_labels >= 0, grad, 0.0))
    kwargs = dict(grad_entropy=torch.where(flat_labels >= 0, grad_ent, 0.0), inv_temperature=1.3)
    expected = torch.empty_like(view)
    ops.row_backward(view, *args, out=expected, **kwargs)
    last = full[:, -1].clone()
    ops.row_backward(view, *args, out=view, **kwargs)
    assert torch.equal(full[:, :-1], expected)
    assert torch.equal(full[:, -1], last)
