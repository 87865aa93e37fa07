"""The entropy bonus of the sequence-level losses (``entropy_coef``): ``TPO - c * H`` with ``H``
the counted tokens' mean entropy (reduced as the KL term is), its entropy and gradient from the
loss's own vocabulary pass.

Checked against ``reference.tpo_loss(..., entropy_coef=c)`` in float64 (full-vocab entropy,
ordinary autograd) on every backend that runs here, for logits and the fused head, fp32 and
bf16; gradcheck in float64; ``entropy_coef=0`` is bit for bit the loss without the keyword; the
row op is called once, with the entropy, and no ``[tokens, vocab]`` tensor appears on the fused
path; the keyword is validated; the module forms take it; a call split over 2 and 3 gloo ranks
(groups over ``process_group``, the vocabulary over ``vocab_parallel_group``) equals one rank on
the whole batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

import tpo_kernels
from tpo_kernels import TilePolicy, fused_linear_tpo_loss, reference, tpo_loss
from tpo_kernels.ops import RowRequest

from _backends import ALL_BACKENDS, DEVICE, backend_params
from _batches import make_batch
from _dispatch import OpRecorder, OutputSizes

VOCAB, HIDDEN = 37, 16
COEF = 0.3
# fp32: the same fp32 logits as the float64 reference; only the summation order differs.
FP32_TOL = dict(atol=5e-5, rtol=2e-4)
# bf16: both sides read the same bf16 logits (exact in float64); the kernels compute in fp32 and
# round the logits gradient to bf16 (8 mantissa bits: a relative error up to 2^-9 per entry).
BF16_LOGITS_TOL = dict(atol=1e-3, rtol=8e-3)
# bf16 fused head: the fused path also rounds its logits tiles and matmul products to bf16 and
# sums dW over tiles; the reference multiplies the bf16 values in float64.
BF16_FUSED_TOL = dict(atol=3e-2, rtol=3e-2)
TOL = {torch.float32: FP32_TOL, torch.bfloat16: BF16_LOGITS_TOL}

REDUCTIONS = ["mean", "sum", "none"]


def _weighted(loss: torch.Tensor) -> torch.Tensor:
    """A scalar with a different weight per group, so reduction="none" checks every group."""
    weights = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype, device=loss.device).view(loss.shape)
    return (loss * weights).sum()


def _logits_case(backend, dtype, reduction, layout="padded", grouping="size", **extra):
    """(loss, grad, reference loss, reference grad) of tpo_loss with the entropy bonus."""
    logits, labels, scores, kwargs = make_batch(layout=layout, grouping=grouping, vocab=VOCAB, dtype=dtype,
                                                tie_groups=1)
    kwargs.update(reduction=reduction, entropy_coef=COEF, temperature=0.8, **extra)
    leaf = logits.detach().clone().requires_grad_(True)
    loss = tpo_loss(leaf * 1.0, labels, scores, backend=backend, **kwargs)  # non-leaf: in-place backward too
    (grad,) = torch.autograd.grad(_weighted(loss), leaf)
    ref_leaf = logits.detach().to(torch.float64).requires_grad_(True)
    ref_loss = reference.tpo_loss(ref_leaf, labels, scores.to(torch.float64), **kwargs)
    (ref_grad,) = torch.autograd.grad(_weighted(ref_loss), ref_leaf)
    return loss.detach(), grad, ref_loss.detach(), ref_grad


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_logits_gradient_matches_float64_reference(backend, dtype, reduction):
    loss, grad, ref_loss, ref_grad = _logits_case(backend, dtype, reduction)
    torch.testing.assert_close(loss.double(), ref_loss, **TOL[dtype])
    torch.testing.assert_close(grad.double(), ref_grad, **TOL[dtype])


@pytest.mark.parametrize("backend", backend_params("torch", "cpu"))
@pytest.mark.parametrize("extra", [dict(old_logprobs="token", beta=0.1), dict(length_normalize=True)],
                         ids=["old_kl", "length_normalize"])
def test_logits_packed_ids_with_the_other_terms(backend, extra):
    """The bonus beside the KL term, old log-probs and length normalization, packed, by ids."""
    extra = dict(extra)
    old = extra.pop("old_logprobs", None)
    logits, labels, scores, kwargs = make_batch(layout="packed", grouping="ids", vocab=VOCAB, old=old,
                                                with_ref=old is not None)
    kwargs.update(entropy_coef=COEF, **extra)
    leaf = logits.detach().clone().requires_grad_(True)
    loss = tpo_loss(leaf, labels, scores, backend=backend, **kwargs)
    (grad,) = torch.autograd.grad(loss, leaf)
    ref_leaf = logits.detach().double().requires_grad_(True)
    ref_loss = reference.tpo_loss(ref_leaf, labels, scores.double(), **kwargs)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_leaf)
    torch.testing.assert_close(loss.double(), ref_loss.detach(), **FP32_TOL)
    torch.testing.assert_close(grad.double(), ref_grad, **FP32_TOL)


def _fused_case(backend, dtype, reduction, **fused_kwargs):
    _, labels, scores, kwargs = make_batch(vocab=VOCAB, dtype=torch.float32, tie_groups=1)
    gen = torch.Generator().manual_seed(11)
    h = torch.randn(*labels.shape, HIDDEN, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    w = (torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) * 0.5).to(DEVICE, dtype)
    b = torch.randn(VOCAB, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    kwargs.update(reduction=reduction, entropy_coef=COEF, temperature=0.8)
    leaves = [t.detach().clone().requires_grad_(True) for t in (h, w, b)]
    loss = fused_linear_tpo_loss(leaves[0], leaves[1], labels, scores, bias=leaves[2], backend=backend, chunk_size=4,
                                 **kwargs, **fused_kwargs)
    grads = torch.autograd.grad(_weighted(loss), leaves)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (h, w, b)]
    logits = ref_leaves[0] @ ref_leaves[1].T + ref_leaves[2]
    ref_loss = reference.tpo_loss(logits, labels, scores.double(), **kwargs)
    ref_grads = torch.autograd.grad(_weighted(ref_loss), ref_leaves)
    return loss.detach(), grads, ref_loss.detach(), ref_grads


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_head_gradient_matches_float64_reference(backend, dtype, reduction):
    tol = FP32_TOL if dtype == torch.float32 else BF16_FUSED_TOL
    loss, grads, ref_loss, ref_grads = _fused_case(backend, dtype, reduction)
    torch.testing.assert_close(loss.double(), ref_loss, **tol)
    for name, grad, ref_grad in zip(("hidden", "weight", "bias"), grads, ref_grads):
        torch.testing.assert_close(grad.double(), ref_grad, **tol, msg=lambda m, n=name: f"grad of {n}: {m}")


@pytest.mark.parametrize("backend", backend_params("torch", "cpu"))
def test_fused_head_with_a_logits_cache_matches_reference(backend):
    """With a logits cache, tied groups' tokens are not left out of it: the bonus gives every
    counted token a gradient (a tied on-policy group has a zero group gradient but not a zero
    entropy gradient)."""
    loss, grads, ref_loss, ref_grads = _fused_case(backend, torch.float32, "mean", logits_cache_bytes=1 << 20)
    torch.testing.assert_close(loss.double(), ref_loss, **FP32_TOL)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad.double(), ref_grad, **FP32_TOL)


GRADCHECK_BACKENDS = backend_params("torch", "cpu", "triton")


@pytest.mark.parametrize("backend", GRADCHECK_BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_logits_gradcheck_float64(backend, reduction):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 6, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_(True)
    labels = torch.randint(0, 6, (4, 3), generator=gen).to(DEVICE)
    labels[1, 2] = -100
    scores = torch.randn(4, generator=gen, dtype=torch.float64).to(DEVICE)
    # On-policy q is built from the log-probs themselves (held constant): gradcheck needs q fixed.
    old = (-torch.rand(4, generator=gen, dtype=torch.float64) * 4).to(DEVICE)
    assert torch.autograd.gradcheck(
        lambda x: tpo_loss(x, labels, scores, group_size=2, old_logprobs=old, entropy_coef=0.7, temperature=0.9,
                           reduction=reduction, backend=backend),
        (logits,), eps=1e-6, atol=1e-7, fast_mode=backend == "triton",
    )


@pytest.mark.parametrize("backend", GRADCHECK_BACKENDS)
def test_fused_head_gradcheck_float64(backend):
    gen = torch.Generator().manual_seed(5)
    inputs = tuple(torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_(True)
                   for shape in ((4, 2, 5), (7, 5), (7,)))
    labels = torch.randint(0, 7, (4, 2), generator=gen).to(DEVICE)
    scores = torch.randn(4, generator=gen, dtype=torch.float64).to(DEVICE)
    old = (-torch.rand(4, generator=gen, dtype=torch.float64) * 4).to(DEVICE)
    assert torch.autograd.gradcheck(
        lambda h, w, b: fused_linear_tpo_loss(h, w, labels, scores, bias=b, group_size=2, old_logprobs=old,
                                              entropy_coef=0.7, backend=backend, chunk_size=3),
        inputs, eps=1e-6, atol=1e-7, fast_mode=backend == "triton",
    )


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("path", ["logits", "fused"])
def test_zero_coefficient_is_bitwise_the_loss_without_it(backend, path):
    """entropy_coef=0 adds nothing, not even a rounding: loss and gradients bit for bit."""
    logits, labels, scores, kwargs = make_batch(vocab=VOCAB, old="token", with_ref=True, group_size=2, max_len=3)
    hidden = torch.randn(*labels.shape, HIDDEN, device=DEVICE)
    weight = torch.randn(VOCAB, HIDDEN, device=DEVICE) * 0.5

    def run(**extra):
        if path == "logits":
            leaf = logits.detach().clone().requires_grad_(True)
            loss = tpo_loss(leaf, labels, scores, backend=backend, **kwargs, **extra)
            return loss, torch.autograd.grad(loss, leaf)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = fused_linear_tpo_loss(h, w, labels, scores, backend=backend, chunk_size=4, **kwargs, **extra)
        return loss, torch.autograd.grad(loss, (h, w))

    loss, grads = run()
    for zero in (0.0, 0):
        zero_loss, zero_grads = run(entropy_coef=zero)
        assert torch.equal(zero_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(zero_grads, grads))


class _RowOpCalls(OpRecorder):
    """The tpo_kernels row ops called, with whether their request asks for the entropy."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def record(self, func, args, kwargs, out):
        name = func._schema.name
        if name in ("tpo_kernels::logprobs", "tpo_kernels::linear_logprobs"):
            request = RowRequest.from_op(args[4] if name.endswith("linear_logprobs") else args[2])
            self.calls.append((name, request.wants("entropy")))


def test_one_vocabulary_pass_reads_the_entropy():
    """The bonus asks the one row op for the entropy; nothing else reads the vocabulary."""
    logits, labels, scores, kwargs = make_batch(vocab=VOCAB)
    with _RowOpCalls() as recorder:
        tpo_loss(logits, labels, scores, entropy_coef=COEF, backend="torch", **kwargs)
    assert recorder.calls == [("tpo_kernels::logprobs", True)]
    hidden, weight = torch.randn(*labels.shape, HIDDEN), torch.randn(VOCAB, HIDDEN)
    with _RowOpCalls() as recorder:
        fused_linear_tpo_loss(hidden, weight, labels, scores, entropy_coef=COEF, backend="torch", **kwargs)
    assert recorder.calls == [("tpo_kernels::linear_logprobs", True)]


def test_fused_head_never_holds_a_tokens_by_vocabulary_tensor():
    _, labels, scores, kwargs = make_batch(vocab=VOCAB, num_groups=4, max_len=8)
    tokens = labels.numel()
    hidden = torch.randn(*labels.shape, HIDDEN, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, requires_grad=True)
    # The minimal-memory path (a vocabulary this small keeps its logits by default: TilePolicy.small_vocab).
    policy = dataclasses.replace(TilePolicy.for_device("cpu"), small_vocab=0)
    with OutputSizes() as sizes:
        loss = fused_linear_tpo_loss(hidden, weight, labels, scores, entropy_coef=COEF, backend="torch", chunk_size=4,
                                     tile_policy=policy, **kwargs)
        loss.backward()
    assert sizes.largest < tokens * VOCAB, (sizes.largest, tokens * VOCAB)


@pytest.mark.parametrize("value, error, fragment", [
    (-0.1, ValueError, "entropy_coef must be a finite number >= 0"),
    (math.inf, ValueError, "entropy_coef must be a finite number >= 0"),
    (math.nan, ValueError, "entropy_coef must be a finite number >= 0"),
    ("0.1", TypeError, "entropy_coef must be a number"),
    (True, TypeError, "entropy_coef must be a number"),
    (torch.tensor(0.1), TypeError, "entropy_coef must be a number"),
], ids=["negative", "inf", "nan", "str", "bool", "tensor"])
@pytest.mark.parametrize("path", ["logits", "fused"])
def test_bad_coefficient_is_refused_naming_it(value, error, fragment, path):
    logits, labels, scores, kwargs = make_batch(vocab=VOCAB)
    with pytest.raises(error, match=fragment):
        if path == "logits":
            tpo_loss(logits, labels, scores, entropy_coef=value, **kwargs)
        else:
            fused_linear_tpo_loss(torch.randn(*labels.shape, HIDDEN), torch.randn(VOCAB, HIDDEN), labels, scores,
                                  entropy_coef=value, **kwargs)


def test_numpy_coefficient_is_accepted():
    import numpy as np

    logits, labels, scores, kwargs = make_batch(vocab=VOCAB)
    assert torch.equal(tpo_loss(logits, labels, scores, entropy_coef=np.float32(0.25), **kwargs),
                       tpo_loss(logits, labels, scores, entropy_coef=0.25, **kwargs))


def test_the_logprobs_loss_has_no_vocabulary_pass_and_no_keyword():
    """tpo_loss_from_logprobs sees no vocabulary: it has no entropy to weigh (a TypeError, not a
    silently ignored bonus)."""
    with pytest.raises(TypeError, match="entropy_coef"):
        tpo_kernels.tpo_loss_from_logprobs(-torch.rand(4, 3), torch.randn(4), group_size=2, entropy_coef=0.1)


@pytest.mark.parametrize("module_type, args", [
    (tpo_kernels.TPOLoss, "logits"), (tpo_kernels.FusedLinearTPOLoss, "fused")])
def test_module_forms_take_the_coefficient(module_type, args):
    logits, labels, scores, kwargs = make_batch(vocab=VOCAB)
    tensors = (logits,) if args == "logits" else (torch.randn(*labels.shape, HIDDEN), torch.randn(VOCAB, HIDDEN))
    function = tpo_loss if args == "logits" else fused_linear_tpo_loss
    module = module_type(entropy_coef=COEF, backend="torch")
    assert module.entropy_coef == COEF
    expected = function(*tensors, labels, scores, entropy_coef=COEF, backend="torch", **kwargs)
    assert torch.equal(module(*tensors, labels, scores, **kwargs), expected)
    without = function(*tensors, labels, scores, backend="torch", **kwargs)
    assert not torch.equal(expected, without)


def test_the_bonus_is_the_token_mean_entropy_of_the_aux():
    """loss(c) = loss(0) - c * mean of aux["token_entropy"] over the counted tokens, the entropy
    the same pass reports."""
    logits, labels, scores, kwargs = make_batch(vocab=VOCAB, dtype=torch.float64)
    base = tpo_loss(logits, labels, scores, backend="torch", **kwargs)
    loss, aux = tpo_loss(logits, labels, scores, backend="torch", entropy_coef=COEF, return_aux=True,
                         return_entropy=True, **kwargs)
    counted = labels != -100
    mean_entropy = aux["token_entropy"][counted].sum() / counted.sum()
    torch.testing.assert_close(loss, base - COEF * mean_entropy, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- across ranks


def _dp(path, sizes, grouping, **kw):
    return ("dp_case", dict(path=path, sizes=sizes, grouping=grouping, options=dict(entropy_coef=COEF), **kw))


DISTRIBUTED_CASES = {
    2: {
        "dp_logits_mean": _dp("logits", [5, 7], "ids"),
        "dp_fused_sum_kl_cpu": _dp("fused", [6, 4], "ids", reduction="sum", kl=True, backend="cpu"),
        "dp_fused_none_old": _dp("fused", [5, 7], "size", reduction="none", old="token"),
        "vp_loss_fused": ("vp_loss_case", dict(path="fused", options=dict(entropy_coef=COEF))),
        "vp_loss_logits_cpu": ("vp_loss_case", dict(path="logits", backend="cpu", options=dict(entropy_coef=COEF))),
    },
    3: {
        "dp_fused_mean_cpu": _dp("fused", [3, 6, 3], "size", backend="cpu"),
        "dp_logits_none_ids": _dp("logits", [4, 2, 5], "ids", reduction="none", kl=True),
        "vp_loss_fused_rotated": ("vp_loss_case", dict(path="fused", rotate=True, options=dict(entropy_coef=COEF))),
    },
}


@functools.lru_cache(maxsize=None)
def _distributed_results():
    from _distributed import run_ranks
    from _distributed_cases import run_all

    return run_ranks(max(DISTRIBUTED_CASES), run_all, DISTRIBUTED_CASES)


DISTRIBUTED = [(w, n) for w, cases in DISTRIBUTED_CASES.items() for n in cases]


@pytest.mark.parametrize("world,name", DISTRIBUTED, ids=[f"{w}ranks-{n}" for w, n in DISTRIBUTED])
def test_split_over_ranks_equals_one_rank_on_the_whole_batch(world, name):
    """Groups over process_group (the token mean over every rank's tokens) or the vocabulary over
    vocab_parallel_group (the entropy merged from the shards): loss and every gradient as one
    rank gets them on the whole batch."""
    per_rank = [ranks[world][name] for ranks in _distributed_results()[:world]]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank} of {world}, case {name}:\n{result['error']}"
        for what, (got, want) in result["pairs"].items():
            torch.testing.assert_close(got, want, **FP32_TOL, msg=lambda m, r=rank, w=what: f"rank {r}, {w}: {m}")
        assert all(result["zeros"].values()), result["zeros"]
