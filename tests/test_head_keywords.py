"""The public keywords of the fused head's settings: ``head_dtype`` and ``batch_invariant`` on
``fused_linear_logprobs`` and ``fused_linear_tpo_loss`` (and their modules) reach the head's tiles
unchanged (the same bits as the ops-layer call with those tiles), are checked before any work, and
take part in the vocabulary-parallel ranks' agreement. The head's own behaviour under them is
specified in ``test_head_dtype.py`` and ``test_batch_invariance.py``."""

import dataclasses

import pytest
import torch

import tpo_kernels
from tpo_kernels.ops import HeadTiles, RowRequest, TilePolicy, linear_logprobs

from _backends import backend_params

N, T, H, V = 4, 5, 32, 700
BACKENDS = backend_params("torch", "cpu")


def _inputs(dtype=torch.bfloat16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, T, H, generator=generator) * 2).to(dtype)
    weight = (torch.randn(V, H, generator=generator) * 0.5).to(dtype)
    labels = torch.randint(0, V, (N, T), generator=generator)
    labels[1, -2:] = -100
    scores = torch.randn(N, generator=generator)
    return hidden, weight, labels, scores


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dtype_is_the_ops_layers_fp32_head(backend):
    hidden, weight, labels, _ = _inputs()
    public = tpo_kernels.fused_linear_logprobs(hidden, weight, labels, backend=backend, head_dtype=torch.float32)
    policy = TilePolicy.for_device("cpu")
    flat = hidden.reshape(-1, H)
    tiles = HeadTiles(chunk_size=policy.chunk_size(flat.shape[0], V), policy=policy.with_logits_cache(0),
                      grad_accum_dtype=torch.float32, head_dtype=torch.float32)
    counted = labels.reshape(-1).clamp(min=-1).masked_fill(labels.reshape(-1) == -100, -1)
    ops = linear_logprobs(flat, weight, None, counted, request=RowRequest(), tiles=tiles, backend=backend)
    assert torch.equal(public.reshape(-1), ops.label_logprob.masked_fill(counted < 0, 0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dtype_keeps_bf16_logits_from_being_rounded(backend):
    hidden, weight, labels, _ = _inputs()
    exact = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    counted = labels != -100
    bf16_head = tpo_kernels.fused_linear_logprobs(hidden, weight, labels, backend=backend)
    fp32_head = tpo_kernels.fused_linear_logprobs(hidden, weight, labels, backend=backend, head_dtype=torch.float32)
    assert (fp32_head - exact)[counted].abs().max() < 1e-5 < (bf16_head - exact)[counted].abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_gradients_come_back_in_the_inputs_dtype_under_an_fp32_head(backend):
    hidden, weight, labels, scores = _inputs()
    hidden.requires_grad_(), weight.requires_grad_()
    tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores, group_size=2, backend=backend,
                                      head_dtype=torch.float32).backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [1, 3])
def test_batch_invariant_log_probs_of_a_sub_batch_are_the_same_bits(backend, rows):
    hidden, weight, labels, _ = _inputs(torch.float32)
    whole, whole_entropy = tpo_kernels.fused_linear_logprobs(hidden, weight, labels, backend=backend,
                                                             return_entropy=True, batch_invariant=True)
    part, part_entropy = tpo_kernels.fused_linear_logprobs(hidden[:rows], weight, labels[:rows], backend=backend,
                                                           return_entropy=True, batch_invariant=True)
    assert torch.equal(part, whole[:rows]) and torch.equal(part_entropy, whole_entropy[:rows])


def test_batch_invariant_is_the_tile_policys_flag():
    hidden, weight, labels, _ = _inputs(torch.float32)
    policy = dataclasses.replace(TilePolicy.for_device("cpu"), batch_invariant=True)
    keyword = tpo_kernels.fused_linear_logprobs(hidden, weight, labels, backend="torch", batch_invariant=True)
    field = tpo_kernels.fused_linear_logprobs(hidden, weight, labels, backend="torch", tile_policy=policy)
    assert torch.equal(keyword, field)


@pytest.mark.parametrize("head_dtype, error, words", [
    ("float32", TypeError, "head_dtype must be None, torch.float32 or torch.float64, got"),
    (torch.float16, ValueError, "head_dtype must be .* at least the inputs' torch.bfloat16, got torch.float16"),
    (torch.int32, ValueError, "head_dtype must be"),
])
def test_a_head_dtype_that_is_not_a_wide_float_is_refused_naming_it(head_dtype, error, words):
    hidden, weight, labels, _ = _inputs()
    with pytest.raises(error, match=words):
        tpo_kernels.fused_linear_logprobs(hidden, weight, labels, head_dtype=head_dtype)


def test_a_head_dtype_narrower_than_float64_inputs_is_refused():
    hidden, weight, labels, scores = _inputs(torch.float64)
    with pytest.raises(ValueError, match="at least the inputs' torch.float64, got torch.float32"):
        tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores, group_size=2, head_dtype=torch.float32)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_batch_invariant_must_be_a_bool(value):
    hidden, weight, labels, _ = _inputs()
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        tpo_kernels.fused_linear_logprobs(hidden, weight, labels, batch_invariant=value)


def test_the_module_takes_both_settings():
    hidden, weight, labels, scores = _inputs()
    module = tpo_kernels.FusedLinearTPOLoss(head_dtype=torch.float32, batch_invariant=True)
    expected = tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores, group_size=2,
                                                 head_dtype=torch.float32, batch_invariant=True)
    assert torch.equal(module(hidden, weight, labels, scores, group_size=2), expected)
