"""The row ops' record (tpo_kernels/backends/rows.py): every backend's ``row_forward``
returns a ``RowSummary`` whose fields equal the torch backend's, ``row_backward`` takes it back
whole, and everything that carries one (the custom ops through ``to_op`` / ``from_op``, the
vocabulary-parallel gather) walks its fields by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tpo_kernels.backends import get_backend
from tpo_kernels.backends.rows import FIELD_NAMES, RowSummary
from tpo_kernels.distributed import vocab_parallel

from _backends import DEVICE, DEVICE_BACKENDS, INTERPRETED_BACKENDS

BACKENDS = DEVICE_BACKENDS + INTERPRETED_BACKENDS
V = 37  # odd: the kernels' unaligned edges and masked tail both run
INV_T = 1.0 / 0.7
# A counted label, an ignored row, labels at both ends of the vocabulary, one past it.
LABELS = [3, -100, 0, V - 1, V, 11]


def _rows(dtype=torch.float32, rows=len(LABELS), seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, V, generator=gen, dtype=torch.float64) * 3).to(dtype).to(DEVICE)
    return logits, torch.tensor(LABELS[:rows], device=DEVICE)


def _assert_same_fields(got: RowSummary, want: RowSummary, tol: float):
    for name, value in want.items():
        other = getattr(got, name)
        if value is None:
            assert other is None, name
            continue
        assert other.dtype == value.dtype and other.shape == value.shape, name
        if value.dtype == torch.bool:
            assert torch.equal(other, value), name
        else:
            torch.testing.assert_close(other, value, rtol=tol, atol=tol, equal_nan=True, msg=name)


@pytest.mark.parametrize("with_entropy", [False, True], ids=["no_entropy", "entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_returns_the_torch_backends_summary(backend, dtype, with_entropy):
    logits, labels = _rows(dtype)
    got = get_backend(backend, DEVICE).row_forward(logits, labels, inv_temperature=INV_T, with_entropy=with_entropy)
    want = get_backend("torch", DEVICE).row_forward(logits, labels, inv_temperature=INV_T,
                                                    with_entropy=with_entropy)
    assert isinstance(got, RowSummary) and isinstance(want, RowSummary)
    _assert_same_fields(got, want, 2e-5)
    # has_label of a whole row: its label lies in [0, V) (not for an ignored row, nor one >= V).
    assert want.has_label.tolist() == [0 <= y < V for y in LABELS]


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_backward_takes_the_summary_it_returned(backend):
    logits, labels = _rows()
    ops, reference = get_backend(backend, DEVICE), get_backend("torch", DEVICE)
    grad = torch.linspace(-1.0, 1.0, len(LABELS), device=DEVICE)
    grad_entropy = torch.linspace(0.5, -0.5, len(LABELS), device=DEVICE)
    summary = ops.row_forward(logits, labels, inv_temperature=INV_T, with_entropy=True)
    got, want = torch.empty_like(logits), torch.empty_like(logits)
    ops.row_backward(logits, labels, summary, grad, grad_entropy=grad_entropy, inv_temperature=INV_T, out=got)
    reference.row_backward(logits, labels, reference.row_forward(logits, labels, inv_temperature=INV_T,
                                                                 with_entropy=True),
                           grad, grad_entropy=grad_entropy, inv_temperature=INV_T, out=want)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_entropy_gradient_needs_the_summarys_entropy(backend):
    logits, labels = _rows()
    ops = get_backend(backend, DEVICE)
    summary = ops.row_forward(logits, labels, inv_temperature=1.0, with_entropy=False)
    grad = torch.ones(len(LABELS), device=DEVICE)
    with pytest.raises(ValueError, match="grad_entropy needs the forward's entropy"):
        ops.row_backward(logits, labels, summary, grad, grad_entropy=grad, inv_temperature=1.0,
                         out=torch.empty_like(logits))


@pytest.mark.parametrize("rows", [len(LABELS), 0], ids=["rows", "no_rows"])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["no_entropy", "entropy"])
def test_to_op_and_from_op_round_trip(with_entropy, rows):
    logits, labels = _rows(rows=rows)
    summary = get_backend("torch", DEVICE).row_forward(logits, labels, inv_temperature=INV_T,
                                                       with_entropy=with_entropy)
    flat = summary.to_op()
    assert len(flat) == len(FIELD_NAMES) and all(isinstance(t, torch.Tensor) for t in flat)
    if not with_entropy:  # an absent entropy travels as an empty tensor of the compute dtype
        entropy = flat[FIELD_NAMES.index("entropy")]
        assert entropy.shape == (0,) and entropy.dtype == summary.log_sum.dtype
    back = RowSummary.from_op(flat, fields=("entropy",) if with_entropy else ())
    for name, value in summary.items():
        assert getattr(back, name) is value, name  # the same tensors, not copies


def test_the_custom_ops_return_one_tensor_per_field():
    """The schemas follow the record: a new field is a new output without an edit to the ops."""
    import tpo_kernels.ops  # noqa: F401 - registers the ops

    ops = torch.ops.tpo_kernels
    assert len(ops.logprobs.default._schema.returns) == len(FIELD_NAMES)
    assert len(ops.linear_logprobs.default._schema.returns) == len(FIELD_NAMES) + 1  # and the logits cache


def test_select_assign_and_zeros_walk_every_field():
    logits, labels = _rows()
    summary = get_backend("torch", DEVICE).row_forward(logits, labels, inv_temperature=INV_T, with_entropy=True)
    whole = RowSummary.zeros(len(LABELS), dtype=torch.float32, device=DEVICE, fields=("entropy",))
    assert not whole.has_label.any() and whole.has_label.dtype == torch.bool
    for rows in (slice(0, 2), torch.tensor([2, 3, 4, 5], device=DEVICE)):
        whole.assign(rows, summary.select(rows))
    _assert_same_fields(whole, summary, 0.0)


@pytest.mark.parametrize("with_entropy", [False, True], ids=["no_entropy", "entropy"])
def test_vocabulary_parallel_merge_gathers_the_fields_by_name(with_entropy, monkeypatch):
    """VocabShard.merge over two shards of the vocabulary (the all-gather replaced by the two
    shards' stacked partials, as every rank receives them) equals the whole row's summary."""
    logits, labels = _rows(torch.float64)
    torch_ops, split = get_backend("torch", DEVICE), 16
    shards = []
    for start, stop in ((0, split), (split, V)):
        local = labels - start
        owned = (labels >= 0) & (local >= 0) & (local < stop - start)
        read = torch.where(labels >= 0, torch.where(owned, local, 0), -1)  # stand-in label 0 elsewhere
        part = torch_ops.row_forward(logits[:, start:stop].contiguous(), read, inv_temperature=INV_T,
                                     with_entropy=with_entropy)
        shards.append(dataclasses.replace(part, has_label=owned))

    def fake_all_gather(stacked, group, what):
        """What every rank receives: each rank's [C, M] partials (one row per present field), in
        rank order; this rank holds the first shard."""
        assert stacked.shape == (len(FIELD_NAMES) - (not with_entropy), len(LABELS))
        other = torch.stack([value.to(stacked.dtype) for _, value in shards[1].items() if value is not None])
        return torch.stack([stacked, other])

    monkeypatch.setattr(vocab_parallel, "all_gather_stacked", fake_all_gather)
    seam = vocab_parallel.VocabShard(group=None, start=0, size=split, vocab_size=V)
    merged = seam.merge(shards[0], INV_T)
    whole = torch_ops.row_forward(logits, labels, inv_temperature=INV_T, with_entropy=with_entropy)
    # The rows whose label lies in the vocabulary (an ignored row or one past it is zeroed, or
    # refused, by the ops around the merge).
    keep = (labels >= 0) & (labels < V)
    _assert_same_fields(merged.select(keep), whole.select(keep), 1e-12)
