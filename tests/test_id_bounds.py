"""Ids outside the vocabulary, at the layer below the public checks (what ``validate=False``
reaches): every backend op that takes ids, called directly on views of larger buffers whose
padding holds a sentinel. The contract (DESIGN.md, "Ids outside the vocabulary"), with ``V`` the
view's width, not its row stride:

* row forward: a label ``>= V`` gives NaN for all of its row's outputs, a negative one 0;
* row backward: a label outside ``[0, V)`` adds no one-hot term;
* candidate gather and dot (the custom ops, on the kept-set ops): NaN for a candidate outside ``[0, V)``;
* the kept-set scatter, dW and db on the candidates: no write for it; dH: no contribution from it;
* nothing outside the view (the padding, the rows around it) is read into a result or written.

Every backend follows it, the cpu backend included (its binding does not check ids; its kernels
guard each one, and its fused-linear ops are the PyTorch defaults). The bad ids are ``V``, ``V + 3`` (padding columns of the view's own
row), ``row_stride + 5`` (a column of the next row) and, for candidates, ``-2``; labels also
``2**32 + 5``, which wraps to a valid column in int32.
"""

import dataclasses

import pytest
import torch

import tpo_kernels
from tpo_kernels.backends import backend_key, get_backend
from tpo_kernels.backends.kept_sets import KeptSets
from tpo_kernels.backends.rows import RowSummary
from tpo_kernels.group_math import pair_runs
from tpo_kernels.ops import candidate_logits, linear_candidate_logits

from _backends import DEVICE, DEVICE_BACKENDS, INTERPRETED_BACKENDS, needs_triton

BACKENDS = DEVICE_BACKENDS + INTERPRETED_BACKENDS

V, PAD = 40, 8
ROW_STRIDE = V + PAD
SENTINEL = 30.0  # large: a logit read from the padding would dominate the softmax
WRAPS_IN_INT32 = 2**32 + 5  # a kernel that casts ids to int32 before its test would see column 5
BAD_LABELS = [V, V + 3, ROW_STRIDE + 5, WRAPS_IN_INT32]
BAD_CANDIDATES = [V, V + 3, -2, ROW_STRIDE + 5]
INV_T = 1 / 0.7


def _padded(rows: int, generator: torch.Generator):
    """``(parent, view)``: a ``[rows + 2, V + PAD]`` buffer of SENTINEL and its ``[rows, V]`` view
    starting at row 1 (so that ids below 0 or past the row stride land inside ``parent``), the
    view filled with random logits."""
    parent = torch.full((rows + 2, ROW_STRIDE), SENTINEL)
    parent[1 : rows + 1, :V] = torch.randn(rows, V, generator=generator)
    parent = parent.to(DEVICE)
    return parent, parent[1 : rows + 1, :V]


def _outside_view(parent: torch.Tensor, rows: int) -> torch.Tensor:
    mask = torch.ones(parent.shape, dtype=torch.bool, device=parent.device)
    mask[1 : rows + 1, :V] = False
    return parent[mask]


def _assert_padding_untouched(parent: torch.Tensor, rows: int) -> None:
    outside = _outside_view(parent, rows)
    assert torch.equal(outside, torch.full_like(outside, SENTINEL))


# ----------------------------------------------------------------------------- row ops

# Rows: three bad labels, a valid label, an ignored row.
ROW_LABELS = BAD_LABELS + [5, -100]


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_forward_gives_nan_for_labels_outside_the_vocabulary(backend):
    ops = get_backend(backend, DEVICE)
    rows = len(ROW_LABELS)
    parent, logits = _padded(rows, torch.Generator().manual_seed(1))
    labels = torch.tensor(ROW_LABELS, device=DEVICE)
    summary = ops.row_forward(logits, labels, inv_temperature=INV_T, with_entropy=True)
    logprob, entropy = summary.label_logprob, summary.entropy
    bad, valid, ignored = list(range(len(BAD_LABELS))), len(BAD_LABELS), len(BAD_LABELS) + 1
    for out in (summary.row_max, summary.log_sum, logprob, entropy):
        assert torch.isnan(out[bad]).all()
        assert out[ignored] == 0
    z = logits[valid].double() * INV_T
    log_p = torch.log_softmax(z, dim=0)
    torch.testing.assert_close(logprob[valid].double(), log_p[5], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy[valid].double(), -(log_p.exp() * log_p).sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(summary.row_max[valid], logits[valid].max())
    _assert_padding_untouched(parent, rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_row_backward_adds_no_one_hot_term_for_labels_outside_the_vocabulary(backend, inplace):
    ops = get_backend(backend, DEVICE)
    rows = len(ROW_LABELS)
    gen = torch.Generator().manual_seed(2)
    parent, logits = _padded(rows, gen)
    labels = torch.tensor(ROW_LABELS, device=DEVICE)
    # The statistics of each row over the view (finite for every row, so that a row with a bad
    # label has a defined gradient: -g p / tau, no one-hot term).
    z = logits.double() * INV_T
    log_p = torch.log_softmax(z, dim=1)
    summary = RowSummary.zeros(rows, dtype=torch.float32, device=DEVICE)
    summary = dataclasses.replace(
        summary, row_max=logits.amax(dim=1).float(),
        log_sum=(torch.logsumexp(z, dim=1) - logits.amax(dim=1).double() * INV_T).float(),
        label_logprob=log_p[torch.arange(rows), labels.clamp(0, V - 1)].float())
    grad = torch.linspace(0.5, 1.5, rows, device=DEVICE)
    one_hot = torch.zeros(rows, V, dtype=torch.float64, device=DEVICE)
    one_hot[len(BAD_LABELS), 5] = 1.0  # the only row with a label in [0, V)
    expected = (grad.double()[:, None] * (one_hot - log_p.exp()) * INV_T).float()
    out_parent, out = (parent, logits) if inplace else _padded(rows, gen)

    def call():
        ops.row_backward(logits, labels, summary, grad, inv_temperature=INV_T, out=out)

    call()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    _assert_padding_untouched(out_parent, rows)
    if not inplace:
        _assert_padding_untouched(parent, rows)


# ------------------------------------------------------------------ logits-path candidates

NUM_CAND = 6


def _candidates(rows: int) -> torch.Tensor:
    """Row r: the four bad ids rotated by r, then two distinct valid ids."""
    cands = []
    for r in range(rows):
        bad = BAD_CANDIDATES[r % 4:] + BAD_CANDIDATES[: r % 4]
        cands.append(bad + [r, V - 1 - r])
    return torch.tensor(cands, device=DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_candidate_gather_gives_nan_for_ids_outside_the_vocabulary(backend):
    ops = get_backend(backend, DEVICE)
    rows = 3
    parent, logits = _padded(rows, torch.Generator().manual_seed(3))
    cands = _candidates(rows)
    got = candidate_logits(logits, cands, inv_temperature=INV_T, backend=backend_key(ops))
    valid = (cands >= 0) & (cands < V)
    assert torch.isnan(got[~valid]).all()
    expected = logits.gather(1, cands.clamp(0, V - 1)) * INV_T
    assert torch.equal(got[valid], expected[valid])
    _assert_padding_untouched(parent, rows)


@pytest.mark.parametrize("backend", BACKENDS)
def test_candidate_scatter_does_not_write_ids_outside_the_vocabulary(backend):
    ops = get_backend(backend, DEVICE)
    rows = 3
    parent, out = _padded(rows, torch.Generator().manual_seed(4))
    cands = _candidates(rows)
    grad = torch.linspace(1.0, 2.0, rows * NUM_CAND, device=DEVICE).view(rows, NUM_CAND)

    def call():
        ops.kept_scatter((grad * INV_T).reshape(-1), KeptSets.from_candidates(cands), out=out)

    call()
    expected = torch.zeros(rows, V, device=DEVICE)
    for r in range(rows):
        for k in range(NUM_CAND - 2, NUM_CAND):
            expected[r, cands[r, k]] = grad[r, k] * INV_T
    assert torch.equal(out, expected)
    _assert_padding_untouched(parent, rows)


# -------------------------------------------------------------- fused-linear candidates

STATES, K, H = 10, 8, 8
WEIGHT_PAD = 2 + PAD + 8  # weight rows: 2 before the view, then V, then enough for ROW_STRIDE + 5


def _linear_case(gen: torch.Generator):
    """``(weight_parent, weight, bias_parent, bias, hidden, cands)``. ``weight`` [V, H] and
    ``bias`` [V] are views starting at row 2 of sentinel-filled parents that hold every bad id's
    row. The candidates hold 2 pairs each of -2, V and ROW_STRIDE + 5, 6 valid pairs and 68 of
    V + 3, a run that crosses the first 64-pair segment of the weight-gradient kernels."""
    rows = 2 + V + WEIGHT_PAD - 2
    weight_parent = torch.full((rows, H), SENTINEL)
    weight_parent[2 : V + 2] = torch.randn(V, H, generator=gen)
    bias_parent = torch.full((rows,), SENTINEL)
    bias_parent[2 : V + 2] = torch.randn(V, generator=gen)
    weight_parent, bias_parent = weight_parent.to(DEVICE), bias_parent.to(DEVICE)
    hidden = torch.randn(STATES, H, generator=gen).to(DEVICE)
    flat = torch.full((STATES * K,), V + 3)
    flat[[0, 17]] = -2
    flat[[9, 30]] = V
    flat[[41, 79]] = ROW_STRIDE + 5
    flat[[3, 12, 25, 50, 66, 70]] = torch.tensor([0, 7, 7, 21, V - 1, 0])
    assert ROW_STRIDE + 5 < rows - 2
    return weight_parent, weight_parent[2 : V + 2], bias_parent, bias_parent[2 : V + 2], hidden, \
        flat.view(STATES, K).to(DEVICE)


def _assert_weight_padding_untouched(weight_parent, bias_parent):
    for parent in (weight_parent, bias_parent):
        outside = torch.cat([parent[:2].reshape(-1), parent[V + 2 :].reshape(-1)])
        assert torch.equal(outside, torch.full_like(outside, SENTINEL))


@pytest.mark.parametrize("backend", BACKENDS)
def test_candidate_dot_gives_nan_for_ids_outside_the_vocabulary(backend):
    ops = get_backend(backend, DEVICE)
    weight_parent, weight, bias_parent, bias, hidden, cands = _linear_case(torch.Generator().manual_seed(5))
    got = linear_candidate_logits(hidden, weight, bias, cands, inv_temperature=INV_T, backend=backend_key(ops))
    valid = (cands >= 0) & (cands < V)
    assert torch.isnan(got[~valid]).all()
    ids = cands.clamp(0, V - 1)
    expected = ((weight.double()[ids] * hidden.double()[:, None, :]).sum(-1) + bias.double()[ids]) * INV_T
    torch.testing.assert_close(got[valid].double(), expected[valid], rtol=1e-5, atol=1e-6)
    _assert_weight_padding_untouched(weight_parent, bias_parent)


def _linear_grad(cands: torch.Tensor) -> torch.Tensor:
    """Finite for valid candidates, NaN for the others: any contribution of theirs would show."""
    grad = torch.linspace(-1.0, 1.0, STATES * K, device=DEVICE).view(STATES, K)
    return torch.where((cands >= 0) & (cands < V), grad, float("nan"))


def _expected_linear_grads(grad, hidden, weight, cands):
    valid = (cands >= 0) & (cands < V)
    g = torch.where(valid, grad, 0.0).double()
    ids = cands.clamp(0, V - 1)
    dhidden = (g[:, :, None] * weight.double()[ids]).sum(1)
    dweight = torch.zeros(V, H, dtype=torch.float64, device=DEVICE)
    dbias = torch.zeros(V, dtype=torch.float64, device=DEVICE)
    dweight.index_add_(0, ids.reshape(-1), (g[:, :, None] * hidden.double()[:, None, :]).reshape(-1, H))
    dbias.index_add_(0, ids.reshape(-1), g.reshape(-1))
    return dhidden, dweight, dbias


@pytest.mark.parametrize("backend", BACKENDS)
def test_candidate_linear_backward_ignores_ids_outside_the_vocabulary(backend):
    """dH takes no contribution from a bad id (its NaN grad stays out); dW and db are zero
    outside the valid candidates' rows."""
    ops = get_backend(backend, DEVICE)
    weight_parent, weight, bias_parent, bias, hidden, cands = _linear_case(torch.Generator().manual_seed(6))
    grad = _linear_grad(cands)
    dhidden, dweight, dbias = ops.kept_linear_backward(
        grad.reshape(-1), hidden, weight, KeptSets.from_candidates(cands), runs=pair_runs(cands), with_hidden=True,
        with_weight=True, with_bias=True,
    )
    expected = _expected_linear_grads(grad, hidden, weight, cands)
    for got, want in zip((dhidden, dweight, dbias), expected):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    _assert_weight_padding_untouched(weight_parent, bias_parent)


@pytest.mark.parametrize("backend", BACKENDS)
def test_candidate_linear_backward_leaves_the_first_and_last_rows_zero_without_their_tokens(backend):
    """Bad ids below 0 and at or past V while neither token 0 nor V - 1 is a candidate: rows 0
    and V - 1 of dW and db, the valid rows nearest the bad ids, stay exactly 0 (a bad id's run
    written to its nearest row would show there); the other rows as the reference."""
    ops = get_backend(backend, DEVICE)
    weight_parent, weight, bias_parent, bias, hidden, cands = _linear_case(torch.Generator().manual_seed(9))
    cands = torch.where(cands == 0, 1, torch.where(cands == V - 1, V - 2, cands))
    grad = _linear_grad(cands)
    _, dweight, dbias = ops.kept_linear_backward(
        grad.reshape(-1), hidden, weight, KeptSets.from_candidates(cands), runs=pair_runs(cands), with_hidden=False,
        with_weight=True, with_bias=True,
    )
    _, want_dweight, want_dbias = _expected_linear_grads(grad, hidden, weight, cands)
    assert torch.equal(dweight[[0, V - 1]], torch.zeros_like(dweight[[0, V - 1]]))
    assert torch.equal(dbias[[0, V - 1]], torch.zeros_like(dbias[[0, V - 1]]))
    torch.testing.assert_close(dweight.double(), want_dweight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dbias.double(), want_dbias, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_candidate_linear_backward_with_a_one_row_vocabulary_writes_only_its_token(backend):
    """V = 1: row 0 is both the first and the last row, next to the bad ids -2 and 1 on either
    side; dW[0] and db[0] are token 0's sums alone."""
    ops = get_backend(backend, DEVICE)
    gen = torch.Generator().manual_seed(10)
    hidden, weight = torch.randn(3, H, generator=gen).to(DEVICE), torch.randn(1, H, generator=gen).to(DEVICE)
    cands = torch.tensor([[-2, 0], [1, 0], [0, 1]], device=DEVICE)
    valid = cands == 0
    grad = torch.where(valid, torch.tensor([[0.0, 0.5], [0.0, -1.5], [2.0, 0.0]], device=DEVICE), float("nan"))
    _, dweight, dbias = ops.kept_linear_backward(
        grad.reshape(-1), hidden, weight, KeptSets.from_candidates(cands), runs=pair_runs(cands), with_hidden=False,
        with_weight=True, with_bias=True,
    )
    g = torch.where(valid, grad, 0.0).double().sum(1)
    torch.testing.assert_close(dweight.double(), (g[:, None] * hidden.double()).sum(0, keepdim=True),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dbias.double(), g.sum().view(1), rtol=1e-5, atol=1e-6)


@needs_triton
def test_triton_weight_grad_does_not_write_ids_outside_the_vocabulary():
    """The Triton dW / db kernels write into buffers given to them: views of sentinel-filled
    parents here, so that a store at a bad token's row (the run kernel for -2, V and
    ROW_STRIDE + 5; the combine kernel for V + 3, whose run crosses a segment) would show."""
    from tpo_kernels.backends.triton.candidate_weight_grad import weight_grad

    weight_parent, weight, bias_parent, bias, hidden, cands = _linear_case(torch.Generator().manual_seed(7))
    grad = _linear_grad(cands)
    dweight_parent, dbias_parent = torch.full_like(weight_parent, SENTINEL), torch.full_like(bias_parent, SENTINEL)
    dweight, dbias = dweight_parent[2 : V + 2], dbias_parent[2 : V + 2]
    dweight.zero_()
    dbias.zero_()
    weight_grad(grad.reshape(-1), hidden, cands.reshape(-1), KeptSets.from_candidates(cands).rows, pair_runs(cands),
                dweight, dbias, V)
    _, want_dweight, want_dbias = _expected_linear_grads(grad, hidden, weight, cands)
    torch.testing.assert_close(dweight.double(), want_dweight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dbias.double(), want_dbias, rtol=1e-5, atol=1e-6)
    _assert_weight_padding_untouched(dweight_parent, dbias_parent)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_logprobs_give_nan_for_labels_beyond_the_vocabulary(backend):
    """The fused-linear path has no row of its own to guard: its vocabulary tiles read a label
    outside them as column 0, and the op turns a label >= V into NaN (validate=False)."""
    gen = torch.Generator().manual_seed(8)
    hidden, weight = torch.randn(6, H, generator=gen).to(DEVICE), torch.randn(V, H, generator=gen).to(DEVICE)
    labels = torch.tensor(ROW_LABELS, device=DEVICE)
    logprobs, entropy = tpo_kernels.fused_linear_logprobs(hidden, weight, labels, backend=backend, validate=False,
                                                          return_entropy=True)
    bad, valid = list(range(len(BAD_LABELS))), len(BAD_LABELS)
    assert torch.isnan(logprobs[bad]).all() and torch.isnan(entropy[bad]).all()
    log_p = torch.log_softmax(hidden[valid].double() @ weight.double().T, dim=0)
    torch.testing.assert_close(logprobs[valid].double(), log_p[5], rtol=1e-5, atol=1e-6)
    assert logprobs[valid + 1] == 0
