"""The fused head's logits cache (``logits_cache_bytes``): the forward keeps whole rows of logits
for the backward, which then reads them instead of recomputing them. Cached and uncached results
agree (fp32: to the recompute's rounding, CACHE_TOL; bf16: BF16_CACHE_TOL), cached tokens cost three
matmuls instead of four, zero-signal tokens are never read and take no slot (the slots go to the
tokens of groups with signal), and nothing is kept without a gradient. A backward that does not
keep the graph runs in the cache (each product one matmul); one that keeps it leaves the cache
intact. A small vocabulary (``TilePolicy.small_vocab``) keeps every token's logits by default.

Every head here has a small vocabulary, so the calls without a budget pass a policy without the
default cache (``_uncached``) unless the default is what they test."""

import dataclasses

import pytest
import torch

import tpo_kernels
from tpo_kernels import TilePolicy, fused_linear_logprobs, fused_linear_tpo_loss
from tpo_kernels.ops import RowRequest

from _backends import DEVICE, DEVICE_BACKENDS, INTERPRETED_BACKENDS
from _dispatch import OpRecorder, ReadBacks
from test_fused_linear import (FP32_TOL, HIDDEN, VOCAB, MatmulRecorder, _batch, _check_tpo, _head, _leaves,
                               _loss_and_grads, _uncached)

# A cached row's gradient differs from a recomputed one only by the recompute's rounding (a matmul
# over another block of rows may sum in another order): fp32 rounding of O(1) values.
CACHE_TOL = dict(atol=1e-6, rtol=1e-5)
# bf16 logits: the recomputed tile can round one logit to the neighbouring bf16 value.
BF16_CACHE_TOL = dict(atol=1e-2, rtol=1e-2)
FULL = 1 << 30  # more than any batch here: every counted row is cached


def _row_bytes(dtype=torch.float32) -> int:
    return VOCAB * torch.empty(0, dtype=dtype).element_size()


def _tpo(backend, h, w, b, labels, scores, kwargs, retain_graph=False, **fused):
    """Loss and gradients of the fused loss; the cache only as ``fused`` gives it."""
    fused.setdefault("tile_policy", _uncached())
    return _loss_and_grads(lambda h_, w_, b_: fused_linear_tpo_loss(h_, w_, labels, scores, bias=b_, backend=backend,
                                                                    **kwargs, **fused), h, w, b,
                           retain_graph=retain_graph)


def _assert_results_close(got, want, tol):
    torch.testing.assert_close(got[0], want[0], **tol)
    for g, r in zip(got[1], want[1]):
        torch.testing.assert_close(g.float(), r.float(), **tol)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("cache_rows", [1, 7, None])  # None: every counted row
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_cached_matches_uncached_and_reference(backend, cache_rows, layout, softcap):
    h, w, b, labels, scores, kwargs = _batch(layout=layout, grouping="ids", tie_groups=1)
    kwargs.update(logit_softcap=softcap, temperature=0.8)
    cache = FULL if cache_rows is None else cache_rows * _row_bytes()
    cached = _tpo(backend, h, w, b, labels, scores, kwargs, chunk_size=3, logits_cache_bytes=cache)
    uncached = _tpo(backend, h, w, b, labels, scores, kwargs, chunk_size=3)
    _assert_results_close(cached, uncached, CACHE_TOL)
    _check_tpo(backend, h, w, b, labels, scores, kwargs, FP32_TOL, chunk_size=3, logits_cache_bytes=cache)


@pytest.mark.parametrize("backend", INTERPRETED_BACKENDS)
@pytest.mark.parametrize("cache_rows", [2, None])
def test_interpreted_triton_cached_matches_uncached(backend, cache_rows):
    h, w, b, labels, scores, kwargs = _batch(num_groups=1, group_size=2, max_len=3)
    cache = FULL if cache_rows is None else cache_rows * _row_bytes()
    cached = _tpo(backend, h, w, b, labels, scores, kwargs, chunk_size=2, logits_cache_bytes=cache)
    _assert_results_close(cached, _tpo(backend, h, w, b, labels, scores, kwargs, chunk_size=2), CACHE_TOL)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_bf16_cached_matches_uncached(backend):
    h, w, b, labels, scores, kwargs = _batch(dtype=torch.bfloat16, layout="packed")
    cached = _tpo(backend, h, w, b, labels, scores, kwargs, chunk_size=3, logits_cache_bytes=FULL)
    _assert_results_close(cached, _tpo(backend, h, w, b, labels, scores, kwargs, chunk_size=3), BF16_CACHE_TOL)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("vocab_blocks", [False, True])
def test_entropy_gradient_through_the_cache_matches_uncached(backend, vocab_blocks):
    """fused_linear_logprobs with the entropy's gradient: both row-backward terms read the cache."""
    policy = _uncached(accum_bytes=8 * HIDDEN * 8) if vocab_blocks else _uncached()
    h, w, b, labels, _, _ = _batch(layout="padded")
    weights = torch.randn(2, *labels.shape, device=DEVICE)

    def loss_fn(cache):
        def fn(h_, w_, b_):
            lp, ent = fused_linear_logprobs(h_, w_, labels, bias=b_, return_entropy=True, backend=backend,
                                            chunk_size=4, tile_policy=policy, logits_cache_bytes=cache,
                                            grad_accum_dtype=torch.float64 if vocab_blocks else torch.float32)
            return (lp * weights[0] + ent * weights[1]).sum()
        return fn

    _assert_results_close(_loss_and_grads(loss_fn(FULL), h, w, b), _loss_and_grads(loss_fn(0), h, w, b), CACHE_TOL)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_gradcheck_float64_with_a_partial_cache(backend):
    h, w, b = _leaves(*[torch.randn(*shape, dtype=torch.float64, device=DEVICE) for shape in ((3, 2), (5, 2), (5,))])
    labels = torch.tensor([1, -100, 4], device=DEVICE)

    def fn(h_, w_, b_):
        return fused_linear_logprobs(h_, w_, labels, bias=b_, temperature=1.3, return_entropy=True, backend=backend,
                                     chunk_size=1, logits_cache_bytes=5 * 8)  # one row of float64 logits

    assert torch.autograd.gradcheck(fn, (h, w, b))


def _matmul_work(backend, h, w, b, labels, scores, kwargs, **fused):
    """Multiply-adds of every matmul in one forward and backward, and the loss's aux; the cache
    only as ``fused`` gives it."""
    fused.setdefault("tile_policy", _uncached())
    h, w, b = _leaves(h, w, b)
    with MatmulRecorder() as recorder:
        loss, aux = fused_linear_tpo_loss(h, w, labels, scores, bias=b, backend=backend, chunk_size=4,
                                          return_aux=True, **kwargs, **fused)
        loss.backward()
    return sum(recorder.multiply_adds()), aux, h.grad


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("cache_rows", [0, 5, None])
def test_cached_tokens_cost_three_matmuls(backend, cache_rows):
    """Forward logits of every counted token, dH and dW of every active one, and the recompute of
    the active tokens the cache does not hold: 4 products of [tokens, V] with H uncached, 3 cached.
    Fails when the backward ignores the cache."""
    h, w, b, labels, scores, kwargs = _batch(layout="packed", num_groups=3)  # every group has signal
    counted = int((labels != -100).sum())
    cache = FULL if cache_rows is None else cache_rows * _row_bytes()
    cached = counted if cache_rows is None else cache_rows
    work, _, _ = _matmul_work(backend, h, w, b, labels, scores, kwargs, logits_cache_bytes=cache)
    assert work == (counted + (counted - cached) + 2 * counted) * VOCAB * HIDDEN


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_zero_signal_tokens_are_not_recomputed_with_a_cache(backend):
    """Tied groups' tokens cost the forward only, cached or not; the others three matmuls."""
    h, w, b, labels, scores, kwargs = _batch(layout="packed", num_groups=3, tie_groups=2)
    work, _, grad = _matmul_work(backend, h, w, b, labels, scores, kwargs, logits_cache_bytes=FULL)
    active = _active_tokens(h, w, b, labels, scores, kwargs)
    counted, num_active = int((labels != -100).sum()), int(active.sum())
    assert 0 < num_active < counted
    assert work == (counted + 2 * num_active) * VOCAB * HIDDEN
    assert torch.equal(grad[~active], torch.zeros_like(grad[~active]))


class _PoisonCache(torch.autograd.graph.saved_tensors_hooks):
    """Replaces the rows ``rows`` of the saved ``[rows, V]`` logits cache with NaN when the backward
    unpacks it (no other saved tensor has that shape here)."""

    def __init__(self, cache_shape, rows):
        self.poisoned = 0

        def unpack(t):
            if tuple(t.shape) == cache_shape:
                t = t.clone()
                t[rows] = float("nan")
                self.poisoned += 1
            return t

        super().__init__(lambda t: t, unpack)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_the_backward_reads_the_cache_of_active_rows_only(backend):
    """The active tokens take the cache's first slots, in row order: NaN written over them reaches
    the gradients (the backward reads the cache); over the other slots (the zero-signal tokens',
    without the selection) it changes nothing (they are never read)."""
    h, w, b, labels, scores, kwargs = _batch(layout="packed", num_groups=3, tie_groups=2)
    clean = _tpo(backend, h, w, b, labels, scores, kwargs, chunk_size=4, logits_cache_bytes=FULL)
    active = _active_tokens(h, w, b, labels, scores, kwargs)
    num_active = int(active.sum())
    shape = (labels.numel(), VOCAB)  # a cache of every row
    poison = _PoisonCache(shape, slice(num_active, None))
    with poison:
        rest_poisoned = _tpo(backend, h, w, b, labels, scores, kwargs, chunk_size=4, logits_cache_bytes=FULL)
    assert poison.poisoned == 1
    for got, want in zip(rest_poisoned[1], clean[1]):
        assert torch.equal(got, want)
    with _PoisonCache(shape, slice(0, num_active)):
        active_poisoned = _tpo(backend, h, w, b, labels, scores, kwargs, chunk_size=4, logits_cache_bytes=FULL)
    assert all(torch.isnan(grad).any() for grad in active_poisoned[1])


def _active_tokens(h, w, b, labels, scores, kwargs):
    """[M] bool: the counted tokens of completions with a nonzero coef (aux), packed rows."""
    _, aux = fused_linear_tpo_loss(h, w, labels, scores, bias=b, return_aux=True, **kwargs)
    seq = torch.repeat_interleave(torch.arange(len(scores), device=DEVICE), torch.diff(kwargs["cu_seqlens"].long()))
    return (labels != -100) & (aux["coef"][seq] != 0)


def _check_a_budget_of_the_signal_tokens(backend, chunk_size, **batch):
    """A cache of exactly the signal groups' tokens holds them all (the tied groups come first:
    without the selection their tokens would fill it), so the backward recomputes nothing, and the
    results are the uncached ones."""
    h, w, b, labels, scores, kwargs = _batch(layout="packed", **batch)
    active = _active_tokens(h, w, b, labels, scores, kwargs)
    counted, num_active = int((labels != -100).sum()), int(active.sum())
    assert 0 < num_active < counted
    budget = num_active * _row_bytes()
    work, _, _ = _matmul_work(backend, h, w, b, labels, scores, kwargs, logits_cache_bytes=budget)
    assert work == (counted + 2 * num_active) * VOCAB * HIDDEN
    cached = _tpo(backend, h, w, b, labels, scores, kwargs, chunk_size=chunk_size, logits_cache_bytes=budget)
    uncached = _tpo(backend, h, w, b, labels, scores, kwargs, chunk_size=chunk_size)
    _assert_results_close(cached, uncached, CACHE_TOL)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("grouping", ["size", "ids"])
def test_a_budget_of_the_signal_tokens_caches_every_one_of_them(backend, grouping):
    """Half the groups tie."""
    _check_a_budget_of_the_signal_tokens(backend, 3, grouping=grouping, num_groups=4, tie_groups=2)


@pytest.mark.parametrize("backend", INTERPRETED_BACKENDS)
def test_interpreted_triton_caches_the_signal_tokens_only(backend):
    _check_a_budget_of_the_signal_tokens(backend, 2, num_groups=2, group_size=2, max_len=3, tie_groups=1)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("signal", ["no anchor", "off-policy", "kl term", "near tie"])
def test_tied_groups_keep_their_slots_when_they_carry_gradient(backend, signal):
    """Tied scores are zero-signal only on-policy with the anchor and without a KL term, and a
    near tie (std <= score_eps) keeps its small signal: then the tied groups' tokens are active
    and a cache of every token leaves nothing to recompute."""
    h, w, b, labels, scores, kwargs = _batch(layout="packed", num_groups=3, tie_groups=2,
                                             old="seq" if signal == "off-policy" else None,
                                             with_ref=signal == "kl term")
    if signal == "no anchor":
        kwargs["anchor"] = False
    if signal == "near tie":  # float64 scores: 1e-9 apart is below fp32's resolution at 0.5
        scores = scores.double() + 1e-9 * torch.arange(len(scores), device=DEVICE)
        kwargs["score_eps"] = 1e-6
    counted = labels != -100
    work, _, grad = _matmul_work(backend, h, w, b, labels, scores, kwargs, logits_cache_bytes=FULL)
    # Active: a nonzero gradient (a member that softmax rounds to p = q = 0 has none).
    active = counted & (grad != 0).any(dim=1)
    tied_rows = int(kwargs["cu_seqlens"][2 * kwargs["group_size"]])  # the two tied groups' tokens
    assert bool(active[:tied_rows].any())
    assert work == (int(counted.sum()) + 2 * int(active.sum())) * VOCAB * HIDDEN


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "no-validate"])
@pytest.mark.parametrize("grouping", ["size", "ids"])
def test_choosing_the_cached_tokens_costs_no_read_back(validate, grouping):
    """With tied groups and a partial cache, the forward and backward read back no more than
    without a cache: the selection runs on the device."""
    h, w, b, labels, scores, kwargs = _batch(layout="padded", grouping=grouping, num_groups=4, tie_groups=2)

    def read_backs(cache):
        h_, w_, b_ = _leaves(h, w, b)
        recorder = ReadBacks()
        with recorder:
            fused_linear_tpo_loss(h_, w_, labels, scores, bias=b_, chunk_size=3, validate=validate,
                                  logits_cache_bytes=cache, tile_policy=_uncached(), **kwargs).backward()
        return recorder.reads

    assert len(read_backs(5 * _row_bytes())) == len(read_backs(0))


class _Allocations(OpRecorder):
    """Shapes of the tensors allocated while active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def record(self, func, args, kwargs, out):
        if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.new_empty.default):
            self.shapes.append(tuple(out.shape))


@pytest.mark.parametrize("cache_rows", [3, None])
def test_the_cache_holds_at_most_the_budget(cache_rows):
    """The budget in whole rows of logits, never more rows than the batch has."""
    h, w, b, labels, scores, kwargs = _batch(layout="padded")
    budget = FULL if cache_rows is None else cache_rows * _row_bytes() + _row_bytes() - 1
    h, w, b = _leaves(h, w, b)
    with _Allocations() as allocations:
        fused_linear_tpo_loss(h, w, labels, scores, bias=b, chunk_size=2, logits_cache_bytes=budget, **kwargs)
    caches = [shape for shape in allocations.shapes if len(shape) == 2 and shape[1] == VOCAB]
    assert caches == [(labels.numel() if cache_rows is None else cache_rows, VOCAB)]


def test_no_cache_without_a_gradient():
    h, w, b, labels, _, _ = _batch(layout="padded")
    with torch.no_grad(), _Allocations() as allocations:
        fused_linear_logprobs(h, w, labels, bias=b, chunk_size=2, logits_cache_bytes=FULL)
    assert [shape for shape in allocations.shapes if len(shape) == 2 and shape[1] == VOCAB] == [(0, VOCAB)]


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("cache_rows", [4, None])  # None: every counted row (the backward may run in the cache)
def test_cached_backward_is_deterministic_and_survives_retain_graph(backend, cache_rows):
    """Backwards that keep the graph leave the cache intact and agree bit for bit; the last one
    (which may overwrite the cache) agrees with them to the cache's tolerance, and bit for bit
    with the same backward of a fresh graph."""
    h, w, b, labels, scores, kwargs = _batch(layout="packed", tie_groups=1)
    cache = FULL if cache_rows is None else cache_rows * _row_bytes()

    def grads(leaves, loss, retain_graph=False):
        return torch.autograd.grad(loss, leaves, retain_graph=retain_graph)

    def loss_of(h_, w_, b_):
        return fused_linear_tpo_loss(h_, w_, labels, scores, bias=b_, backend=backend, chunk_size=3,
                                     logits_cache_bytes=cache, tile_policy=_uncached(), **kwargs)

    leaves = _leaves(h, w, b)
    loss = loss_of(*leaves)
    first, second, last = grads(leaves, loss, True), grads(leaves, loss, True), grads(leaves, loss)
    fresh_leaves = _leaves(h, w, b)
    fresh = grads(fresh_leaves, loss_of(*fresh_leaves))
    for kept, kept_again, final, final_fresh in zip(first, second, last, fresh):
        assert torch.equal(kept, kept_again)
        assert torch.equal(final, final_fresh)
        torch.testing.assert_close(final, kept, **CACHE_TOL)


def _saved_cache_and_loss(backend, h, w, b, labels, scores, kwargs):
    """A loss with a cache of every counted row, and that cache as autograd saved it."""
    saved = []

    def pack(t):
        if tuple(t.shape) == (labels.numel(), VOCAB):  # no other saved tensor has that shape here
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fused_linear_tpo_loss(h, w, labels, scores, bias=b, backend=backend, chunk_size=3,
                                     logits_cache_bytes=FULL, tile_policy=_uncached(), **kwargs)
    (cache,) = saved
    return cache, loss


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_the_backward_overwrites_the_cache_only_when_the_graph_is_not_kept(backend):
    """The saved cache holds the counted rows' logits, in row order, after a backward that keeps
    the graph; a backward that does not turns it into dz in place (no dz buffer)."""
    h, w, b, labels, scores, kwargs = _batch(layout="packed", num_groups=3)
    h, w, b = _leaves(h, w, b)
    cache, loss = _saved_cache_and_loss(backend, h, w, b, labels, scores, kwargs)
    counted = labels.reshape(-1) != -100
    logits = (h.reshape(-1, HIDDEN) @ w.T + b).detach()[counted]
    written = cache[:logits.shape[0]].detach()  # the slots past the counted rows are never written
    torch.testing.assert_close(written, logits, **CACHE_TOL)
    kept = written.clone()
    torch.autograd.grad(loss, (h, w, b), retain_graph=True)
    assert torch.equal(written, kept)
    torch.autograd.grad(loss, (h, w, b))
    assert not torch.equal(written, kept)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("budget", ["every token", "default"])
@pytest.mark.parametrize("tie_groups", [0, 1])
def test_a_backward_in_the_cache_runs_each_product_as_one_matmul(backend, budget, tie_groups):
    """Every active row cached: the forward's logits are one matmul into the cache, and dH and dW
    one matmul each over the active rows and the whole vocabulary, however small the tile budget
    (chunk_size=2); the results are the recomputed ones. The default cache of a small vocabulary
    also holds the tied group's tokens (no budget of its own: no prediction), so its active rows
    first move to the cache's front."""
    h, w, b, labels, scores, kwargs = _batch(layout="packed", num_groups=3, tie_groups=tie_groups)
    active = _active_tokens(h, w, b, labels, scores, kwargs).reshape(-1)
    counted, num_active = int((labels != -100).sum()), int(active.sum())
    # The budget of every token caches the signal groups' tokens only (the pipeline's prediction).
    cache = dict(logits_cache_bytes=FULL) if budget == "every token" else dict(tile_policy=None)
    num_cached = num_active if budget == "every token" else counted
    with MatmulRecorder() as recorder:
        leaves = _leaves(h, w, b)
        loss = fused_linear_tpo_loss(*leaves[:2], labels, scores, bias=leaves[2], backend=backend, chunk_size=2,
                                     **kwargs, **{"tile_policy": _uncached(), **cache})
        forward_products = len(recorder.shapes)
        grads = torch.autograd.grad(loss, leaves)
    assert recorder.shapes[0] == [(num_cached, HIDDEN), (HIDDEN, VOCAB)]
    assert recorder.shapes[forward_products:] == [[(num_active, VOCAB), (VOCAB, HIDDEN)],
                                                  [(VOCAB, num_active), (num_active, HIDDEN)]]
    recomputed = _tpo(backend, h, w, b, labels, scores, kwargs, chunk_size=2)
    _assert_results_close((loss.detach(), [g * 0.5 for g in grads]), recomputed, CACHE_TOL)  # _tpo weighs by 0.5


@pytest.mark.parametrize("vocab, cached", [(16384, True), (16385, False)])
def test_the_default_keeps_the_logits_of_a_small_vocabulary_only(vocab, cached):
    """By default every counted token's logits are kept up to ``small_vocab`` = 16384 entries,
    whatever the number of tokens: decided from V alone, so whether a token's logits are cached
    never depends on the rest of its batch. Above it none are (the minimal-memory path)."""
    for tokens in (1, 5):
        h, w = _leaves(*_head((tokens,), hidden=4, vocab=vocab, bias=False)[:2])
        labels = torch.arange(tokens, device=DEVICE)
        with _Allocations() as allocations:
            fused_linear_logprobs(h, w, labels, chunk_size=2)
        caches = [shape for shape in allocations.shapes if len(shape) == 2 and shape[1] == vocab]
        assert caches == [(tokens if cached else 0, vocab)]


@pytest.mark.parametrize("value, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("1", TypeError)])
def test_bad_logits_cache_bytes_is_refused(value, error):
    h, w, b, labels, scores, kwargs = _batch()
    with pytest.raises(error, match="logits_cache_bytes"):
        fused_linear_tpo_loss(h, w, labels, scores, bias=b, logits_cache_bytes=value, **kwargs)
    with pytest.raises(error, match="logits_cache_bytes"):
        fused_linear_logprobs(h, w, labels, bias=b, logits_cache_bytes=value)


def test_keyword_and_policy_field_must_agree():
    h, w, b, labels, _, _ = _batch()
    policy = dataclasses.replace(TilePolicy.for_device(DEVICE), logits_cache_bytes=1 << 20)
    fused_linear_logprobs(h, w, labels, bias=b, tile_policy=policy, logits_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="disagrees with tile_policy.logits_cache_bytes"):
        fused_linear_logprobs(h, w, labels, bias=b, tile_policy=policy, logits_cache_bytes=1 << 21)


def test_a_vocabulary_parallel_head_refuses_the_cache():
    from tpo_kernels.checks import arguments

    with pytest.raises(ValueError, match="vocabulary-parallel"):
        arguments.check_logits_cache(1 << 20, 0, vocab_parallel=True)
    with pytest.raises(ValueError, match="vocabulary-parallel"):
        arguments.check_logits_cache(0, 1 << 20, vocab_parallel=True)


def test_policy_field_alone_turns_the_cache_on():
    h, w, b, labels, scores, kwargs = _batch(layout="packed", num_groups=3)
    counted = int((labels != -100).sum())
    policy = dataclasses.replace(_uncached(), logits_cache_bytes=FULL)
    work, _, _ = _matmul_work("torch", h, w, b, labels, scores, kwargs, tile_policy=policy)
    assert work == 3 * counted * VOCAB * HIDDEN


@pytest.mark.parametrize("cache", [FULL, 4 * _row_bytes()])
def test_fullgraph_compile_with_the_cache_matches_eager(cache):
    """With a tied group, so that the compiled graph chooses the cached tokens too."""
    h, w, b, labels, scores, kwargs = _batch(layout="padded", tie_groups=1)

    def step(h_, w_, b_):
        return fused_linear_tpo_loss(h_, w_, labels, scores, bias=b_, backend="torch", chunk_size=3, validate=False,
                                     logits_cache_bytes=cache, **kwargs)

    # The compiled backward leaves the cache as it is (traced, an in-place op would work on a
    # copy), as an eager backward that keeps the graph does.
    eager = _loss_and_grads(step, h, w, b, retain_graph=True)
    torch._dynamo.reset()
    compiled = _loss_and_grads(torch.compile(step, fullgraph=True, backend="aot_eager"), h, w, b)
    _assert_results_close(compiled, eager, dict(rtol=0, atol=0))


def test_custom_op_with_the_cache_passes_opcheck():
    h = torch.randn(6, HIDDEN, device=DEVICE, requires_grad=True)
    w = torch.randn(VOCAB, HIDDEN, device=DEVICE, requires_grad=True)
    labels = torch.tensor([0, 3, -1, 5, 36, 2], device=DEVICE)
    request = RowRequest(token_fields=("entropy",)).to_op()
    args = (h, w, None, labels, request, 4, 4, 1 << 20, torch.float32, "torch", None, 4 * _row_bytes())
    torch.library.opcheck(tpo_kernels.ops.linear._linear_logprobs, args)
    candidates = torch.tensor([True, True, False, False, True, True], device=DEVICE)  # fills the cache
    torch.library.opcheck(tpo_kernels.ops.linear._linear_logprobs, args + (candidates,))


def test_module_passes_the_cache_on():
    h, w, b, labels, scores, kwargs = _batch(layout="packed", num_groups=3)
    counted = int((labels != -100).sum())
    loss_fn = tpo_kernels.FusedLinearTPOLoss(chunk_size=4, logits_cache_bytes=FULL, backend="torch",
                                             tile_policy=_uncached())
    h, w = _leaves(h, w)
    with MatmulRecorder() as recorder:
        loss_fn(h, w, labels, scores, **kwargs).backward()
    assert sum(recorder.multiply_adds()) == 3 * counted * VOCAB * HIDDEN
