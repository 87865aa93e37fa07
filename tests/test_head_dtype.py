"""The fused head's ``head_dtype`` (``HeadTiles.head_dtype``): logits formed in fp32 from bf16 /
fp16 hidden states and weight, one tile at a time (never an fp32 copy of the whole weight), so
that they are not rounded to the inputs' dtype before the softmax; the gradients come back in the
inputs' dtypes.

Held against an fp32-cast head (the inputs cast to fp32 up front, as an fp32 lm_head would run):
the same logits up to fp32 rounding, hence log-probs within fp32 tolerances, and gradients equal
to that head's rounded to the inputs' dtype (within one of its ulps).
"""

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tpo_kernels.backends.rows import RowSummary
from tpo_kernels.ops import HeadTiles, RowRequest, TilePolicy, linear_logprobs
from tpo_kernels.ops.vocab_shard import shard_linear_logprobs

from _backends import backend_params

M, H, V = 48, 64, 1000
BACKENDS = backend_params("torch", "cpu")
HALF_DTYPES = [torch.bfloat16, torch.float16]
ENTROPY = RowRequest(token_fields=("entropy",))
# A budget of 8 rows of V in tiles of at least 16 rows: several vocabulary blocks, as a large head has.
POLICY = TilePolicy(logits_bytes=0, min_tile_tokens=16, small_vocab=0)


def _tiles(head_dtype=None, policy=POLICY, chunk_size=8):
    return HeadTiles(chunk_size=chunk_size, policy=policy, grad_accum_dtype=torch.float32, head_dtype=head_dtype)


def _inputs(dtype, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(M, H, generator=generator) * 2).to(dtype)
    weight = (torch.randn(V, H, generator=generator) * 0.5).to(dtype)
    b = (torch.randn(V, generator=generator)).to(dtype) if bias else None
    labels = torch.randint(0, V, (M,), generator=generator)
    labels[5] = -1
    upstream = torch.randn(2, M, generator=generator)
    return hidden, weight, b, labels, upstream


def _run(hidden, weight, bias, labels, upstream, backend, tiles, request=ENTROPY):
    """Log-probs, entropies and the gradients of hidden, weight, bias for fixed upstream gradients."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    summary = linear_logprobs(leaves[0], leaves[1], leaves[2] if bias is not None else None, labels,
                              request=request, tiles=tiles, backend=backend)
    loss = (summary.label_logprob * upstream[0]).sum() + (summary.entropy * upstream[1]).sum()
    grads = torch.autograd.grad(loss, leaves)
    return summary.label_logprob.detach(), summary.entropy.detach(), grads


def _ulp_close(actual, expected):
    """``actual`` (a half-precision gradient) equals ``expected`` (fp32) rounded to its dtype, but
    for values at a rounding boundary: within one ulp of the half dtype."""
    eps = torch.finfo(actual.dtype).eps
    torch.testing.assert_close(actual.float(), expected.to(actual.dtype).float(), rtol=eps, atol=1e-6)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_head_matches_an_fp32_cast_head(backend, dtype):
    hidden, weight, bias, labels, upstream = _inputs(dtype)
    lp, ent, grads = _run(hidden, weight, bias, labels, upstream, backend, _tiles(torch.float32))
    lp32, ent32, grads32 = _run(hidden.float(), weight.float(), bias.float(), labels, upstream, backend, _tiles())
    torch.testing.assert_close(lp, lp32, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent32, rtol=1e-5, atol=1e-5)
    for grad, grad32 in zip(grads, grads32):
        _ulp_close(grad, grad32)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_gradients_come_back_in_the_inputs_dtypes(dtype):
    hidden, weight, bias, labels, upstream = _inputs(dtype)
    lp, ent, grads = _run(hidden, weight, bias, labels, upstream, "torch", _tiles(torch.float32))
    assert lp.dtype == ent.dtype == torch.float32
    assert [grad.dtype for grad in grads] == [dtype] * 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_head_is_closer_to_float64_than_a_bf16_head(backend):
    """bf16 logits are rounded before the softmax (about 2^-8 relative: 0.1 nats at a logit of
    25); the fp32 head's are not."""
    hidden, weight, bias, labels, upstream = _inputs(torch.bfloat16)
    hidden = hidden * 4  # logits of std ~ 16: the rounding of bf16 logits shows
    exact, _, _ = _run(hidden.double(), weight.double(), bias.double(), labels, upstream, backend, _tiles())
    plain, _, _ = _run(hidden, weight, bias, labels, upstream, backend, _tiles())
    wide, _, _ = _run(hidden, weight, bias, labels, upstream, backend, _tiles(torch.float32))
    error_plain, error_wide = (plain.double() - exact).abs().max(), (wide.double() - exact).abs().max()
    assert error_wide < 1e-4 < error_plain


def test_no_fp32_copy_of_the_whole_weight():
    """The largest allocation of a forward and backward under ``head_dtype=float32`` is below one
    fp32 copy of the weight (``V * H * 4`` bytes): the weight is cast one vocabulary block at a time."""
    hidden, weight, bias, labels, upstream = _inputs(torch.bfloat16, bias=False)
    # A budget of every row: without the cast's own limit, one block would span the vocabulary.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _run(hidden, weight, None, labels, upstream, "torch", _tiles(torch.float32, chunk_size=M))
    largest = max(event.cpu_memory_usage for event in prof.events() if event.name.startswith("aten::empty"))
    assert 0 < largest < V * H * 4


@pytest.mark.parametrize("cache", [False, True], ids=["recomputed", "cached"])
def test_fp32_head_with_a_logits_cache_and_a_soft_cap(cache):
    """The logits cache holds fp32 logits; the soft cap applies to them; both as the fp32-cast head."""
    hidden, weight, bias, labels, upstream = _inputs(torch.bfloat16)
    policy = dataclasses.replace(POLICY, small_vocab=V if cache else 0)
    request = RowRequest(inv_temperature=1 / 0.9, logit_softcap=30.0, token_fields=("entropy",))
    lp, ent, grads = _run(hidden, weight, bias, labels, upstream, "torch", _tiles(torch.float32, policy), request)
    lp32, ent32, grads32 = _run(hidden.float(), weight.float(), bias.float(), labels, upstream, "torch",
                                _tiles(None, policy), request)
    torch.testing.assert_close(lp, lp32, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent32, rtol=1e-5, atol=1e-5)
    for grad, grad32 in zip(grads, grads32):
        _ulp_close(grad, grad32)


def test_fp32_head_under_batch_invariant_tiles():
    hidden, weight, bias, labels, upstream = _inputs(torch.bfloat16)
    policy = dataclasses.replace(POLICY, batch_invariant=True)
    lp, ent, grads = _run(hidden, weight, bias, labels, upstream, "cpu", _tiles(torch.float32, policy))
    lp32, _, grads32 = _run(hidden.float(), weight.float(), bias.float(), labels, upstream, "cpu", _tiles())
    torch.testing.assert_close(lp, lp32, rtol=1e-5, atol=1e-5)
    assert [grad.dtype for grad in grads] == [torch.bfloat16] * 3
    _ulp_close(grads[0], grads32[0])


@dataclasses.dataclass
class _WholeVocabulary:
    """A vocabulary 'shard' that is the whole vocabulary: the seam's collectives are identities."""

    start: int
    size: int

    def merge(self, summary: RowSummary, inv_temperature: float) -> RowSummary:
        return summary

    def sum_hidden_grad(self, grad_hidden):
        return grad_hidden


def test_vocabulary_shard_takes_the_head_dtype():
    hidden, weight, bias, labels, _ = _inputs(torch.bfloat16)
    request = RowRequest(token_fields=("entropy",))
    seam = _WholeVocabulary(start=0, size=V)
    wide = shard_linear_logprobs(hidden, weight, bias, labels, seam, request=request, tiles=_tiles(torch.float32),
                                 backend="torch")
    cast = shard_linear_logprobs(hidden.float(), weight.float(), bias.float(), labels, seam, request=request,
                                 tiles=_tiles(), backend="torch")
    torch.testing.assert_close(wide.label_logprob, cast.label_logprob, rtol=1e-5, atol=1e-5)


def test_float64_head_over_float32_inputs():
    """``head_dtype=float64``: float64 log-probs (the compute dtype follows the logits'), float32 gradients."""
    hidden, weight, bias, labels, upstream = _inputs(torch.float32)
    lp, ent, grads = _run(hidden, weight, bias, labels, upstream, "torch", _tiles(torch.float64))
    lp64, _, grads64 = _run(hidden.double(), weight.double(), bias.double(), labels, upstream, "torch", _tiles())
    assert lp.dtype == ent.dtype == torch.float64
    torch.testing.assert_close(lp, lp64, rtol=1e-12, atol=1e-12)
    assert [grad.dtype for grad in grads] == [torch.float32] * 3
    for grad, grad64 in zip(grads, grads64):
        torch.testing.assert_close(grad, grad64.float())


def test_a_narrower_head_dtype_changes_nothing():
    """The logits are never narrower than the inputs: ``head_dtype=bfloat16`` over float32 inputs
    is the float32 head, bit for bit (the public functions refuse it; the op promotes)."""
    hidden, weight, bias, labels, upstream = _inputs(torch.float32)
    narrow = _run(hidden, weight, bias, labels, upstream, "torch", _tiles(torch.bfloat16))
    plain = _run(hidden, weight, bias, labels, upstream, "torch", _tiles())
    for a, b in zip(narrow[:2] + tuple(narrow[2]), plain[:2] + tuple(plain[2])):
        assert torch.equal(a, b)
