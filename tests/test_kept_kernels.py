"""Kept-set kernels (sampling-mask replay) against a float64 reference written here, vLLM's recipe:
a token's log-prob is ``log_softmax`` of its logits masked to its kept set (every other id -inf),
at its label; its entropy is that of the renormalized distribution; its gradient lives on the kept
ids only.

Rows are ragged (sets of 0..~100 ids), padded sets have holes (-1), a counted label outside its set
gives a NaN log-prob with the statistics computed, and an empty set does not count.
"""

import math
import textwrap

import pytest
import torch

from tpo_kernels.backends import backend_key, get_backend
from tpo_kernels.backends.kept_sets import LABEL_OUTSIDE, NOT_COUNTED, KeptSets
from tpo_kernels.group_math import pair_runs
from tpo_kernels.ops import candidate_logits

from _backends import backend_params, needs_triton
from _triton_compile import assert_kernels_compile_without_spills

BACKENDS = backend_params("torch", "cpu")  # gradchecks: many calls, not interpreted
KERNEL_BACKENDS = BACKENDS + backend_params("triton")  # one call each (tiny: interpreted here)
LINEAR_BACKENDS = KERNEL_BACKENDS
DTYPES = [torch.float32, torch.float64]
V = 300


def _sets(num_rows, *, max_size=100, seed=0, vocab=V):
    """Per-row kept sets (distinct ids, some empty) and labels (in the set where it is nonempty)."""
    gen = torch.Generator().manual_seed(seed)
    sets, labels = [], []
    for r in range(num_rows):
        size = int(torch.randint(0, max_size + 1, (1,), generator=gen)) if r % 5 else int(r % 3 == 1)
        ids = torch.randperm(vocab, generator=gen)[:size]
        sets.append(ids.tolist())
        labels.append(int(ids[torch.randint(0, size, (1,), generator=gen)]) if size else 7)
    return sets, torch.tensor(labels)


def _csr(sets, labels):
    ids = torch.tensor([i for s in sets for i in s], dtype=torch.int64)
    offsets = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
    return KeptSets.from_csr(ids, offsets, labels)


def _padded(sets, labels, width):
    """The same sets as a padded [M, width] tensor, each set's ids placed among holes."""
    padded = torch.full((len(sets), width), -1, dtype=torch.int64)
    for r, s in enumerate(sets):
        slots = torch.randperm(width, generator=torch.Generator().manual_seed(r))[: len(s)].sort().values
        padded[r, slots] = torch.tensor(s, dtype=torch.int64)
    return KeptSets.from_padded(padded, labels)


def _reference(logits, sets, labels, inv_t=1.0):
    """float64 (log-prob, entropy) per row: log_softmax over the logits masked to the set; 0 where the
    set is empty or the label negative, NaN log-prob where the label is outside its set."""
    lps, ents = [], []
    for r, s in enumerate(sets):
        if not s or labels[r] < 0:
            lps.append(0.0)
            ents.append(0.0)
            continue
        masked = torch.full((logits.shape[-1],), float("-inf"), dtype=torch.float64)
        masked[s] = logits[r, s].double() * inv_t
        logp = torch.log_softmax(masked, 0)
        lps.append(float(logp[labels[r]]) if int(labels[r]) in s else float("nan"))
        p = logp.exp()
        ents.append(float(-(p[s] * logp[s]).sum()))
    return torch.tensor(lps, dtype=torch.float64), torch.tensor(ents, dtype=torch.float64)


def _logits(num_rows, dtype, seed=1, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, V, generator=gen) * 3 + offset).to(dtype)


def _row_summary(backend, logits, kept, inv_t=1.0):
    b = get_backend(backend, logits.device)
    return b.ragged_row_forward(b.kept_gather(logits, kept), kept, inv_temperature=inv_t, with_entropy=True)


def _tolerance(dtype):
    return dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inv_t", [1.0, 1 / 0.7])
def test_ragged_forward_matches_the_masked_log_softmax(backend, dtype, inv_t):
    sets, labels = _sets(40)
    logits = _logits(40, dtype)
    summary = _row_summary(backend, logits, _csr(sets, labels), inv_t)
    lp, ent = _reference(logits, sets, labels, inv_t)
    torch.testing.assert_close(summary.label_logprob.double(), lp, **_tolerance(dtype))
    torch.testing.assert_close(summary.entropy.double(), ent, **_tolerance(dtype))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_a_large_common_offset_keeps_the_log_probs(backend):
    """Tempering after the max (offset 3e4): the fp32 log-probs keep the reference's digits."""
    sets, labels = _sets(30, seed=3)
    logits = _logits(30, torch.float32, offset=3e4)
    summary = _row_summary(backend, logits, _csr(sets, labels), 1 / 0.7)
    lp, _ = _reference(logits, sets, labels, 1 / 0.7)
    torch.testing.assert_close(summary.label_logprob.double(), lp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_a_label_outside_its_set_gives_nan_with_the_statistics(backend):
    sets, labels = [[3, 5, 9], [4], [1, 2]], torch.tensor([4, 4, 2])
    logits = _logits(3, torch.float32)
    kept = _csr(sets, labels)
    assert kept.label_slot.tolist() == [LABEL_OUTSIDE, 3, 5]
    summary = _row_summary(backend, logits, kept)
    assert math.isnan(summary.label_logprob[0]) and not summary.has_label[0]
    expected = torch.logsumexp(logits[0, [3, 5, 9]].double() - logits[0, [3, 5, 9]].max(), 0)
    torch.testing.assert_close(summary.log_sum[0].double(), expected, rtol=1e-6, atol=1e-6)
    assert summary.has_label[1:].all() and float(summary.label_logprob[1]) == 0.0


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_empty_sets_and_negative_labels_do_not_count(backend):
    sets, labels = [[], [1, 2], [3]], torch.tensor([5, -100, 3])
    kept = _csr(sets, labels)
    assert kept.label_slot.tolist() == [NOT_COUNTED, NOT_COUNTED, 2]
    summary = _row_summary(backend, _logits(3, torch.float32), kept)
    for _, field in summary.items():
        assert (field[:2] == 0).all()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_sets_with_holes_equal_their_csr(backend, dtype):
    sets, labels = _sets(24, max_size=40, seed=5)
    logits = _logits(24, dtype)
    padded = _padded(sets, labels, width=48)
    csr = _row_summary(backend, logits, _csr(sets, labels))
    dense = _row_summary(backend, logits, padded)
    for (name, a), (_, b) in zip(csr.items(), dense.items()):
        if backend == "triton":  # lanes of a block sum in a tree: holes move a pair to another lane
            torch.testing.assert_close(a, b, **_tolerance(dtype), equal_nan=True)
        else:  # sequential per row: a hole adds an exact 0
            assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_candidates_are_sets_of_uniform_width(backend):
    """Token-level candidates ``[R, K]`` are kept sets of K pairs per row (offsets = K * arange, ids a
    view of the candidates): the candidate op is the kept-set gather, tempered, NaN at a negative id
    (the dense contract has no holes)."""
    logits = _logits(10, torch.float32)
    cand = torch.randint(0, V, (10, 6), generator=torch.Generator().manual_seed(2))
    cand[3, 2] = -1
    kept = KeptSets.from_candidates(cand)
    padded = KeptSets.from_padded(cand, cand[:, 0])
    assert kept.ids.data_ptr() == cand.data_ptr() and kept.width == 6
    assert torch.equal(kept.offsets, padded.offsets) and torch.equal(kept.rows, padded.rows)
    b = get_backend(backend, logits.device)
    got = candidate_logits(logits, cand, inv_temperature=1 / 0.7, backend=backend_key(b))
    want = logits.gather(1, cand.clamp(min=0)) * (1 / 0.7)
    want[3, 2] = float("nan")
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _grad_reference(logits, sets, labels, g, ge, inv_t):
    x = logits.double().clone().requires_grad_(True)
    lps, ents = [], []
    for r, s in enumerate(sets):
        if not s or labels[r] < 0:
            continue
        masked = torch.full((V,), float("-inf"), dtype=torch.float64).index_put((torch.tensor(s),), x[r, s] * inv_t)
        logp = torch.log_softmax(masked, 0)
        lps.append(logp[labels[r]] * g[r])
        ents.append(-(logp[s].exp() * logp[s]).sum() * ge[r])
    (sum(lps) + sum(ents)).backward()
    return x.grad


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_backward_is_the_masked_gradient(backend, dtype):
    sets, labels = _sets(30, seed=7)
    logits = _logits(30, dtype)
    kept = _csr(sets, labels)
    b = get_backend(backend, logits.device)
    gen = torch.Generator().manual_seed(8)
    g, ge = torch.randn(30, generator=gen), torch.randn(30, generator=gen)
    z = b.kept_gather(logits, kept)
    summary = b.ragged_row_forward(z, kept, inv_temperature=1 / 0.7, with_entropy=True)
    out = torch.empty_like(z)
    b.ragged_row_backward(z, kept, summary, g.to(z.dtype), grad_entropy=ge.to(z.dtype), inv_temperature=1 / 0.7,
                          out=out)
    dense = torch.empty_like(logits)
    b.kept_scatter(out, kept, out=dense)
    expected = _grad_reference(logits, sets, labels, g.double(), ge.double(), 1 / 0.7)
    torch.testing.assert_close(dense.double(), expected, **_tolerance(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_scatter_writes_no_hole_and_no_id_outside_the_vocabulary(backend):
    ids = torch.tensor([[2, -1, 5], [V, 1, -1]])
    kept = KeptSets.from_padded(ids, torch.tensor([2, 1]))
    b = get_backend(backend, torch.device("cpu"))
    out = torch.full((2, V), 9.0)
    b.kept_scatter(torch.arange(1.0, 7.0), kept, out=out)
    expected = torch.zeros(2, V)
    expected[0, 2], expected[0, 5], expected[1, 1] = 1.0, 3.0, 5.0
    assert torch.equal(out, expected)
    gathered = b.kept_gather(torch.zeros(2, V), kept)
    assert gathered[1] == float("-inf") and math.isnan(gathered[3])


def _linear(num_rows, hidden_size, dtype, seed=11):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_rows, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(V, hidden_size, generator=gen) / hidden_size**0.5).to(dtype)
    bias = torch.randn(V, generator=gen).to(dtype)
    return hidden, weight, bias


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_forward_is_the_gathered_head(backend, dtype):
    sets, labels = _sets(20, seed=9)
    hidden, weight, bias = _linear(20, 32, dtype)
    kept = _padded(sets, labels, width=110)
    b = get_backend(backend, hidden.device)
    logits = hidden @ weight.T + bias
    got = b.kept_linear_forward(hidden, weight, kept, bias=bias)
    torch.testing.assert_close(got, b.kept_gather(logits, kept), **_tolerance(dtype))


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
@pytest.mark.parametrize("hidden_size", [5, 37])
def test_linear_forward_of_bf16_sums_in_fp32(backend, hidden_size):
    sets, labels = _sets(12, seed=16)
    hidden, weight, bias = _linear(12, hidden_size, torch.bfloat16)
    kept = _csr(sets, labels)
    got = get_backend(backend, hidden.device).kept_linear_forward(hidden, weight, kept, bias=bias)
    assert got.dtype == torch.float32
    expected = (hidden.double() @ weight.double().T + bias.double())[kept.rows, kept.ids]
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_linear_forward_of_a_hole_is_minus_inf_and_of_an_id_outside_nan(backend):
    hidden, weight, bias = _linear(2, 8, torch.float32)
    kept = KeptSets.from_padded(torch.tensor([[3, -1], [V, 4]]), torch.tensor([3, 4]))
    got = get_backend(backend, hidden.device).kept_linear_forward(hidden, weight, kept, bias=bias)
    assert got[1] == float("-inf") and math.isnan(got[2])
    torch.testing.assert_close(got[[0, 3]], torch.stack([hidden[0] @ weight[3] + bias[3], hidden[1] @ weight[4] + bias[4]]))


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_linear_backward_is_the_autograd_of_the_gathered_head(backend):
    sets, labels = _sets(20, seed=10)
    hidden, weight, bias = _linear(20, 16, torch.float64)
    kept = _padded(sets, labels, width=110)
    grad = torch.randn(kept.num_pairs, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    b = get_backend(backend, hidden.device)
    dh, dw, db = b.kept_linear_backward(grad, hidden, weight, kept, runs=pair_runs(kept.ids), with_hidden=True,
                                        with_weight=True, with_bias=True)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    dense = leaves[0] @ leaves[1].T + leaves[2]
    present = kept.ids >= 0
    (dense[kept.rows[present], kept.ids[present]] * grad[present]).sum().backward()
    for got, leaf in zip((dh, dw, db), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
@pytest.mark.parametrize("n", [1, 3, 7, 15])
def test_a_row_does_not_depend_on_its_batch(backend, n):
    """The first n rows alone give bitwise the log-probs, entropies and gradients they get in the batch."""
    sets, labels = _sets(16, seed=12)
    hidden, weight, bias = _linear(16, 64, torch.float32)
    b = get_backend(backend, hidden.device)

    def run(rows):
        kept = _csr(sets[:rows], labels[:rows])
        z = b.kept_linear_forward(hidden[:rows], weight, kept, bias=bias)
        summary = b.ragged_row_forward(z, kept, inv_temperature=1.0, with_entropy=True)
        dz = torch.empty_like(z)
        b.ragged_row_backward(z, kept, summary, torch.ones(rows), grad_entropy=torch.ones(rows),
                              inv_temperature=1.0, out=dz)
        dh, _, _ = b.kept_linear_backward(dz, hidden[:rows], weight, kept, runs=None, with_hidden=True,
                                          with_weight=False, with_bias=False)
        return summary.label_logprob, summary.entropy, dh

    whole = run(16)
    for part, full in zip(run(n), whole):
        assert torch.equal(part, full[:n])


# ----------------------------------------------------------------------------- the custom ops


def _request(entropy=True, softcap=None, inv_t=1 / 0.7):
    from tpo_kernels.backends.rows import RowRequest

    return RowRequest(inv_temperature=inv_t, logit_softcap=softcap, token_fields=("entropy",) if entropy else ())


def _op_loss(summary, gen_seed=4):
    gen = torch.Generator().manual_seed(gen_seed)
    g = torch.randn(summary.label_logprob.shape, generator=gen, dtype=summary.label_logprob.dtype)
    ge = torch.randn(summary.label_logprob.shape, generator=gen, dtype=summary.label_logprob.dtype)
    # Rows with a NaN log-prob (label outside its set) carry no gradient here.
    lp = torch.where(summary.has_label, summary.label_logprob, 0.0)
    return (lp * g).sum() + (summary.entropy * ge).sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_kept_row_summary_gradcheck(backend, softcap):
    from tpo_kernels.ops.kept import kept_row_summary

    sets, labels = _sets(8, max_size=12, seed=13)
    kept = _padded(sets, labels, width=14)
    logits = _logits(8, torch.float64).requires_grad_(True)
    request = _request(softcap=softcap)
    torch.autograd.gradcheck(lambda x: _op_loss(kept_row_summary(x, kept, request, backend)), (logits,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_kept_row_summary_gradcheck(backend):
    from tpo_kernels.ops.kept import linear_kept_row_summary

    sets, labels = _sets(8, max_size=12, seed=14)
    kept = _csr(sets, labels)
    leaves = [t.requires_grad_(True) for t in _linear(8, 6, torch.float64)]
    request = _request()
    torch.autograd.gradcheck(lambda h, w, b: _op_loss(linear_kept_row_summary(h, w, b, kept, request, backend)),
                             leaves)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_ops_match_the_reference_on_a_shifted_view(backend):
    """``logits[:, :-1]`` (rows that do not flatten) is read in place and gets its gradient there."""
    from tpo_kernels.ops.kept import kept_row_summary

    source = _logits(4 * 6, torch.float32).view(4, 6, V).requires_grad_(True)
    view = source[:, :-1]
    sets, labels = _sets(20, seed=15)
    summary = kept_row_summary(view, _csr(sets, labels), _request(inv_t=1.0), backend)
    lp, ent = _reference(view.detach().reshape(20, V), sets, labels)
    torch.testing.assert_close(summary.label_logprob.double(), lp, rtol=2e-5, atol=2e-5)
    summary.label_logprob.sum().backward()
    expected = _grad_reference(view.detach().reshape(20, V), sets, labels, torch.ones(20), torch.zeros(20), 1.0)
    torch.testing.assert_close(source.grad[:, :-1].reshape(20, V).double(), expected, rtol=2e-5, atol=2e-5)
    assert (source.grad[:, -1] == 0).all()


def test_the_fused_path_forms_no_vocabulary_sized_tensor():
    """With kept sets the fused head allocates nothing near [M, V] (forward and backward): every
    tensor an op returns stays below an eighth of it."""
    from _dispatch import OutputSizes
    from tpo_kernels.ops.kept import linear_kept_row_summary

    rows, hidden_size, vocab = 256, 16, 8192
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, hidden_size, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.1).requires_grad_(False)
    sets = [torch.randperm(vocab, generator=gen)[: 1 + r % 40].tolist() for r in range(rows)]
    labels = torch.tensor([s[0] for s in sets])
    kept = _csr(sets, labels)
    recorder = OutputSizes()
    with recorder:
        summary = linear_kept_row_summary(hidden, weight, None, kept, _request(), "torch")
        _op_loss(summary).backward()
    largest = max(size for _, size in recorder.outputs)
    assert largest < rows * vocab * 4 / 8, largest


@pytest.mark.parametrize("offsets, message", [([1, 2, 3], "offsets\\[0\\] must be 0"), ([0, 2, 1], "must not decrease"),
                                              ([0, 1, 2], "must be num_pairs")])
def test_the_cpu_binding_refuses_offsets_that_would_read_out_of_bounds(offsets, message):
    pytest.importorskip("tpo_kernels._C_cpu")
    from tpo_kernels import _C_cpu

    hidden, weight, _ = _linear(2, 4, torch.float32)
    ids, offs, out = torch.zeros(3, dtype=torch.int64), torch.tensor(offsets), torch.empty(3)
    with pytest.raises(ValueError, match=message):
        _C_cpu.kept_linear_forward(dtype=0, rows=2, hidden_size=4, vocab=V, hidden=hidden.data_ptr(),
                                   hidden_row_stride=4, weight=weight.data_ptr(), weight_row_stride=4,
                                   ids=ids.data_ptr(), offsets=offs.data_ptr(), num_pairs=3, out=out.data_ptr())


@pytest.mark.parametrize("with_entropy", [False, True])
def test_the_custom_ops_pass_opcheck(with_entropy):
    """Schemas, fakes (torch.compile) and autograd registration of the three ops."""
    import tpo_kernels.ops.kept as kept_ops

    sets, labels = _sets(6, max_size=8, seed=1)
    tensors, width = _padded(sets, labels, 9).to_op()
    logits = _logits(6, torch.float64).requires_grad_(True)
    hidden, weight, bias = (t.requires_grad_(True) for t in _linear(6, 5, torch.float64))
    gathered = kept_ops._kept_logits(logits, tensors, width, "torch").detach().requires_grad_(True)
    cases = [(kept_ops._kept_logits, (logits, tensors, width, "torch")),
             (kept_ops._linear_kept_logits, (hidden, weight, bias, tensors, width, "torch")),
             (kept_ops._ragged_logprobs, (gathered, tensors, width, 1.3, with_entropy, "torch"))]
    for op, args in cases:
        results = torch.library.opcheck(op, args)
        assert all(result == "SUCCESS" for result in results.values()), (op, results)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_vocabulary_shards_merge_into_the_whole_row(backend):
    """Each shard's summary over its part of the kept sets, merged, is the whole row's."""
    sets, labels = _sets(30, seed=17)
    logits = _logits(30, torch.float64)
    kept = _csr(sets, labels)
    whole = _row_summary(backend, logits, kept, 1 / 0.7)
    bounds = [0, 70, 71, 200, V]
    parts = [_row_summary(backend, logits[:, a:b], kept.shard(a, b - a), 1 / 0.7) for a, b in zip(bounds, bounds[1:])]
    merged = parts[0]
    for part in parts[1:]:
        merged = merged.merge(part, 1 / 0.7)
    counted = kept.label_slot >= 0
    for name in ("label_logprob", "entropy"):
        torch.testing.assert_close(getattr(merged, name)[counted], getattr(whole, name)[counted], rtol=1e-12, atol=1e-12)
    assert torch.equal(merged.has_label, whole.has_label)


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_a_call_with_no_kept_ids_counts_nothing_and_has_zero_gradients(backend):
    from tpo_kernels.ops.kept import linear_kept_row_summary

    kept = KeptSets.from_csr(torch.zeros(0, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), torch.tensor([1, 2, 3]))
    assert kept.label_slot.tolist() == [NOT_COUNTED] * 3
    hidden, weight, bias = (t.requires_grad_(True) for t in _linear(3, 4, torch.float32))
    summary = linear_kept_row_summary(hidden, weight, bias, kept, _request(), backend)
    _op_loss(summary).backward()
    assert not summary.has_label.any() and (summary.label_logprob == 0).all()
    assert all((t.grad == 0).all() for t in (hidden, weight, bias))


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_permuted_rows_get_bitwise_the_same_values(backend):
    sets, labels = _sets(16, seed=18)
    hidden, weight, bias = _linear(16, 48, torch.float32)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(5))
    b = get_backend(backend, hidden.device)

    def run(rows):
        kept = _csr([sets[r] for r in rows.tolist()], labels[rows])
        z = b.kept_linear_forward(hidden[rows], weight, kept, bias=bias)
        summary = b.ragged_row_forward(z, kept, inv_temperature=1.3, with_entropy=True)
        dz = torch.empty_like(z)
        b.ragged_row_backward(z, kept, summary, torch.ones(16), grad_entropy=torch.ones(16), inv_temperature=1.3, out=dz)
        dh, _, _ = b.kept_linear_backward(dz, hidden[rows], weight, kept, runs=None, with_hidden=True,
                                          with_weight=False, with_bias=False)
        return summary.label_logprob, summary.entropy, dh

    for permuted, plain in zip(run(order), run(torch.arange(16))):
        assert torch.equal(permuted, plain[order])


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_linear_backward_ignores_holes_and_ids_outside_the_vocabulary(backend):
    hidden, weight, bias = _linear(2, 8, torch.float32)
    kept = KeptSets.from_padded(torch.tensor([[3, -1], [V, 4]]), torch.tensor([3, 4]))
    grad = torch.tensor([1.0, float("nan"), float("nan"), 2.0])
    dh, dw, db = get_backend(backend, hidden.device).kept_linear_backward(
        grad, hidden, weight, kept, runs=pair_runs(kept.ids), with_hidden=True, with_weight=True, with_bias=True)
    torch.testing.assert_close(dh, torch.stack([weight[3], 2.0 * weight[4]]))
    expected_db = torch.zeros(V)
    expected_db[3], expected_db[4] = 1.0, 2.0
    assert torch.equal(db, expected_db)
    assert torch.equal(dw[[3, 4]], torch.stack([hidden[0], 2.0 * hidden[1]])) and dw.abs().sum() == dw[[3, 4]].abs().sum()


@needs_triton
def test_the_cuda_backend_runs_the_triton_kept_linear_backward_when_triton_is_usable():
    """The one kept-set op without a CUDA kernel (the others: tests/test_cuda_extension.py)."""
    from tpo_kernels.backends import torch_kept
    from tpo_kernels.backends.cuda import kept_ops
    from tpo_kernels.backends.triton import kept_kernels

    assert kept_ops(None) is kept_kernels
    assert kept_ops("no CUDA device") is torch_kept



_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from bench import kernel_report as KR
    from bench.kernel_report.triton import Scenario
    from tpo_kernels.backends.kept_sets import KeptSets
    from tpo_kernels.group_math import pair_runs

    def replay(dtype, bias, entropy):
        def call(backend):
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            hidden, weight = torch.randn(6, 4096).to(dtype), torch.randn(64, 4096).to(dtype)
            ids = torch.randint(0, 64, (6, 30))
            ids[:, :20] = 5  # one token's run longer than a weight-gradient segment
            ids[0, 3] = -1
            kept = KeptSets.from_padded(ids, ids[:, 0])
            b = torch.randn(64).to(dtype) if bias else None
            z = backend.kept_linear_forward(hidden, weight, kept, bias=b)
            summary = backend.ragged_row_forward(z, kept, inv_temperature=1.0, with_entropy=entropy)
            g = torch.ones(6, dtype=acc)
            backend.ragged_row_backward(z, kept, summary, g, grad_entropy=g if entropy else None,
                                        inv_temperature=1.0, out=torch.empty_like(z))
            backend.kept_linear_backward(torch.ones_like(z), hidden, weight, kept, runs=pair_runs(kept.ids),
                                         with_hidden=True, with_weight=True, with_bias=bias)
        return call

    scenarios = [Scenario(f"kept replay bias={bias} entropy={entropy}", name, replay(dtype, bias, entropy))
                 for name, dtype in (("bf16", torch.bfloat16), ("fp64", torch.float64))
                 for bias in (False, True) for entropy in (False, True)]
    rows = [row for arch in (80, 90) for row in KR.collect_triton(arch, scenarios)]
    with open(sys.argv[1], "w") as f:
        json.dump([r.to_json() for r in rows], f)
    """
)

KEPT_KERNELS = {"_kept_dot_kernel", "_kept_hidden_grad_kernel", "_ragged_forward_kernel", "_ragged_backward_kernel",
                "_weight_grad_run_kernel", "_weight_grad_segment_kernel", "_weight_grad_combine_kernel"}


@needs_triton
def test_the_triton_kept_kernels_compile_for_sm80_and_sm90_without_spills(tmp_path):
    """The interpreter accepts programs the compiler may reject: every kept kernel compiles as its
    launcher specializes it (the kernel report's launch capture, no GPU needed)."""
    from bench import kernel_report

    if kernel_report.triton_tool("cuobjdump") is None:
        pytest.skip("Triton's NVIDIA tools are absent")
    assert_kernels_compile_without_spills(_COMPILE_SCRIPT, KEPT_KERNELS, tmp_path / "rows.json")


# ----------------------------------------------------------------------------- the CUDA kernels (GPU)

CUDA_BACKENDS = backend_params("cuda")  # skipped without a GPU and the built extension


def _to_cuda(kept):
    return KeptSets(ids=kept.ids.cuda(), offsets=kept.offsets.cuda(), rows=kept.rows.cuda(),
                    label_slot=kept.label_slot.cuda(), width=kept.width)


def _cuda_sets(form, sets, labels):
    return _to_cuda(_csr(sets, labels) if form == "csr" else _padded(sets, labels, width=110))


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inv_t", [1.0, 1 / 0.7])
@pytest.mark.parametrize("form", ["csr", "padded"])
def test_cuda_ragged_row_ops_match_torch_kept_and_the_reference(backend, dtype, inv_t, form):
    from tpo_kernels.backends import torch_kept

    sets, labels = _sets(40)
    logits = _logits(40, dtype).cuda()
    kept = _cuda_sets(form, sets, labels)
    b = get_backend(backend, logits.device)
    z = b.kept_gather(logits, kept)
    assert torch.equal(z, torch_kept.kept_gather(logits, kept))
    summary = b.ragged_row_forward(z, kept, inv_temperature=inv_t, with_entropy=True)
    want = torch_kept.ragged_row_forward(z, kept, inv_temperature=inv_t, with_entropy=True)
    for (name, got), (_, expected) in zip(summary.items(), want.items()):
        torch.testing.assert_close(got, expected, **_tolerance(dtype), equal_nan=True, msg=name)
    lp, ent = _reference(logits.cpu(), sets, labels, inv_t)
    torch.testing.assert_close(summary.label_logprob.double().cpu(), lp, **_tolerance(dtype))
    torch.testing.assert_close(summary.entropy.double().cpu(), ent, **_tolerance(dtype))
    gen = torch.Generator().manual_seed(8)
    g, ge = (torch.randn(40, generator=gen).to(z.dtype).cuda() for _ in range(2))
    g[3] = ge[3] = 0.0  # a zero-signal row
    for ge_arg in (None, ge):
        got, expected = torch.empty_like(z), torch.empty_like(z)
        b.ragged_row_backward(z, kept, want, g, grad_entropy=ge_arg, inv_temperature=inv_t, out=got)
        torch_kept.ragged_row_backward(z, kept, want, g, grad_entropy=ge_arg, inv_temperature=inv_t, out=expected)
        torch.testing.assert_close(got, expected, **_tolerance(dtype))
        dense, dense_expected = torch.full_like(logits, 5.0), torch.empty_like(logits)
        b.kept_scatter(got, kept, out=dense)
        torch_kept.kept_scatter(got, kept, out=dense_expected)
        assert torch.equal(dense, dense_expected)  # distinct ids: each written once, no sum to order


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_gather_and_scatter_of_a_shifted_view_match_torch_kept(backend, dtype):
    """``logits[:, :-1]`` is read in place, its gradient written into a [B, T, V] view; rows hold
    repeated ids, summed in pair order (deterministic)."""
    from tpo_kernels.backends import torch_kept

    source = _logits(4 * 6, torch.float32).view(4, 6, V).to(dtype).cuda()
    view = source[:, :-1]
    ids = torch.randint(0, 12, (20, 9), generator=torch.Generator().manual_seed(4))  # many repeats
    ids[0, 2], ids[5, 0], ids[7, 8] = -1, V, V + 3  # a hole, ids outside the vocabulary
    kept = _to_cuda(KeptSets.from_padded(ids, ids[:, 0]))
    b = get_backend(backend, view.device)
    z = b.kept_gather(view, kept)
    torch.testing.assert_close(z, torch_kept.kept_gather(view, kept), rtol=0, atol=0, equal_nan=True)
    grad = torch.randn(kept.num_pairs, dtype=z.dtype, generator=torch.Generator().manual_seed(5)).cuda()
    outs = []
    for _ in range(2):
        out = torch.full((4, 6, V), 7.0, dtype=dtype, device="cuda")
        b.kept_scatter(grad, kept, out=out[:, :-1])
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and (outs[0][:, -1] == 7.0).all()
    expected = torch.empty(4, 5, V, dtype=torch.float64, device="cuda")
    torch_kept.kept_scatter(grad.double(), kept, out=expected)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype in (torch.bfloat16, torch.float16) else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[0][:, :-1].double(), expected, **tol)


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("hidden_size", [37, 256])
def test_cuda_linear_forward_matches_torch_kept_whatever_the_alignment(backend, dtype, hidden_size):
    """The dot products of a pair do not depend on where its rows lie: hidden rows off a 16-byte
    boundary (element loads) give bitwise what aligned rows (vector loads) give."""
    from tpo_kernels.backends import torch_kept

    sets, labels = _sets(20, seed=9)
    hidden, weight, bias = (t.cuda() for t in _linear(20, hidden_size, dtype))
    kept = _to_cuda(_padded(sets, labels, width=110))
    b = get_backend(backend, hidden.device)
    got = b.kept_linear_forward(hidden, weight, kept, bias=bias)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype != torch.float64 else _tolerance(dtype)
    torch.testing.assert_close(got, torch_kept.kept_linear_forward(hidden, weight, kept, bias=bias), **tol,
                               equal_nan=True)
    shifted = torch.zeros(20, hidden_size + 1, dtype=dtype, device="cuda")[:, 1:]
    shifted.copy_(hidden)
    assert torch.equal(b.kept_linear_forward(shifted, weight, kept, bias=bias), got)
    first = _to_cuda(_padded(sets[:7], labels[:7], width=110))
    assert torch.equal(b.kept_linear_forward(hidden[:7], weight, first, bias=bias), got[: first.num_pairs])


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_cuda_kernels_stay_in_bounds_of_malformed_sets(backend):
    """Offsets and label slots on the device are not checked on the host: ranges past the pairs,
    decreasing offsets and slots outside their row read and write nothing out of bounds (the
    kernels clamp); a slot outside its row is the label-outside case."""
    ids = torch.tensor([1, 2, 3, 4], device="cuda")
    kept = KeptSets(ids=ids, offsets=torch.tensor([0, 2, 1, 99], device="cuda"), rows=torch.zeros(4, device="cuda"),
                    label_slot=torch.tensor([7, 0, -5], device="cuda"))
    logits = torch.randn(3, 8, device="cuda")
    b = get_backend(backend, logits.device)
    z = torch.randn(4, device="cuda")
    summary = b.ragged_row_forward(z, kept, inv_temperature=1.0, with_entropy=True)
    out = torch.zeros(4, device="cuda")
    b.ragged_row_backward(z, kept, summary, torch.ones(3, device="cuda"), inv_temperature=1.0, out=out)
    b.kept_scatter(z, KeptSets(ids=ids, offsets=torch.tensor([0, 3, 2, 4], device="cuda"), rows=kept.rows,
                               label_slot=kept.label_slot), out=logits)
    torch.cuda.synchronize()  # an out-of-bounds access would surface here
    assert torch.isnan(summary.label_logprob).all()  # no row's slot lies in its (clamped) range
    torch.testing.assert_close(summary.log_sum[0], torch.logsumexp(z[:2] - z[:2].max(), 0))
