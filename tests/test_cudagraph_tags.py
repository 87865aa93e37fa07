"""The custom ops that read device values back on the host carry ``torch.Tag.cudagraph_unsafe``
(where this torch has it), so that ``torch.compile(mode="reduce-overhead")`` keeps them out of
the CUDA graphs it captures, and the others do not (they stay capturable). Which ops read back is
measured, not listed: every public function runs forward and backward with ``validate=False``
under a recorder that counts the read-backs inside each custom op (tests/_dispatch.py)."""

import dataclasses
from collections import defaultdict

import pytest
import torch
from torch._library.custom_ops import OPDEFS

import tpo_kernels
from tpo_kernels.ops._tags import CUDAGRAPH_UNSAFE, host_sync_tags

from _backends import DEVICE, DEVICE_BACKENDS
from _dispatch import ReadBacks

N, T, V, H, K = 4, 5, 37, 8, 2  # N completions in groups of K
R, C = 6, 3  # R states of C candidates

needs_tag = pytest.mark.skipif(not host_sync_tags(), reason="this torch has no cudagraph_unsafe tag for custom ops")


class ReadBacksPerOp(ReadBacks):
    """Read-backs counted per tpo_kernels custom op (an op nested in another counts in both)."""

    def __init__(self):
        super().__init__()
        self.per_op = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "tpo_kernels":
            return super().__torch_dispatch__(func, types, args, kwargs)
        before = len(self.reads)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.per_op[func._schema.name] += len(self.reads) - before
        return out


def _leaf(*shape):
    return torch.randn(*shape, device=DEVICE, requires_grad=True)


def _calls():
    """Every public function once (``fn(backend) -> loss``), together reaching every custom op:
    the in-place log-prob backward through an activation, the out-of-place one through a leaf."""
    labels = torch.randint(0, V, (N, T), device=DEVICE)
    labels[0, -1] = -100
    scores = torch.randn(N, device=DEVICE)
    hidden, weight, bias = _leaf(N, T, H), _leaf(V, H), _leaf(V)
    candidates, cand_scores = torch.randint(0, V, (R, C), device=DEVICE), torch.randn(R, C, device=DEVICE)
    off = dict(validate=False)
    uncached = dataclasses.replace(tpo_kernels.TilePolicy.for_device(DEVICE), small_vocab=0)
    # Kept sets of three distinct ids holding the label (padded form); an ignored token's set is empty.
    kept = torch.stack([labels, (labels + 1) % V, (labels + 2) % V], dim=-1).masked_fill((labels < 0)[..., None], -1)
    return {
        "tpo_loss with a sampling_mask": lambda b: tpo_kernels.tpo_loss(
            _leaf(N, T, V) * 1, labels, scores, group_size=K, sampling_mask=kept, backend=b, **off),
        "fused_linear_tpo_loss with a sampling_mask": lambda b: tpo_kernels.fused_linear_tpo_loss(
            hidden, weight, labels, scores, group_size=K, sampling_mask=kept, backend=b, **off),
        "tpo_loss": lambda b: tpo_kernels.tpo_loss(_leaf(N, T, V) * 1, labels, scores, group_size=K, backend=b, **off),
        "selective_logprobs": lambda b: tpo_kernels.selective_logprobs(_leaf(N, T, V), labels, backend=b, **off).sum(),
        "tpo_loss_from_logprobs": lambda b: tpo_kernels.tpo_loss_from_logprobs(_leaf(N, T), scores, group_size=K,
                                                                               backend=b, **off),
        "token_tpo_loss": lambda b: tpo_kernels.token_tpo_loss(_leaf(R, V), candidates, cand_scores, backend=b, **off),
        "fused_linear_token_tpo_loss": lambda b: tpo_kernels.fused_linear_token_tpo_loss(
            _leaf(R, H), weight, candidates, cand_scores, bias=bias, backend=b, **off),
        "fused_linear_tpo_loss": lambda b: tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores,
                                                                             group_size=K, backend=b, **off),
        # Without the default logits cache of a small vocabulary: the backward op that keeps no cache.
        "fused_linear_logprobs": lambda b: tpo_kernels.fused_linear_logprobs(hidden, weight, labels, backend=b,
                                                                             tile_policy=uncached, **off).sum(),
    }


def _read_backs_per_op(backend):
    recorder = ReadBacksPerOp()
    for call in _calls().values():
        with recorder:
            call(backend).backward()
    return dict(recorder.per_op)


def _ops():
    return sorted(name for name in OPDEFS if name.startswith("tpo_kernels::"))


def _tags(name):
    return getattr(torch.ops.tpo_kernels, name.split("::")[1]).default.tags


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_the_public_functions_reach_every_custom_op(backend):
    assert sorted(_read_backs_per_op(backend)) == _ops()


@needs_tag
@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_ops_that_read_back_are_cudagraph_unsafe(backend):
    syncing = {name for name, reads in _read_backs_per_op(backend).items() if reads}
    assert syncing  # the fused-linear ops read back: the recorder sees them
    for name in sorted(syncing):
        assert CUDAGRAPH_UNSAFE in _tags(name), name


@needs_tag
@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_ops_without_read_backs_stay_capturable(backend):
    sync_free = {name for name, reads in _read_backs_per_op(backend).items() if not reads}
    assert "tpo_kernels::logprobs" in sync_free and "tpo_kernels::group_targets" in sync_free
    for name in sorted(sync_free):
        assert CUDAGRAPH_UNSAFE not in _tags(name), name


def test_the_tagged_ops_are_the_documented_ones():
    """README's compile section names the paths these ops serve."""
    tagged = {name for name in _ops() if CUDAGRAPH_UNSAFE is not None and CUDAGRAPH_UNSAFE in _tags(name)}
    expected = {"tpo_kernels::linear_logprobs", "tpo_kernels::linear_logprobs_backward",
                "tpo_kernels::linear_logprobs_backward_", "tpo_kernels::linear_candidate_logits_backward",
                "tpo_kernels::linear_kept_logits_backward"}
    assert tagged == (expected if host_sync_tags() else set())


def test_no_tags_where_torch_lacks_the_tag(monkeypatch):
    """Older torch (the package supports torch >= 2.4) has no ``cudagraph_unsafe`` tag: no tags."""
    from tpo_kernels.ops import _tags

    monkeypatch.setattr(_tags, "CUDAGRAPH_UNSAFE", None)
    assert _tags.host_sync_tags() == {}


def test_no_tags_where_custom_op_takes_none(monkeypatch):
    """torch 2.4's ``custom_op`` has no ``tags=`` keyword: none is passed (it would be a TypeError)."""
    from tpo_kernels.ops import _tags

    def custom_op_of_torch_2_4(name, fn=None, /, *, mutates_args, device_types=None, schema=None):
        raise AssertionError("not called")

    monkeypatch.setattr(_tags, "CUDAGRAPH_UNSAFE", object())
    monkeypatch.setattr(torch.library, "custom_op", custom_op_of_torch_2_4)
    assert _tags.host_sync_tags() == {}
