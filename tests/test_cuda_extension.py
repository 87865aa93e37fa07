"""The CUDA extension (``tpo_kernels._C_cuda``, backend ``cuda``) against the torch backend and
the portable group op. The kernel tests need a GPU and are skipped without one; the binding's
argument checks run wherever the extension is built (they reject a call before any CUDA work).
Tolerances: see tests/_native_helpers.py."""

from __future__ import annotations

import pytest
import torch

from tpo_kernels.backends.rows import compute_dtype
from tpo_kernels.backends import torch_kept
from tpo_kernels.backends.kept_sets import KeptSets
from tpo_kernels.backends import TorchBackend
from tpo_kernels.group_math import build_layout, portable_group_targets as torch_group_targets

from _backends import CUDA_EXTENSION, needs_cuda, needs_cuda_extension, stats_logprob_entropy
from _native_helpers import (
    DTYPES,
    cuda_backend,
    ent_tol,
    fwd_tol,
    grad_tol,
    make_rows,
)

TORCH = TorchBackend()


# ----------------------------------------------------------------------------------------------
# Binding and backend checks (no GPU needed)
# ----------------------------------------------------------------------------------------------


@needs_cuda_extension
def test_binding_rejects_bad_arguments_before_launching():
    x = torch.randn(4, 8)  # host memory: nothing may be launched on it
    lab = torch.zeros(4, dtype=torch.int64)
    good = dict(dtype=0, rows=0, vocab=8, row_stride=8, logits=x.data_ptr(), labels=lab.data_ptr(),
                inv_temperature=1.0, row_max=1, log_sum=1, logprob=1, device=0, stream=0)
    CUDA_EXTENSION.row_forward(**good)  # no rows: checked, nothing to launch
    for change, message in [
        ({"rows": 4, "logits": 0}, "null"),
        ({"rows": -1}, "rows"),
        ({"row_stride": 7}, "row_stride"),
        ({"dtype": 4}, "dtype"),
        ({"inv_temperature": float("inf")}, "inv_temperature"),
        ({"device": -1}, "device"),
    ]:
        with pytest.raises(ValueError, match=message):
            CUDA_EXTENSION.row_forward(**{**good, **change})
    with pytest.raises(TypeError, match="missing required keyword argument 'device'"):
        CUDA_EXTENSION.row_forward(**{k: v for k, v in good.items() if k != "device"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'weight'"):
        CUDA_EXTENSION.row_forward(**good, weight=1.0)
    group = dict(dtype=0, num_groups=1, token_logprobs=1, seq_start=1, seq_len=1, group_offsets=1,
                 group_members=1, scores=1, eta=1.0, score_eps=0.0, anchor=True, seq_logprobs=1, u=1, p=1, q=1,
                 group_loss=1, device=0, stream=0)
    for change, message in [
        ({"dtype": 1}, "float32.*float64"),
        ({"eta": 0.0}, "eta"),
        ({"score_eps": -1e-6}, "score_eps"),
        ({"num_groups": -1}, "num_groups"),
        ({"q": 0}, "q is a null pointer"),
    ]:
        with pytest.raises(ValueError, match=message):
            CUDA_EXTENSION.group_targets(**{**group, **change})
    # The group op takes no loss weight and writes no coefficient.
    for extra in ("weight", "coef"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{extra}'"):
            CUDA_EXTENSION.group_targets(**group, **{extra: 1})


@needs_cuda_extension
def test_row_kernel_pack_loops_are_short_enough_to_be_bound_by_memory():
    """Common-path SASS instructions per 16-byte pack of the built kernels' main loops (sm_90),
    every dtype and variant: at most 72 for bf16/fp16 and 40 for fp32 (measured 49-66 and 21-35),
    below the ~100 at which an H100/H200 becomes bound by instruction issue, with several packs
    loaded per iteration (the previous kernels, one pack and 150-250 / 70-130 instructions per
    pack, fail)."""
    from bench.kernel_report.loops import binary_loops

    loops = binary_loops(CUDA_EXTENSION.__file__, "90")
    found = {(l.kernel, l.dtype, l.variant) for l in loops}
    for kernel in ("row_forward_kernel", "row_backward_kernel"):
        for dtype in ("fp32", "bf16", "fp16"):
            for variant in ("plain", "entropy"):
                assert (kernel, dtype, variant) in found
    for l in loops:
        budget = 40 if l.dtype == "fp32" else 72
        assert l.common_per_pack <= budget, (l.kernel, l.dtype, l.variant, l.common_per_pack)
        assert l.packs >= 4, (l.kernel, l.dtype, l.variant)  # several packs loaded before use


KEPT_SET_OPS = ("kept_gather", "kept_scatter", "kept_linear_forward", "ragged_row_forward", "ragged_row_backward")


@needs_cuda_extension
@pytest.mark.parametrize("name", KEPT_SET_OPS)
def test_the_extension_exports_the_kept_set_op_with_its_signature(name):
    """The CUDA extension defines the kept-set op, documented by the signature binding_args.h
    shares with the CPU extension (the CPU ops carry the same text where both define one)."""
    doc = getattr(CUDA_EXTENSION, name).__doc__
    assert f"{name}(*, dtype, rows, " in doc
    assert "offsets" in doc and "num_pairs" in doc


def _kept_call(name, **change):
    """A call of the kept-set op `name` that the binding accepts without launching (no rows, host
    addresses), with `change` applied."""
    x = torch.zeros(8)
    common = dict(dtype=0, rows=0, num_pairs=0, ids=x.data_ptr(), offsets=x.data_ptr(), device=0, stream=0)
    fields = {
        "kept_gather": dict(vocab=8, row_stride=8, logits=1, kept_logits=1),
        "kept_scatter": dict(vocab=8, row_stride=8, grad=1, out=1),
        "kept_linear_forward": dict(hidden_size=4, vocab=8, hidden=1, hidden_row_stride=4, weight=1,
                                    weight_row_stride=4, out=1),
        "ragged_row_forward": dict(kept_logits=1, label_slot=1, inv_temperature=1.0, row_max=1, log_sum=1,
                                   logprob=1),
        "ragged_row_backward": dict(kept_logits=1, label_slot=1, inv_temperature=1.0, row_max=1, log_sum=1,
                                    logprob=1, grad_logprob=1, out=1),
    }[name]
    return {**common, **fields, **change}


@needs_cuda_extension
@pytest.mark.parametrize("name, change, message", [
    ("kept_gather", {"row_stride": 7}, "row_stride"),
    ("kept_gather", {"dtype": 4}, "dtype"),
    ("kept_gather", {"rows": 2, "rows_per_batch": 3}, "rows_per_batch"),
    ("kept_gather", {"rows": 2, "offsets": 0}, "offsets is a null pointer"),
    ("kept_gather", {"rows": 2, "num_pairs": 3, "kept_logits": 0}, "kept_logits is a null pointer"),
    ("kept_scatter", {"num_pairs": -1}, "num_pairs"),
    ("kept_scatter", {"rows": 2, "out": 0}, "out is a null pointer"),
    ("kept_scatter", {"rows": 2, "num_pairs": 3, "grad": 0}, "grad is a null pointer"),
    ("kept_linear_forward", {"hidden_row_stride": 3}, "hidden_row_stride"),
    ("kept_linear_forward", {"vocab": 0}, "vocab"),
    ("ragged_row_forward", {"dtype": 2}, "float32.*float64"),
    ("ragged_row_forward", {"inv_temperature": 0.0}, "inv_temperature"),
    ("ragged_row_forward", {"rows": 2, "label_slot": 0}, "label_slot is a null pointer"),
    ("ragged_row_backward", {"rows": 2, "grad_entropy": 1}, "grad_entropy needs entropy"),
    ("ragged_row_backward", {"device": -1}, "device"),
])
def test_the_kept_set_bindings_reject_bad_arguments_before_launching(name, change, message):
    with pytest.raises(ValueError, match=message):
        getattr(CUDA_EXTENSION, name)(**_kept_call(name, **change))


@needs_cuda_extension
@pytest.mark.parametrize("name", KEPT_SET_OPS)
def test_the_kept_set_bindings_take_device_and_stream(name):
    getattr(CUDA_EXTENSION, name)(**_kept_call(name))  # no rows: checked, nothing to launch
    with pytest.raises(TypeError, match="missing required keyword argument 'device'"):
        getattr(CUDA_EXTENSION, name)(**{k: v for k, v in _kept_call(name).items() if k != "device"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_threads'"):
        getattr(CUDA_EXTENSION, name)(**_kept_call(name), num_threads=1)


@needs_cuda_extension
def test_the_kept_set_bindings_never_read_the_offsets_on_the_host():
    """The offsets are device memory: the binding checks the pointer, not the values (the kernels
    clamp each row's range), so an address that is no host memory at all passes (the CPU binding
    reads and checks every offset)."""
    for name in KEPT_SET_OPS:
        getattr(CUDA_EXTENSION, name)(**_kept_call(name, offsets=16))


class _RecordingExtension:
    """Stands in for _C_cuda on CPU tensors: records each call, then has the real binding check
    its keywords (with no rows and no pairs, so that nothing is launched)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(**kwargs):
            self.calls.append((name, kwargs))
            getattr(CUDA_EXTENSION, name)(**{**kwargs, "rows": 0, "num_pairs": 0})

        return call


@pytest.fixture
def recording_backend(monkeypatch):
    from tpo_kernels.backends.cuda import CudaBackend

    monkeypatch.setattr(CudaBackend, "_launch_args", lambda self, t, what: {"device": 0, "stream": 0})
    monkeypatch.setattr(CudaBackend, "unavailable_reason", lambda self: None)
    backend = CudaBackend()
    backend._ext = _RecordingExtension()
    return backend


@needs_cuda_extension
def test_the_cuda_backend_launches_its_own_kept_set_kernels(recording_backend):
    """Gather, scatter, ragged forward / backward and the kept dot products are the extension's
    (the kernels' keywords accepted by the binding); the linear backward is not a CUDA kernel."""
    from tpo_kernels.backends.kept_sets import KeptSets

    be = recording_backend
    kept = KeptSets.from_padded(torch.tensor([[3, -1], [5, 3], [1, 2]]), torch.tensor([3, 5, 2]))
    z = be.kept_gather(torch.randn(3, 8), kept)
    be.kept_scatter(torch.ones(6), kept, out=torch.empty(3, 8))
    summary = be.ragged_row_forward(torch.zeros(6), kept, inv_temperature=1.0, with_entropy=True)
    be.ragged_row_backward(torch.zeros(6), kept, summary, torch.ones(3), grad_entropy=torch.ones(3),
                           inv_temperature=1.0, out=torch.empty(6))
    be.kept_linear_forward(torch.randn(3, 4), torch.randn(8, 4), kept, bias=torch.randn(8))
    calls = dict(be._ext.calls)
    assert list(calls) == ["kept_gather", "kept_scatter", "ragged_row_forward", "ragged_row_backward",
                           "kept_linear_forward"]
    assert z.shape == (6,)
    assert calls["kept_gather"]["rows"] == 3 and calls["kept_gather"]["num_pairs"] == 6
    assert calls["kept_linear_forward"]["bias"] != 0 and calls["kept_linear_forward"]["vocab"] == 8
    assert calls["ragged_row_backward"]["grad_entropy"] != 0 and calls["ragged_row_backward"]["entropy"] != 0


@needs_cuda_extension
def test_the_cuda_kept_gather_reads_a_batched_view_in_place(recording_backend):
    """``logits[:, :-1]`` (rows that do not flatten) is passed as it lies, one launch."""
    from tpo_kernels.backends.kept_sets import KeptSets

    source = torch.randn(2, 4, 8)
    view = source[:, :-1]
    kept = KeptSets.from_padded(torch.zeros(6, 2, dtype=torch.int64), torch.zeros(6, dtype=torch.int64))
    recording_backend.kept_gather(view, kept)
    (_, call), = recording_backend._ext.calls
    assert call["logits"] == view.data_ptr()
    assert (call["rows"], call["rows_per_batch"], call["batch_stride"], call["row_stride"]) == (6, 3, 32, 8)


@pytest.mark.parametrize("op", ["ragged_row_forward", "kept_gather"])
def test_the_kept_set_ops_reject_host_tensors(op):
    from tpo_kernels.backends.kept_sets import KeptSets

    kept = KeptSets.from_padded(torch.tensor([[1, 2]]), torch.tensor([1]))
    with pytest.raises(ValueError, match="the cuda backend needs CUDA tensors"):
        if op == "kept_gather":
            cuda_backend().kept_gather(torch.zeros(1, 4), kept)
        else:
            cuda_backend().ragged_row_forward(torch.zeros(2), kept, inv_temperature=1.0, with_entropy=False)


def test_group_op_rejects_host_tensors():
    layout = build_layout(6, torch.device("cpu"), padded_shape=(2, 3), group_size=2)
    with pytest.raises(ValueError, match="CUDA tensors, got token_logprobs on cpu"):
        cuda_backend().group_targets(torch.zeros(6), layout, torch.zeros(2), eta=1.0, anchor=True)


# ----------------------------------------------------------------------------------------------
# Kernels (GPU)
# ----------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1000, 32_003, 151_936])
def test_row_forward_backward_match_torch(dtype, vocab):
    logits, labels = make_rows(33, vocab, dtype, device="cuda", skip=(3,))
    it = 1.0 / 0.7
    be = cuda_backend()
    summary = be.row_forward(logits, labels, inv_temperature=it, with_entropy=True)
    stats, lp, entropy = stats_logprob_entropy(summary)
    t_summary = TORCH.row_forward(logits, labels, inv_temperature=it, with_entropy=True)
    t_stats, t_lp, t_entropy = stats_logprob_entropy(t_summary)
    torch.testing.assert_close(stats, t_stats, **fwd_tol(dtype))
    torch.testing.assert_close(lp, t_lp, **fwd_tol(dtype))
    torch.testing.assert_close(entropy, t_entropy, **ent_tol(dtype))
    acc = compute_dtype(dtype)
    g = torch.randn(33, dtype=acc, device="cuda")
    ge = torch.randn(33, dtype=acc, device="cuda")
    g[7] = ge[7] = 0.0
    for ge_arg in (None, ge):
        kwargs = dict(grad_entropy=ge_arg, inv_temperature=it)
        want = torch.empty_like(logits)
        TORCH.row_backward(logits, labels, t_summary, g, **kwargs, out=want)
        got = torch.empty_like(logits)
        be.row_backward(logits, labels, t_summary, g, **kwargs, out=got)
        torch.testing.assert_close(got, want, **grad_tol(dtype))
        in_place = logits.clone()
        be.row_backward(in_place, labels, t_summary, g, **kwargs, out=in_place)
        assert torch.equal(in_place, got)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_misaligned_rows_and_zero_rows(dtype):
    # Offset by one element and an odd vocab: every row starts at a different alignment.
    storage, _ = make_rows(1, 17 * 4097 + 1, dtype, device="cuda")
    logits = storage.view(-1)[1 : 1 + 17 * 4097].view(17, 4097)
    labels = torch.randint(0, 4097, (17,), device="cuda")
    logits[4] = float("nan")  # zero-signal row: never read
    summary = TORCH.row_forward(logits, labels, inv_temperature=1.0, with_entropy=False)
    stats, lp, _ = stats_logprob_entropy(summary)
    got_summary = cuda_backend().row_forward(logits, labels, inv_temperature=1.0, with_entropy=False)
    got_stats, got_lp, _ = stats_logprob_entropy(got_summary)
    keep = torch.arange(17, device="cuda") != 4
    torch.testing.assert_close(got_stats[:, keep], stats[:, keep], **fwd_tol(dtype))
    torch.testing.assert_close(got_lp[keep], lp[keep], **fwd_tol(dtype))
    g = torch.randn(17, device="cuda")
    g[4] = 0.0
    want = torch.empty_like(logits)
    TORCH.row_backward(logits, labels, summary, g, inv_temperature=1.0, out=want)
    cuda_backend().row_backward(logits, labels, summary, g, inv_temperature=1.0, out=logits)  # in place
    torch.testing.assert_close(logits[keep], want[keep], **grad_tol(dtype))
    assert (logits[4] == 0).all()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["head", "label", "alone_in_a_masked_row", "remainder_pack", "tail"])
def test_row_forward_nan_or_inf_logit_makes_the_row_nan(dtype, value, where):
    """No NaN flag in the kernel: the bad logit reaches the sums (2^(NaN - m), 2^(inf - inf)) in
    every part of a row (unaligned head, 4-pack groups, single-pack remainder, tail, the label's
    own column) and no max, rescale or block merge makes them finite again."""
    n = 16 // torch.tensor([], dtype=dtype).element_size()
    head = n - 1  # rows start one element past a 16-byte boundary
    vocab = head + 562 * n + 1  # 562 packs (128 threads: 4 x 128 in groups, 50 single) and a tail
    storage, _ = make_rows(1, 3 * vocab + 1, dtype, device="cuda")
    logits = storage.view(-1)[1 : 1 + 3 * vocab].view(3, vocab)
    labels = torch.randint(0, vocab, (3,), device="cuda")
    labels[0] = head + 100 * n + 3
    column = {"head": 0, "label": head + 100 * n + 3, "alone_in_a_masked_row": head + 130 * n + 5,
              "remainder_pack": head + 540 * n + 2, "tail": vocab - 1}[where]
    if where == "alone_in_a_masked_row":  # the bad logit's thread sees nothing finite
        label_logit = logits[0, labels[0]].clone()
        logits[0] = float("-inf")
        logits[0, labels[0]] = label_logit
    logits[0, column] = value
    summary = cuda_backend().row_forward(logits, labels, inv_temperature=1.0, with_entropy=True)
    stats, lp, entropy = stats_logprob_entropy(summary)
    for name, t in (("row_max", stats[0]), ("log_sum", stats[1]), ("logprob", lp), ("entropy", entropy)):
        assert torch.isnan(t[0]), name
        assert torch.isfinite(t[1:]).all(), name
    t_summary = TORCH.row_forward(logits[1:], labels[1:], inv_temperature=1.0, with_entropy=True)
    t_stats, t_lp, t_entropy = stats_logprob_entropy(t_summary)
    torch.testing.assert_close(stats[:, 1:], t_stats, **fwd_tol(dtype))
    torch.testing.assert_close(lp[1:], t_lp, **fwd_tol(dtype))
    torch.testing.assert_close(entropy[1:], t_entropy, **ent_tol(dtype))


@needs_cuda
def test_skipped_rows_and_invalid_labels_are_not_read():
    logits, labels = make_rows(6, 777, torch.float32, device="cuda", skip=(2,))
    logits[2] = float("nan")
    labels[4] = 777  # out of range: never dereferenced, reported as NaN
    summary = cuda_backend().row_forward(logits, labels, inv_temperature=1.0, with_entropy=True)
    stats, lp, entropy = stats_logprob_entropy(summary)
    assert stats[0, 2].item() == stats[1, 2].item() == lp[2].item() == entropy[2].item() == 0.0
    assert torch.isnan(stats[1, 4]) and torch.isnan(lp[4])


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_candidate_gather_and_scatter_match_torch_and_are_deterministic(dtype):
    """Token-level candidates as kept sets of 8 pairs per row (many duplicates) through the
    extension's kept-set gather and scatter."""
    logits, _ = make_rows(300, 5000, dtype, device="cuda")
    cand = torch.randint(0, 40, (300, 8), device="cuda")  # many duplicates
    kept = KeptSets.from_candidates(cand)
    grad = torch.randn(300 * 8, dtype=compute_dtype(dtype), device="cuda")
    be = cuda_backend()
    assert torch.equal(be.kept_gather(logits, kept), torch_kept.kept_gather(logits, kept))
    outs = []
    for _ in range(2):
        out = torch.full_like(logits, 5.0)
        be.kept_scatter(grad, kept, out=out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    want = torch.empty_like(logits)
    torch_kept.kept_scatter(grad, kept, out=want)
    torch.testing.assert_close(outs[0], want, **grad_tol(dtype))
    # A row-strided output is zeroed and written row by row; the columns beyond it stay.
    wide = torch.full((300, 5100), 5.0, dtype=dtype, device="cuda")
    be.kept_scatter(grad, kept, out=wide[:, :5000])
    assert torch.equal(wide[:, :5000], outs[0]) and (wide[:, 5000:] == 5.0).all()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grouping", ["contiguous", "ids", "packed"])
@pytest.mark.parametrize("anchor", [True, False])
def test_group_op_matches_torch(dtype, grouping, anchor):
    n, t = 12, 37
    device = torch.device("cuda")
    if grouping == "packed":
        lens = torch.randint(1, 40, (n,))
        cu = torch.zeros(n + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lens, 0)
        m = int(cu[-1]) + 5  # trailing rows outside every completion
        layout = build_layout(m, device, cu_seqlens=cu.to(device), group_size=4)
    elif grouping == "ids":
        m = n * t
        ids = torch.tensor([3, 1, 3, 2, 1, 1, 2, 3, 9, 9, 1, 2], device=device)
        layout = build_layout(m, device, padded_shape=(n, t), group_ids=ids)
    else:
        m = n * t
        layout = build_layout(m, device, padded_shape=(n, t), group_size=4)
    tokens = -torch.rand(m, dtype=dtype, device=device)
    scores = torch.randn(n, dtype=dtype, device=device)
    scores[:4] = 1.0  # a tied group (contiguous) / some ties elsewhere
    old = tokens.new_empty(n).uniform_(-30, -10)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for old_arg in (None, old):
        kwargs = dict(old_seq_logprobs=old_arg, eta=0.7, anchor=anchor)
        got = cuda_backend().group_targets(tokens, layout, scores, **kwargs)
        want = torch_group_targets(tokens, layout, scores, **kwargs)
        for name in ("seq_logprobs", "u", "p", "q", "group_loss"):
            value = getattr(got, name)
            assert value.dtype == dtype and value.device.type == "cuda", name
            torch.testing.assert_close(value, getattr(want, name), **tol, msg=name)
    if grouping == "contiguous":
        on_policy = cuda_backend().group_targets(tokens, layout, scores, eta=0.7, anchor=True)
        assert torch.equal(on_policy.p[:4], on_policy.q[:4])  # tied on-policy group: p - q == 0


@needs_cuda
def test_group_op_rejects_other_dtypes():
    layout = build_layout(6, torch.device("cuda"), padded_shape=(2, 3), group_size=2)
    tokens = torch.zeros(6, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(TypeError, match="float32 or float64 token_logprobs"):
        cuda_backend().group_targets(tokens, layout, torch.zeros(2, device="cuda"), eta=1.0, anchor=True)


@needs_cuda
def test_runs_on_the_current_stream():
    logits, labels = make_rows(64, 20_000, torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs were written on the default stream
    with torch.cuda.stream(side):
        summary = cuda_backend().row_forward(logits, labels, inv_temperature=1.0, with_entropy=False)
        stats, lp, _ = stats_logprob_entropy(summary)
    side.synchronize()
    t_summary = TORCH.row_forward(logits, labels, inv_temperature=1.0, with_entropy=False)
    t_stats, t_lp, _ = stats_logprob_entropy(t_summary)
    torch.testing.assert_close(stats, t_stats, **fwd_tol(torch.bfloat16))
    torch.testing.assert_close(lp, t_lp, **fwd_tol(torch.bfloat16))
