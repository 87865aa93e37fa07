"""How the fused-linear path cuts its work (tpo_kernels/ops/tiles.py): balanced token chunks,
products added into a wider accumulator by an out_dtype matmul where torch offers it (CUDA) or by
product -> convert -> add (the fallback), chosen through ``TilePolicy.matmul_out_dtype``, and the
process-wide cuBLAS reduced-precision flag, cleared around a half-precision dW matmul, left as the
caller set it when threads run backwards at once."""

import dataclasses
import threading
import time

import pytest
import torch

from tpo_kernels import TilePolicy, fused_linear_tpo_loss
from tpo_kernels.ops.tiles import ROW_ALIGN, add_product, balanced_chunks, full_precision_reduction

from _backends import DEVICE, DEVICE_BACKENDS
from _batches import make_batch
from test_fused_linear import BF16_TOL, MatmulRecorder, _check_tpo, _head, _loss_and_grads


@pytest.mark.parametrize("num_rows, max_rows, sizes", [
    (16384, 8160, [5456, 5456, 5472]),  # was 8160 + 8160 + 64
    (100, 48, [32, 32, 36]),
    (33, 16, [16, 16, 1]),  # at most 16 a chunk: three chunks are needed
    (5, 7, [5]),
    (1000, 999, [500, 500]),  # an unaligned budget: balanced to one row
])
def test_balanced_chunk_sizes(num_rows, max_rows, sizes):
    assert balanced_chunks(num_rows, max_rows) == sizes


@pytest.mark.parametrize("max_rows", [16, 48, 512, 8160, 1, 7, 999])
def test_balanced_chunks_are_fewest_aligned_and_within_the_alignment(max_rows):
    for num_rows in list(range(1, 200)) + [4095, 4096, 4097, 16384, 65537]:
        sizes = balanced_chunks(num_rows, max_rows)
        assert sum(sizes) == num_rows and max(sizes) <= max_rows
        assert len(sizes) == -(-num_rows // max_rows)
        align = ROW_ALIGN if max_rows % ROW_ALIGN == 0 else 1
        assert max(sizes) - min(sizes) <= align
        assert all(size % align == 0 for size in sizes[:-1])


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_tiles_span_balanced_token_chunks(backend):
    """100 tokens at most 48 a tile: the forward's matmuls run on 32 + 32 + 36 rows, not 48 + 48 + 4."""
    labels = torch.randint(0, 37, (100,), device=DEVICE)
    cu_seqlens = torch.arange(0, 101, 25, device=DEVICE, dtype=torch.int32)
    scores = torch.randn(4, device=DEVICE)
    h, w, b = _head(labels.shape)
    policy = dataclasses.replace(TilePolicy.for_device(DEVICE), min_tile_tokens=1)  # the whole vocabulary a tile
    with MatmulRecorder() as recorder:
        fused_linear_tpo_loss(h, w, labels, scores, bias=b, cu_seqlens=cu_seqlens, group_size=2, backend=backend,
                              chunk_size=48, tile_policy=policy)
    assert [operands[0][0] for operands in recorder.shapes] == [32, 32, 36]


def _bf16_accumulation_case():
    _, labels, scores, kwargs = make_batch(vocab=37, old="token")
    return (*_head(labels.shape, torch.bfloat16), labels, scores, kwargs)


def _blocked_policy(**changes) -> TilePolicy:
    """Vocabulary blocks of 10 rows of fp32 dW, so that dW and dH are both summed in fp32 over tiles
    (recomputed: no logits cache, which a vocabulary this small would keep by default)."""
    return dataclasses.replace(TilePolicy.for_device(DEVICE), accum_bytes=10 * 16 * 4, small_vocab=0, **changes)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_product_convert_add_fallback_matches_reference(backend):
    h, w, b, labels, scores, kwargs = _bf16_accumulation_case()
    _check_tpo(backend, h, w, b, labels, scores, kwargs, BF16_TOL, reference_dtype=torch.bfloat16, chunk_size=4,
               tile_policy=_blocked_policy(matmul_out_dtype=False))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_out_dtype_accumulation_matches_reference_and_is_what_auto_picks(backend):
    h, w, b, labels, scores, kwargs = _bf16_accumulation_case()
    assert _blocked_policy().fused_accumulate(DEVICE, torch.bfloat16, torch.float32)
    _check_tpo(backend, h, w, b, labels, scores, kwargs, BF16_TOL, reference_dtype=torch.bfloat16, chunk_size=4,
               tile_policy=_blocked_policy(matmul_out_dtype=True))
    results = [_loss_and_grads(lambda h_, w_, b_: fused_linear_tpo_loss(
        h_, w_, labels, scores, bias=b_, backend=backend, chunk_size=4, tile_policy=_blocked_policy(matmul_out_dtype=m),
        **kwargs), h, w, b) for m in (True, None)]
    for forced, auto in zip(results[0][1], results[1][1]):
        assert torch.equal(forced, auto)


@pytest.mark.gpu
def test_add_product_out_dtype_sums_in_the_wide_dtype():
    a = torch.randn(64, 32, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(32, 48, device=DEVICE, dtype=torch.bfloat16)
    exact = a.double() @ b.double()
    for rows in (slice(8, 72), torch.arange(8, 72, device=DEVICE)):
        out = torch.ones(80, 48, device=DEVICE)
        add_product(out, rows, a, b, fused=True)
        torch.testing.assert_close(out[8:72].double(), exact + 1, atol=1e-4, rtol=1e-5)
        assert torch.equal(out[:8], torch.ones_like(out[:8]))


def test_auto_policy_falls_back_where_torch_has_no_out_dtype_matmul():
    """The default (auto) policy takes the out_dtype matmul exactly where torch runs it (not on
    the CPU in torch 2.13), and never for products already in the accumulator's dtype."""
    policy = TilePolicy.for_device(torch.device("cpu"))
    assert policy.matmul_out_dtype is None
    assert not policy.fused_accumulate(torch.device("cpu"), torch.float32, torch.float32)
    forced = dataclasses.replace(policy, matmul_out_dtype=True)
    assert not forced.fused_accumulate(torch.device("cpu"), torch.float32, torch.float32)
    operand = torch.ones(2, 2, dtype=torch.bfloat16)
    try:
        torch.addmm(torch.zeros(2, 2), operand, operand, out_dtype=torch.float32)
        available = True
    except RuntimeError:
        available = False
    assert policy.fused_accumulate(torch.device("cpu"), torch.bfloat16, torch.float32) == available


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_bf16_blocked_backward_is_deterministic(backend):
    h, w, b, labels, scores, kwargs = _bf16_accumulation_case()
    runs = [_loss_and_grads(lambda h_, w_, b_: fused_linear_tpo_loss(
        h_, w_, labels, scores, bias=b_, backend=backend, chunk_size=3, tile_policy=_blocked_policy(),
        logit_softcap=30.0, **kwargs), h, w, b) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0])
    for first, second in zip(runs[0][1], runs[1][1]):
        assert torch.equal(first, second)


REDUCTION_FLAG = "allow_bf16_reduced_precision_reduction"


def test_reduced_precision_flag_stays_off_and_comes_back_when_threads_overlap():
    """cuBLAS reads the flag process-wide. A thread that enters while another is inside still sees
    it off once the first has left, and the caller's setting is back after both (a save and
    restore per thread leaves it off: the second saves the first's False). The context toggles the
    flag for a CUDA device whether or not one is present, so this runs on any machine."""
    flags, cuda = torch.backends.cuda.matmul, torch.device("cuda")
    caller_setting = getattr(flags, REDUCTION_FLAG)
    first_inside, seen, errors = threading.Event(), {}, []

    def first():
        with full_precision_reduction(cuda, torch.bfloat16):
            first_inside.set()
            time.sleep(0.2)  # the second thread tries to enter meanwhile

    def second():
        first_inside.wait()
        with full_precision_reduction(cuda, torch.bfloat16):
            time.sleep(0.3)  # until after the first thread has left
            seen["inside"] = getattr(flags, REDUCTION_FLAG)

    setattr(flags, REDUCTION_FLAG, True)
    try:
        _run_in_threads([first, second], errors)
        assert not errors and seen["inside"] is False
        assert getattr(flags, REDUCTION_FLAG) is True
    finally:
        setattr(flags, REDUCTION_FLAG, caller_setting)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("cached", [False, True], ids=["recomputed", "default cache"])
def test_backwards_in_two_threads_match_sequential_ones(backend, cached):
    """Two threads running a bf16 head's forward and backward at once (its dW matmuls are the ones
    summed in fp32) get, bit for bit, the results of the same calls run one after the other, and
    the reduced-precision flag ends as the caller set it."""
    h, w, b, labels, scores, kwargs = _bf16_accumulation_case()
    policy = None if cached else dataclasses.replace(TilePolicy.for_device(DEVICE), small_vocab=0)

    def run():
        return _loss_and_grads(lambda h_, w_, b_: fused_linear_tpo_loss(
            h_, w_, labels, scores, bias=b_, backend=backend, chunk_size=4, tile_policy=policy, **kwargs), h, w, b)

    caller_setting = getattr(torch.backends.cuda.matmul, REDUCTION_FLAG)
    sequential, concurrent, errors = [run(), run()], [None, None], []
    _run_in_threads([lambda i=i: concurrent.__setitem__(i, run()) for i in range(2)], errors)
    assert not errors
    for got, want in zip(concurrent, sequential):
        assert torch.equal(got[0], want[0])
        for got_grad, want_grad in zip(got[1], want[1]):
            assert torch.equal(got_grad, want_grad)
    assert getattr(torch.backends.cuda.matmul, REDUCTION_FLAG) == caller_setting


def _run_in_threads(bodies, errors):
    """Runs each body on its own thread, all at once; their exceptions land in ``errors``."""
    def guarded(body):
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(body,)) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
