"""Batch invariance: a completion's per-token log-probs, entropies and per-row gradients (d logits,
d hidden for a given upstream gradient) are the same bits whatever else is in its batch: its
size (the first n of 16 completions), their order, and padding of the time axis.

The logits path (``selective_logprobs``) is invariant as it is. The fused head is under
``TilePolicy(batch_invariant=True)``: tiles of one shape whatever the row count (the last token
chunk zero-padded), and a :meth:`RowSummary.merge` whose ops give the same bits at any position
of a vector. Weight gradients (sums over the batch) are out of scope.
"""

import dataclasses

import pytest
import torch

import tpo_kernels as tk
from tpo_kernels.backends.rows import RowSummary
from tpo_kernels.ops import TilePolicy
from tpo_kernels.ops.tiles import backward_plan, tile_shape

from _backends import backend_params, needs_triton

N, T, H, V = 16, 8, 128, 4096
# Tiles of 64 rows, a budget of 16 rows of V, no logits cache: without batch_invariant the
# vocabulary block of this policy depends on the row count (4096 wide for one completion, 1024
# for sixteen), and the fused head's results differ by up to ~4e-6.
POLICY = TilePolicy(logits_bytes=16 * V * 4, min_tile_tokens=64, small_vocab=0, batch_invariant=True)
BACKENDS = backend_params("torch", "cpu")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def _batch():
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(N, T, H, generator=generator)
    weight = torch.randn(V, H, generator=generator) * 0.3
    labels = torch.randint(0, V, (N, T), generator=generator)
    labels[3, 2] = labels[9, 7] = -100
    upstream = torch.randn(2, N, T, generator=generator)  # fixed gradients of the log-probs, entropies
    return hidden, weight, labels, upstream


def _pad_time(x: torch.Tensor, extra: int, fill) -> torch.Tensor:
    """``x`` with ``extra`` more positions on its time axis (dim 1), filled with ``fill``."""
    return torch.cat([x, x.new_full((x.shape[0], extra, *x.shape[2:]), fill)], dim=1)


def _selections():
    """(name, completion indices, extra time positions) of the sub-batches compared."""
    prefixes = [(f"first{n}", torch.arange(n), 0) for n in range(1, N + 1)]
    generator = torch.Generator().manual_seed(3)
    permuted = [(f"perm{k}", torch.randperm(N, generator=generator)[: 16 - 5 * k], 0) for k in range(3)]
    return prefixes + permuted + [("padded_time", torch.arange(5), 3)]


def _assert_rows_equal(parts, full, index, name):
    """Every result of the sub-batch equals the full batch's rows of the same completions, bit for bit."""
    for part, whole, what in zip(parts, full, ("log-probs", "entropies", "row gradients")):
        if part is None:
            continue
        expected = whole[index]
        assert torch.equal(part[:, :expected.shape[1]], expected), \
            f"{what} of {name} differ from the full batch by {(part[:, :expected.shape[1]] - expected).abs().max():.3g}"


def _check_invariant(run, inputs, labels, upstream):
    """``run(inputs, labels, upstream)`` of every sub-batch (:func:`_selections`) against the full batch's."""
    full = run(inputs, labels, upstream)
    for name, index, extra in _selections():
        h, lab, up = inputs[index], labels[index], upstream[:, index]
        if extra:
            h, lab, up = _pad_time(h, extra, 0.0), _pad_time(lab, extra, -100), torch.stack(
                [_pad_time(u, extra, 0.0) for u in up])
        _assert_rows_equal(run(h, lab, up), full, index, name)


# The logits cache of a small vocabulary (every counted row, padded to the tiles): the backward
# runs in it (no graph kept) or reads it (retain_graph).
CACHES = {"recomputed": (POLICY, False), "cached": (dataclasses.replace(POLICY, small_vocab=V), False),
          "cached_kept_graph": (dataclasses.replace(POLICY, small_vocab=V), True)}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logprobs", "entropy"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_head_results_do_not_depend_on_the_batch(backend, with_entropy, cache, threads):
    _, weight, _, _ = _batch()
    policy, keep_graph = CACHES[cache]

    def run(hidden, labels, upstream):
        hidden = hidden.clone().requires_grad_()
        out = tk.fused_linear_logprobs(hidden, weight, labels, return_entropy=with_entropy, backend=backend,
                                       tile_policy=policy)
        lp, ent = out if with_entropy else (out, None)
        loss = (lp * upstream[0]).sum() + (0 if ent is None else (ent * upstream[1]).sum())
        grad, = torch.autograd.grad(loss, hidden, retain_graph=keep_graph)
        return lp.detach(), None if ent is None else ent.detach(), grad

    hidden, _, labels, upstream = _batch()
    _check_invariant(run, hidden, labels, upstream)


@needs_triton
def test_fused_head_on_triton_does_not_depend_on_the_batch():
    """The Triton row ops (the interpreter without a GPU: a tiny head, two vocabulary blocks of
    tiles of 8 rows)."""
    n, t, h, v = 4, 3, 16, 256
    policy = TilePolicy(logits_bytes=4 * v * 4, min_tile_tokens=8, small_vocab=0, batch_invariant=True)
    generator = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(n, t, h, generator=generator), torch.randn(v, h, generator=generator)
    labels, upstream = torch.randint(0, v, (n, t), generator=generator), torch.randn(2, n, t, generator=generator)

    def run(index):
        x = hidden[index].clone().requires_grad_()
        lp, ent = tk.fused_linear_logprobs(x, weight, labels[index], return_entropy=True, backend="triton",
                                           tile_policy=policy)
        grad, = torch.autograd.grad((lp * upstream[0, index]).sum() + (ent * upstream[1, index]).sum(), x)
        return lp.detach(), ent.detach(), grad

    full = run(torch.arange(n))
    for name, index in [(f"first{k}", torch.arange(k)) for k in range(1, n)] + [("perm", torch.tensor([2, 0, 3, 1]))]:
        _assert_rows_equal(run(index), full, index, name)


@pytest.mark.parametrize("with_entropy", [False, True], ids=["logprobs", "entropy"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_path_results_do_not_depend_on_the_batch(backend, with_entropy, threads):
    hidden, weight, labels, upstream = _batch()
    # A sub-batch's logits are the full batch's rows (a matmul at another shape could round them otherwise).
    full_logits = hidden @ weight.t()

    def run(rows, labels, upstream):
        logits = rows.clone().requires_grad_()
        out = tk.selective_logprobs(logits, labels, return_entropy=with_entropy, backend=backend)
        lp, ent = out if with_entropy else (out, None)
        loss = (lp * upstream[0]).sum() + (0 if ent is None else (ent * upstream[1]).sum())
        grad, = torch.autograd.grad(loss, logits)
        return lp.detach(), None if ent is None else ent.detach(), grad

    _check_invariant(run, full_logits, labels, upstream)


def test_invariant_tiles_do_not_depend_on_the_row_count():
    """The forward's tile and the backward's blocks are one shape for 1 row or 10^5 rows."""
    shapes = {tile_shape(rows, V, H, POLICY.chunk_size(rows, V), POLICY, torch.float32, torch.float32)
              for rows in (1, 7, 64, 1000, 100_000)}
    plans = {(plan.token_block, plan.vocab_block, plan.one_gemm) for plan in (
        backward_plan(rows, V, H, POLICY.chunk_size(rows, V), POLICY, torch.float32, torch.float32, torch.float32)
        for rows in (1, 7, 64, 1000, 100_000))}
    assert shapes == {(64, 1024)}
    assert plans == {(64, 1024, False)}


def test_invariant_chunk_size_is_not_clipped_to_the_batch():
    assert POLICY.chunk_size(3, V) == POLICY.chunk_size(10_000, V) == 16
    assert dataclasses.replace(POLICY, batch_invariant=False).chunk_size(3, V) == 3


def test_batch_invariance_is_off_by_default():
    assert not TilePolicy.for_device("cpu").batch_invariant


def _summaries(rows: int):
    """Two summaries of ``rows`` rows over disjoint ranges: large and small gaps between their
    masses, an empty range (``row_max == -inf``) on either side, the label on either side."""
    generator = torch.Generator().manual_seed(11)

    def one():
        return RowSummary(row_max=torch.randn(rows, generator=generator) * 3,
                          log_sum=torch.rand(rows, generator=generator) * 3,
                          label_logprob=-torch.rand(rows, generator=generator) * 20,
                          entropy=torch.rand(rows, generator=generator) * 8,
                          has_label=torch.rand(rows, generator=generator) < 0.5)

    a, b = one(), one()
    b.has_label &= ~a.has_label
    a.row_max[::17] = float("-inf")
    b.row_max[5::19] = float("-inf")
    return a, b


@pytest.mark.parametrize("inv_temperature", [1.0, 0.7])
def test_merge_gives_the_same_bits_at_any_position(inv_temperature):
    """A row's merged summary is the same whether it is merged alone, in a short vector (a
    vector op's scalar tail) or in a long one: 129 prefixes of 129 rows."""
    a, b = _summaries(129)
    whole = a.merge(b, inv_temperature)
    for rows in range(1, 130):
        part = a.select(slice(0, rows)).merge(b.select(slice(0, rows)), inv_temperature)
        for name, value in part.items():
            torch.testing.assert_close(value, getattr(whole, name)[:rows], rtol=0, atol=0, equal_nan=True,
                                       msg=f"{name} differs at {rows} rows")


def test_merge_keeps_its_accuracy():
    """The rewritten merge against float64 logaddexp / softplus: within a few fp32 ulps."""
    a, b = _summaries(129)
    merged = a.merge(b, 1.0)
    a64, b64 = (s.map(lambda x: x.double() if x.is_floating_point() else x) for s in (a, b))
    m = torch.maximum(a64.row_max, b64.row_max)
    c_a = torch.where(a64.row_max == float("-inf"), float("-inf"), a64.row_max - m + a64.log_sum)
    c_b = torch.where(b64.row_max == float("-inf"), float("-inf"), b64.row_max - m + b64.log_sum)
    expected = torch.logaddexp(c_a, c_b)
    assert torch.allclose(merged.log_sum.double(), expected, rtol=1e-6, atol=1e-6)
    lp = torch.where(b.has_label, b64.label_logprob - torch.nn.functional.softplus(c_a - c_b),
                     a64.label_logprob - torch.nn.functional.softplus(c_b - c_a))
    finite = torch.isfinite(lp)
    assert torch.equal(torch.isfinite(merged.label_logprob), finite)
    assert torch.allclose(merged.label_logprob.double()[finite], lp[finite], rtol=1e-6, atol=1e-6)
