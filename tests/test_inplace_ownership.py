"""Whose storage the in-place backward may overwrite (``inplace_backward=True``, the default).

The logits path writes the logits gradient over the logits' storage when that storage belongs to
the autograd graph: an intermediate activation, ``model(...).logits[:, :-1]``, whose buffer dies
with the backward anyway. The decision is taken from the storage, not from the view that arrives:
a view of a leaf (``leaf[:, :-1]``, ``leaf[::2]``, ``leaf.view(...)``, views of views) has a
``grad_fn`` of its own, but its storage is the caller's and stays bit for bit as it was, with the
gradient in ``leaf.grad`` as the out-of-place backward gives it, on every backend. The common case
keeps its memory saving: a view of an activation takes its gradient in its own storage, allocating
no logits-sized gradient buffer. The two-stage backward of a trainer
(``logits = out.logits.detach().requires_grad_()``, the loss on ``logits[:, :-1]``, then
``out.logits.backward(logits.grad)``) leaves the model's output untouched. A vocabulary shard (a
plain tensor with ``vocab_parallel_group``, or a DTensor's local shard) follows the same rule.
"""

import pytest
import torch

import tpo_kernels
from tpo_kernels import reference

from _backends import DEVICE, DEVICE_BACKENDS, INTERPRETED_BACKENDS
from _dispatch import OpRecorder
from _distributed import run_ranks

BACKENDS = DEVICE_BACKENDS + INTERPRETED_BACKENDS  # tiny shapes: the triton interpreter runs them too
B, T, V, K = 8, 5, 16, 2  # the source is [B, T + 1, V]; every view keeps a multiple of K completions


def _views():
    """name -> (a [B, T + 1, V] tensor -> a [N, T', V] view of its storage)."""
    return {
        "shifted": lambda x: x[:, :-1],  # logits[:, :-1]: rows that do not flatten
        "every_other": lambda x: x[::2],
        "inner": lambda x: x[1:-1],
        "reshaped": lambda x: x.view(B // 2, 2 * (T + 1), V),
        "view_of_view": lambda x: x[:, :-1][::2],
        "view_of_view_of_view": lambda x: x[2:].view(B - 2, T + 1, V)[:, 1:][1:-1],
    }


CAPS = [pytest.param(None, id="plain"), pytest.param(30.0, id="softcap30")]


def _source():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    return torch.randn(B, T + 1, V, generator=gen, device=DEVICE) * 3


def _loss(logits, backend, cap, **kwargs):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    labels = torch.randint(0, V, logits.shape[:-1], generator=gen, device=DEVICE)
    scores = torch.randn(logits.shape[0], generator=gen, device=DEVICE)
    return tpo_kernels.tpo_loss(logits, labels, scores, group_size=K, backend=backend, logit_softcap=cap, **kwargs)


def _out_of_place_grad(view, backend, cap):
    """The gradient of the source through ``view``, by the out-of-place backward."""
    leaf = _source().requires_grad_(True)
    _loss(view(leaf), backend, cap, inplace_backward=False).backward()
    return leaf.grad


# ----------------------------------------------------------------------------- a leaf's storage


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("view", list(_views()))
def test_a_view_of_a_leaf_leaves_the_leaf_unchanged(backend, cap, view):
    leaf = _source().requires_grad_(True)
    before = leaf.detach().clone()
    _loss(_views()[view](leaf), backend, cap).backward()
    assert torch.equal(leaf.detach(), before)
    assert torch.equal(leaf.grad, _out_of_place_grad(_views()[view], backend, cap))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_leaf_view_of_a_plain_tensor_leaves_the_tensor_unchanged(backend):
    """``plain[:, :-1].requires_grad_()``: a leaf whose storage is a tensor no graph made."""
    plain = _source()
    before = plain.clone()
    logits = plain[:, :-1].requires_grad_(True)
    _loss(logits, backend, None).backward()
    assert torch.equal(plain, before)
    expected = _source()[:, :-1].requires_grad_(True)
    _loss(expected, backend, None, inplace_backward=False).backward()
    assert torch.equal(logits.grad, expected.grad)


# ----------------------------------------------------------------------------- an activation's storage


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("view", list(_views()))
def test_a_view_of_an_activation_takes_its_gradient_in_place(backend, cap, view):
    """The gradient autograd hands on is the view itself, and the activation's entries under the
    view hold the out-of-place backward's gradient (the rest keep their values)."""
    leaf = _source().requires_grad_(True)
    activation = leaf * 1  # an intermediate activation, as model(...).logits
    before = activation.detach().clone()
    logits = _views()[view](activation)
    loss = _loss(logits, backend, cap)
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad.data_ptr() == logits.data_ptr() and grad.stride() == logits.stride()  # no buffer of its own
    expected = _out_of_place_grad(_views()[view], backend, cap)
    written = torch.zeros_like(before, dtype=torch.bool)
    _views()[view](written).fill_(True)
    assert torch.equal(activation.detach()[written], expected[written])
    assert torch.equal(activation.detach()[~written], before[~written])


class AllocatedBytes(OpRecorder):
    """The bytes of the tensors ops allocate (outputs that are no view of an input). A custom op's
    own allocations are seen inside it (the recorder runs its implementation), not again as its
    output."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def record(self, func, args, kwargs, out):
        if func.namespace == "tpo_kernels":
            return
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.total += t.untyped_storage().nbytes()


def _backward_bytes(logits, backend, cap, inplace):
    loss = _loss(logits, backend, cap, inplace_backward=inplace)
    with AllocatedBytes() as recorder:
        torch.autograd.grad(loss, logits)
    return recorder.total


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("view", ["shifted", "view_of_view"])
def test_a_view_of_an_activation_allocates_no_gradient_buffer(backend, cap, view):
    """The memory saving of the common case: the in-place backward of ``model(...).logits[:, :-1]``
    allocates at least one logits-sized buffer less than the out-of-place backward."""
    allocated = {}
    for inplace in (False, True):
        activation = _source().requires_grad_(True) * 1
        logits = _views()[view](activation)
        allocated[inplace] = _backward_bytes(logits, backend, cap, inplace)
    assert allocated[False] - allocated[True] >= logits.numel() * logits.element_size()


# ----------------------------------------------------------------------------- the two-stage backward


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_stage_backward_leaves_the_models_logits_unchanged(backend):
    """A trainer's two-stage backward: the loss on a detached copy of the model's logits, then the
    model's backward from that copy's gradient. The model's output keeps its values, and both
    gradients are the reference's."""
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    hidden = torch.randn(B, T + 1, 8, generator=gen, device=DEVICE)
    weight = torch.randn(V, 8, generator=gen, device=DEVICE).requires_grad_(True)
    out_logits = hidden @ weight.T  # the model's output: an activation
    before = out_logits.detach().clone()
    logits = out_logits.detach().requires_grad_()  # shares out_logits' storage
    _loss(logits[:, :-1], backend, None).backward()
    assert torch.equal(out_logits.detach(), before)
    out_logits.backward(logits.grad)

    ref_weight = weight.detach().double().requires_grad_(True)
    ref_logits = hidden.double() @ ref_weight.T
    ref_logits.retain_grad()
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    labels = torch.randint(0, V, (B, T), generator=gen, device=DEVICE)
    scores = torch.randn(B, generator=gen, device=DEVICE)
    reference.tpo_loss(ref_logits[:, :-1], labels, scores.double(), group_size=K).backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), ref_weight.grad, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- vocabulary shards


def _shard_leaf(kind: str, full, mesh, rank: int, world: int):
    """``(leaf, its local shard, the call's keywords)``: this rank's vocabulary shard of ``full`` as
    a DTensor (``kind="dtensor"``) or as a plain tensor with ``vocab_parallel_group``."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.tensor import Shard, distribute_tensor  # noqa: PLC0415

    if kind == "dtensor":
        leaf = distribute_tensor(full, mesh, [Shard(2)]).requires_grad_(True)
        return leaf, lambda t: t.to_local(), {}
    size = V // world
    leaf = full[..., rank * size:(rank + 1) * size].clone().requires_grad_(True)
    return leaf, lambda t: t, dict(vocab_parallel_group=dist.group.WORLD)


def shard_storages(rank: int, world: int) -> dict:
    """On each rank: whether a leaf's storage survived and an activation's took its gradient, for a
    DTensor sharded on the vocabulary and for a plain shard with ``vocab_parallel_group``, through
    views that the shard's row op reads in place (rows that flatten)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (world,))
    full = _source().cpu()
    labels = torch.randint(0, V, (B - 2, T + 1), generator=torch.Generator().manual_seed(1))
    scores = torch.randn(B - 2, generator=torch.Generator().manual_seed(2))
    views = {"inner": lambda x: x[1:-1],
             "view_of_view": lambda x: x.view(B * (T + 1), -1).view(B, T + 1, -1)[1:-1]}
    results = {}
    for name, view in views.items():
        for kind in ("dtensor", "plain"):
            leaf, local, kwargs = _shard_leaf(kind, full, mesh, rank, world)
            before = local(leaf).detach().clone()
            tpo_kernels.tpo_loss(view(leaf), labels, scores, group_size=K, **kwargs).backward()
            results[f"{kind} {name}: the leaf keeps its values"] = bool(torch.equal(local(leaf).detach(), before))
            activation = leaf * 1
            loss = tpo_kernels.tpo_loss(view(activation), labels, scores, group_size=K, **kwargs)
            (grad,) = torch.autograd.grad(loss, activation)
            rows = local(activation).detach()[1:-1]
            results[f"{kind} {name}: the activation holds the gradient"] = bool(torch.equal(rows, local(grad)[1:-1]))
    return results


def test_vocabulary_shards_follow_the_same_rule():
    for rank, results in enumerate(run_ranks(2, shard_storages)):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
