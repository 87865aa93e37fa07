"""Row layouts whose rows overlap, at the backend boundary: a ``[M, V]`` matrix with row stride
below V (an ``expand``, stride 0, is the extreme), or a ``[1, T, V]`` view with ``stride(1) < V``.

The public functions copy such layouts before a backend sees them; a direct ``Backend`` call (a
user's own backend code, the bench) reaches the backend with them. Reading overlapping rows is
harmless, writing them is not: a kernel that stored each row in place would have several
programs store the same addresses (a race on a GPU), and in place it would read rows that
another program already overwrote. Every backend therefore reads such logits from a copy and
writes the gradient through a buffer of its own, then ``out.copy_(buffer)``: ``out`` ends as
PyTorch's copy leaves it, and an ``out`` that repeats one memory location (an ``expand``) is
refused by that copy. One predicate decides it for the native and the Triton backends
(``backends.rows_in_place``)."""

import pytest
import torch

from tpo_kernels.backends import get_backend
from tpo_kernels.backends.rows import rows_in_place
from tpo_kernels.backends import TorchBackend

from _backends import DEVICE, backend_available, backend_params

ROWS, VOCAB = 4, 13
BACKENDS = backend_params("torch", "cpu", "triton")


def _overlapping(storage: torch.Tensor, layout: str) -> torch.Tensor:
    """A view of ``storage`` whose rows overlap: rows 3 columns apart (``rows``), or the same
    rows as one batch entry (``batch_of_one``)."""
    if layout == "rows":
        return storage.as_strided((ROWS, VOCAB), (VOCAB - 3, 1))
    return storage.as_strided((1, ROWS, VOCAB), (ROWS * VOCAB, VOCAB - 3, 1))


def _case(layout):
    gen = torch.Generator().manual_seed(0)
    storage = (torch.randn(ROWS * VOCAB, generator=gen) * 2).to(DEVICE)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=gen).to(DEVICE)
    grads = torch.randn(2, ROWS, generator=gen).to(DEVICE)
    return storage, labels, grads


LAYOUTS = ["rows", "batch_of_one"]


@pytest.mark.parametrize("layout", LAYOUTS + ["expand"])
def test_overlapping_rows_are_not_walked_in_place(layout):
    storage, _, _ = _case(layout)
    view = storage[:VOCAB].expand(ROWS, VOCAB) if layout == "expand" else _overlapping(storage, layout)
    assert not rows_in_place(view)
    assert rows_in_place(view.contiguous()) and rows_in_place(storage[: ROWS * VOCAB].view(ROWS, VOCAB)[:, :-1])


@pytest.mark.skipif(not backend_available("triton"), reason="triton backend not available")
@pytest.mark.parametrize("layout", LAYOUTS + ["expand"])
def test_triton_reads_overlapping_rows_from_a_copy(layout):
    from tpo_kernels.backends.triton import row_layout

    storage, _, _ = _case(layout)
    view = storage[:VOCAB].expand(ROWS, VOCAB) if layout == "expand" else _overlapping(storage, layout)
    walked = row_layout.row_batch(view)
    assert walked is not view and walked.is_contiguous() and torch.equal(walked, view)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_row_backward_in_place_on_overlapping_rows_ends_as_a_copy_of_the_gradient(backend, layout):
    """In place on overlapping rows: ``out`` (the logits view) ends as ``out.copy_(gradient)``
    would leave it, the gradient being that of the logits' values before the call."""
    storage, labels, (g, ge) = _case(layout)
    logits = _overlapping(storage, layout)
    ops = get_backend(backend, DEVICE)
    summary = ops.row_forward(logits, labels.reshape(logits.shape[:-1]), inv_temperature=1.3, with_entropy=True)
    gradient = torch.empty(logits.shape, device=DEVICE)
    TorchBackend().row_backward(logits.contiguous(), labels, summary, g, grad_entropy=ge, inv_temperature=1.3,
                                out=gradient)
    expected_storage = storage.clone()
    _overlapping(expected_storage, layout).copy_(gradient)

    ops.row_backward(logits, labels, summary, g, grad_entropy=ge, inv_temperature=1.3, out=logits)
    torch.testing.assert_close(storage, expected_storage, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_backward_into_an_expanded_out_is_refused_by_the_copy(backend):
    storage, labels, (g, _) = _case("expand")
    logits = storage.view(ROWS, VOCAB)
    ops = get_backend(backend, DEVICE)
    summary = ops.row_forward(logits, labels, inv_temperature=1.0, with_entropy=False)
    out = torch.zeros(VOCAB, device=DEVICE).expand(ROWS, VOCAB)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        ops.row_backward(logits, labels, summary, g, inv_temperature=1.0, out=out)


def test_torch_backend_chunked_in_place_on_overlapping_rows_reads_the_values_before_the_call(monkeypatch):
    """The torch backend walks rows in chunks: with one row per chunk, an in-place write of a row
    would change the next row's logits before it is read, unless ``out`` goes through a buffer."""
    import tpo_kernels.backends as torch_backend_module

    monkeypatch.setattr(torch_backend_module, "_CHUNK_ELEMENTS", VOCAB)  # one row per chunk
    storage, labels, (g, _) = _case("rows")
    logits = _overlapping(storage, "rows")
    ops = TorchBackend()
    summary = ops.row_forward(logits, labels, inv_temperature=1.0, with_entropy=False)
    gradient = torch.empty(logits.shape, device=DEVICE)
    ops.row_backward(logits.contiguous(), labels, summary, g, inv_temperature=1.0, out=gradient)
    expected_storage = storage.clone()
    _overlapping(expected_storage, "rows").copy_(gradient)

    ops.row_backward(logits, labels, summary, g, inv_temperature=1.0, out=logits)
    torch.testing.assert_close(storage, expected_storage, rtol=0, atol=0)
