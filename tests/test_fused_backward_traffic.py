"""The fused head's backward at the GEMM floor: each ``dW`` vocabulary block is
one matmul over every active row written straight into ``dW`` in the weight's dtype, so a bf16
head's backward allocates no fp32 ``[block, H]`` accumulator and fills no ``dW``-sized tensor;
and the traffic account (:func:`tpo_kernels.ops.tiles.traffic_account`) on hand-computed plans."""

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tpo_kernels import TilePolicy, fused_linear_tpo_loss
from tpo_kernels.ops.tiles import backward_plan, traffic_account

from _backends import DEVICE, DEVICE_BACKENDS
from test_fused_linear import BF16_TOL, MatmulRecorder, _check_tpo

TOKENS, HIDDEN, VOCAB, CHUNK = 48, 32, 1000, 16  # a tile of 16 * 1000 logits: 48 rows x 256 vocabulary entries
FILLS = ("aten::zero_", "aten::fill_", "aten::zeros", "aten::zeros_like", "aten::new_zeros", "aten::full",
         "aten::full_like", "aten::new_full")
ALLOCATIONS = ("aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided", "aten::zeros",
               "aten::new_zeros", "aten::full")
FLOAT32 = 6  # torch's ScalarType code of float32, as the profiler records a dtype argument


def _sequence_batch(dtype=torch.bfloat16, vocab=VOCAB):
    """A bf16 head over TOKENS tokens in 6 groups of 2 completions of 4 tokens, every group with signal."""
    generator = torch.Generator().manual_seed(3)
    h = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=torch.float64)
    w = torch.randn(vocab, HIDDEN, generator=generator, dtype=torch.float64) * 0.3
    labels = torch.randint(0, vocab, (TOKENS,), generator=generator)
    scores = torch.arange(12, dtype=torch.float32)  # distinct: no tied group, every row has a gradient
    cu_seqlens = torch.arange(0, TOKENS + 1, 4, dtype=torch.int32)
    return (h.to(DEVICE, dtype), w.to(DEVICE, dtype), labels.to(DEVICE), scores.to(DEVICE),
            dict(cu_seqlens=cu_seqlens.to(DEVICE), group_size=2))


def _given_cache_only() -> TilePolicy:
    """The device's policy with no logits cache unless a budget is given (V=1000 is a small
    vocabulary, which keeps every token's logits by default)."""
    return dataclasses.replace(TilePolicy.for_device(DEVICE), small_vocab=0)


def _backward_events(backend, cache_bytes):
    h, w, labels, scores, kwargs = _sequence_batch()
    h.requires_grad_(True)
    w.requires_grad_(True)
    loss = fused_linear_tpo_loss(h, w, labels, scores, backend=backend, chunk_size=CHUNK,
                                 logits_cache_bytes=cache_bytes, tile_policy=_given_cache_only(), **kwargs)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss.backward()
    assert w.grad is not None and torch.isfinite(w.grad.float()).all()
    return prof.events()


def _size_of(event):
    """The size a fill or an allocation event makes (its tensor's shape or its size argument)."""
    if event.input_shapes and event.input_shapes[0]:
        return list(event.input_shapes[0])
    first = event.concrete_inputs[0] if event.concrete_inputs else None
    return list(first) if isinstance(first, (list, tuple)) else []


def _weight_sized(size):
    """[k, H] with k rows of the vocabulary (hidden-state tensors have TOKENS rows)."""
    return len(size) == 2 and size[1] == HIDDEN and size[0] != TOKENS


@pytest.mark.parametrize("cache_bytes", [0, TOKENS * VOCAB * 2], ids=["recomputed", "cached"])
@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_bf16_backward_fills_no_weight_sized_tensor(backend, cache_bytes):
    fills = [(e.name, _size_of(e)) for e in _backward_events(backend, cache_bytes) if e.name in FILLS]
    assert not [f for f in fills if _weight_sized(f[1])], fills


@pytest.mark.parametrize("cache_bytes", [0, TOKENS * VOCAB * 2], ids=["recomputed", "cached"])
@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_bf16_backward_allocates_no_fp32_weight_block(backend, cache_bytes):
    fp32 = [(e.name, _size_of(e)) for e in _backward_events(backend, cache_bytes)
            if e.name in ALLOCATIONS and e.concrete_inputs and FLOAT32 in e.concrete_inputs[1:3]]
    assert not [a for a in fp32 if _weight_sized(a[1])], fp32


@pytest.mark.parametrize("cache_bytes", [0, TOKENS * VOCAB * 2], ids=["recomputed", "cached"])
@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_bf16_one_gemm_blocks_match_reference(backend, cache_bytes):
    """Recomputed: four vocabulary blocks, each dW block one matmul over the 48 rows (the recorder
    sees [256, 48] x [48, H] products). Cached: the backward runs in the cache, dW one matmul over
    the whole vocabulary ([1000, 48] x [48, H]). Both within the bf16 tolerance of the reference."""
    h, w, labels, scores, kwargs = _sequence_batch()
    with MatmulRecorder() as recorder:
        _check_tpo(backend, h, w, None, labels, scores, kwargs, BF16_TOL, reference_dtype=torch.bfloat16,
                   chunk_size=CHUNK, logits_cache_bytes=cache_bytes, tile_policy=_given_cache_only())
    assert [(VOCAB if cache_bytes else 256, TOKENS), (TOKENS, HIDDEN)] in recorder.shapes


def _plan(one_gemm=True, rows=64, grad_accum_dtype=torch.float32, policy=None):
    return backward_plan(rows, VOCAB, HIDDEN, CHUNK, policy or TilePolicy.for_device("cpu"), torch.bfloat16,
                         torch.bfloat16, grad_accum_dtype, one_gemm=one_gemm)


def test_plan_takes_every_row_in_blocks_of_the_budget():
    # 16 * 1000 logits over 64 rows: 250 vocabulary entries, 128 aligned: 7 x 128 + 104.
    plan = _plan()
    assert (plan.one_gemm, plan.token_chunks, plan.vocab_block, plan.block_accumulator) == (True, [64], 128, False)
    assert plan.vocab_blocks == [128] * 7 + [104]
    # Before: 125 rows a chunk, an fp32 block accumulator, dW zero-filled.
    old = _plan(one_gemm=False)
    assert (old.token_chunks, old.vocab_block, old.block_accumulator, old.zero_filled) == ([64], 128, True, True)


def test_plan_keeps_fp64_accumulation_over_chunks():
    """A sum over rows in fp64 is wider than a matmul's fp32 accumulator: token chunks summed in fp64."""
    plan = backward_plan(64, VOCAB, HIDDEN, CHUNK, TilePolicy.for_device("cpu"), torch.float32, torch.float32,
                         torch.float64)
    assert not plan.one_gemm and plan.block_accumulator


SHORT_TILES = dataclasses.replace(TilePolicy.for_device("cpu"), min_tile_tokens=100)


def test_plan_chunks_tokens_when_a_block_of_128_does_not_fit():
    """16000 // 200 = 80 < 128 entries a block: tiles of at least 100 rows, 160 -> 128 entries,
    16000 // 128 = 125 rows a chunk, 200 rows as 100 + 100, dW summed over them in fp32."""
    plan = _plan(rows=200, policy=SHORT_TILES)
    assert (plan.one_gemm, plan.token_chunks, plan.vocab_block, plan.block_accumulator) == (False, [100, 100], 128, True)


def test_traffic_account_of_a_small_plan_by_hand():
    """64 rows, H=32, V=1000, bf16 (2 bytes), fp32 dH over 8 blocks, product -> convert -> add (CPU)."""
    rows_h, vocab_h = 64 * 32, 1000 * 32  # dH and dW entries
    account = traffic_account(_plan(), HIDDEN, torch.bfloat16, torch.float32, out_dtype_matmul=False, cached=False,
                              forward_blocks=1)
    assert account["forward"] == {"row forward: read the logits": 64 * 1000 * 2,
                                  "row forward: per-row summaries": 64 * 3 * 4, "total": 128000 + 768}
    # Per block, dH += dz @ W[block]: product 2048 x 2, convert 2048 x (2 + 4), add 3 x 2048 x 4 = 40960 bytes.
    new = account["backward"]
    assert new == {"row backward: read the logits, write dz": 256000, "dH: zero fill": rows_h * 4,
                   "dH: accumulate over blocks": 8 * 40960, "dH: convert": rows_h * 6, "dW: zero fill": 0,
                   "dW: write": vocab_h * 2, "floor: one write of dH and dW": -(rows_h + vocab_h) * 2,
                   "total": 256000 + 8192 + 327680 + 12288 + 64000 - 68096}
    old = traffic_account(_plan(one_gemm=False), HIDDEN, torch.bfloat16, torch.float32, out_dtype_matmul=False,
                          cached=False, forward_blocks=1)["backward"]
    # dW: zeros_like (2 bytes), fp32 block fill, one chunk's product -> convert -> add, fp32 -> bf16.
    assert old["dW: zero fill"] == 64000 and old["dW: block accumulator fill"] == 128000
    assert old["dW: accumulate over chunks"] == 64000 + 192000 + 384000
    assert old["dW: convert"] == 192000
    assert old["total"] == new["total"] - 64000 + 64000 + 128000 + 640000 + 192000


def test_traffic_account_with_out_dtype_matmuls_and_chunks():
    """200 rows in 2 chunks of 100 (GPU-like out_dtype accumulation): each chunk's matmul reads
    and writes the fp32 block accumulator."""
    old = _plan(one_gemm=False, rows=200, policy=SHORT_TILES)
    assert old.token_chunks == [100, 100] and old.vocab_block == 128
    backward = traffic_account(old, HIDDEN, torch.bfloat16, torch.float32, out_dtype_matmul=True, cached=True,
                               forward_blocks=1)["backward"]
    assert backward["dW: accumulate over chunks"] == 2 * 2 * 1000 * 32 * 4
    assert backward["dH: accumulate over blocks"] == 8 * 2 * 200 * 32 * 4


def test_policy_change_reaches_the_plan():
    narrow = dataclasses.replace(TilePolicy.for_device("cpu"), accum_bytes=100 * HIDDEN * 4)
    assert _plan(policy=narrow).vocab_block == 100  # the documented per-block bound of a wider grad_accum_dtype
    assert _plan(policy=narrow, grad_accum_dtype=torch.bfloat16).vocab_block == 128
