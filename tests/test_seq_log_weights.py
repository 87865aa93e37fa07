"""``seq_log_weights=``: per-completion log-weights ``lw = log w`` in the group distributions.

``p_i ∝ w_i exp(ell_i)`` and ``q_i ∝ w_i p_old_i exp(u_i / eta)`` (``p_old`` the unweighted group
softmax of the old sequence log-probs; ``q_i ∝ w_i exp(u_i / eta)`` without the anchor); ``u``
unweighted over the members with ``w > 0``; ``w = 0`` leaves the completion out of its group.
Checked against the float64 reference (tpo_kernels/reference.py) on every sequence-level function,
on the torch and cpu backends and the Triton group kernel (interpreted, tiny), and across two gloo
ranks of a ``process_group``; the context-parallel case is in tests/test_context_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

import tpo_kernels
from tpo_kernels import reference
from tpo_kernels.group_math import build_layout, portable_group_targets

from _backends import backend_params
from _dispatch import ReadBacks
from _distributed import run_ranks

BACKENDS = backend_params("torch", "cpu")
GROUP_KERNELS = backend_params("torch", "cpu", "triton")
F64 = dict(atol=1e-12, rtol=1e-12)
FP32 = dict(atol=2e-5, rtol=2e-4)
N, T, V, H, K = 6, 5, 13, 8, 3


def _batch(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    labels = torch.randint(0, V, (N, T), generator=gen)
    labels[0, 3:] = -100  # uneven lengths
    log_weights = rand(N) * 2
    log_weights[4] = float("-inf")  # w = 0
    return dict(logits=(rand(N, T, V) * 2).to(dtype), hidden=rand(N, T, H).to(dtype),
                weight=(rand(V, H) * 0.5).to(dtype), labels=labels, scores=rand(N),
                old_logprobs=(-torch.rand(N, T, generator=gen, dtype=torch.float64) * 3).to(dtype),
                log_weights=log_weights)


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _run(path, b, backend, **kw):
    """(loss, gradient of the path's input, aux) of ``path`` on batch ``b``."""
    if path == "tpo_loss":
        x = _leaf(b["logits"])
        loss, aux = tpo_kernels.tpo_loss(x, b["labels"], b["scores"], group_size=K, backend=backend,
                                         return_aux=True, **kw)
    elif path == "fused_linear_tpo_loss":
        x = _leaf(b["hidden"])
        loss, aux = tpo_kernels.fused_linear_tpo_loss(x, b["weight"], b["labels"], b["scores"], group_size=K,
                                                      backend=backend, return_aux=True, chunk_size=4, **kw)
    else:
        x = _leaf(torch.log_softmax(b["logits"].double(), -1).gather(-1, b["labels"].clamp(min=0)[..., None])[..., 0]
                  .to(b["logits"].dtype))
        loss, aux = tpo_kernels.tpo_loss_from_logprobs(x, b["scores"], mask=b["labels"] >= 0, group_size=K,
                                                       backend=backend, return_aux=True, **kw)
    loss.sum().backward()
    return loss.detach(), x.grad, aux


def _reference(path, b, **kw):
    """The float64 reference of ``_run``'s path."""
    if path == "fused_linear_tpo_loss":
        h = _leaf(b["hidden"].double())
        logits = h @ b["weight"].double().T
        loss = reference.tpo_loss(logits, b["labels"], b["scores"], group_size=K, **kw)
        loss.sum().backward()
        return loss.detach(), h.grad
    if path == "tpo_loss":
        x = _leaf(b["logits"].double())
        loss = reference.tpo_loss(x, b["labels"], b["scores"], group_size=K, **kw)
    else:
        x = _leaf(torch.log_softmax(b["logits"].double(), -1).gather(-1, b["labels"].clamp(min=0)[..., None])[..., 0])
        loss = reference.tpo_loss_from_logprobs(x, b["scores"], mask=b["labels"] >= 0, group_size=K, **kw)
    loss.sum().backward()
    return loss.detach(), x.grad


PATHS = ["tpo_loss", "fused_linear_tpo_loss", "tpo_loss_from_logprobs"]
OPTIONS = {
    "anchor": {},
    "anchor_off": dict(anchor=False),
    "length_normalize": dict(length_normalize=True),
    "off_policy": "old",
    "reduction_none": dict(reduction="none"),
}


def _options(b, name):
    return dict(old_logprobs=b["old_logprobs"]) if OPTIONS[name] == "old" else dict(OPTIONS[name])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, F64), (torch.float32, FP32)], ids=["f64", "f32"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_matches_the_reference(backend, dtype, tol, path, option):
    b = _batch(dtype)
    kw = _options(b, option)
    loss, grad, _ = _run(path, b, backend, seq_log_weights=b["log_weights"], **kw)
    want_loss, want_grad = _reference(path, b, seq_log_weights=b["log_weights"], **kw)
    torch.testing.assert_close(loss.double(), want_loss, **tol)
    torch.testing.assert_close(grad.double(), want_grad, **tol)


def test_float64_gradcheck():
    b = _batch()
    lw = b["log_weights"]

    def loss(logits):
        return tpo_kernels.tpo_loss(logits, b["labels"], b["scores"], group_size=K, backend="torch",
                                    seq_log_weights=lw, old_logprobs=b["old_logprobs"])

    assert torch.autograd.gradcheck(loss, (_leaf(b["logits"]),), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", PATHS)
def test_weight_one_is_bitwise_no_weight(backend, path):
    b = _batch(torch.float32)
    loss, grad, aux = _run(path, b, backend, old_logprobs=b["old_logprobs"])
    w_loss, w_grad, w_aux = _run(path, b, backend, old_logprobs=b["old_logprobs"],
                                 seq_log_weights=torch.zeros(N, dtype=torch.float64))
    assert torch.equal(loss, w_loss) and torch.equal(grad, w_grad)
    for name in ("p", "q", "u", "coef", "group_loss"):
        assert torch.equal(aux[name], w_aux[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("option", ["anchor", "anchor_off", "off_policy"])
def test_a_constant_per_group_changes_nothing(backend, option):
    b = _batch()
    kw = _options(b, option)
    per_group = torch.tensor([3.0, -40.0]).repeat_interleave(K).double()
    loss, grad, aux = _run("tpo_loss", b, backend, seq_log_weights=b["log_weights"], **kw)
    s_loss, s_grad, s_aux = _run("tpo_loss", b, backend, seq_log_weights=b["log_weights"] + per_group, **kw)
    torch.testing.assert_close(s_loss, loss, **F64)
    torch.testing.assert_close(s_grad, grad, **F64)
    torch.testing.assert_close(s_aux["p"], aux["p"], **F64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("validate", [True, False])
def test_weight_zero_is_leaving_the_completion_out(backend, validate):
    """w = 0 equals the completion with no counted token (left out of its group); with
    ``validate=False`` the group op masks it, and the result is the same (its group keeps members)."""
    b = _batch()
    loss, grad, aux = _run("tpo_loss", b, backend, seq_log_weights=b["log_weights"], validate=validate)
    out = dict(b, labels=b["labels"].clone())
    out["labels"][4] = -100
    o_loss, o_grad, o_aux = _run("tpo_loss", out, "torch", seq_log_weights=torch.where(
        b["log_weights"].isinf(), 0.0, b["log_weights"]))
    torch.testing.assert_close(loss, o_loss, **F64)
    torch.testing.assert_close(grad, o_grad, **F64)
    assert aux["p"][4] == 0 and aux["q"][4] == 0 and aux["u"][4] == 0 and (grad[4] == 0).all()
    torch.testing.assert_close(aux["u"], o_aux["u"], **F64)  # u over the members with w > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_of_zero_weights_is_dropped(backend):
    """validate=True: a group whose every w is 0 is dropped (G = 1); validate=False: it adds 0 and
    still counts in the mean over groups (documented)."""
    b = _batch()
    lw = torch.zeros(N, dtype=torch.float64)
    lw[K:] = float("-inf")
    kept, _, _ = _run("tpo_loss", b, backend, seq_log_weights=lw, reduction="none")
    assert kept.shape == (1,)
    masked, grad, _ = _run("tpo_loss", b, backend, seq_log_weights=lw, reduction="none", validate=False)
    assert masked[1] == 0 and (grad[K:] == 0).all()
    torch.testing.assert_close(masked[0], kept[0], **F64)


@pytest.mark.parametrize("backend", GROUP_KERNELS)
def test_a_tied_on_policy_group_keeps_zero_signal(backend):
    """ell + lw and base + lw are one same add in every group kernel: q == p bit for bit."""
    tokens = torch.randn(N * 2, dtype=torch.float64)
    layout = build_layout(tokens.numel(), torch.device("cpu"), padded_shape=(N, 2), group_size=K)
    scores = torch.tensor([0.5, 0.5, 0.5, 1.0, 2.0, 3.0], dtype=torch.float64)
    lw = torch.randn(N, dtype=torch.float64) * 3
    group_targets = tpo_kernels.backends.backend_by_key(backend).group_targets
    result = group_targets(tokens, layout, scores, seq_log_weights=lw, eta=0.7, anchor=True, score_eps=0.0)
    assert torch.equal(result.p[:K], result.q[:K]) and (result.coef[:K] == 0).all()
    assert (result.coef[K:] != 0).any()


@pytest.mark.parametrize("backend", GROUP_KERNELS)
def test_group_kernels_match_the_portable_op(backend):
    """Every group kernel (the Triton one interpreted here) on weights with a -inf, a group of only
    -inf, off-policy and without the anchor."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randn(9 * 3, generator=gen, dtype=torch.float64)
    layout = build_layout(tokens.numel(), torch.device("cpu"), padded_shape=(9, 3), group_size=3)
    scores, old = torch.randn(9, generator=gen, dtype=torch.float64), -torch.rand(9, generator=gen).double() * 5
    lw = torch.randn(9, generator=gen, dtype=torch.float64)
    lw[1] = lw[6] = lw[7] = lw[8] = float("-inf")
    group_targets = tpo_kernels.backends.backend_by_key(backend).group_targets
    for kw in (dict(anchor=True), dict(anchor=True, old_seq_logprobs=old), dict(anchor=False)):
        got = group_targets(tokens, layout, scores, seq_log_weights=lw, eta=0.8, score_eps=0.0, **kw)
        want = portable_group_targets(tokens, layout, scores, seq_log_weights=lw, eta=0.8, score_eps=0.0, **kw)
        for name in ("seq_logprobs", "u", "p", "q", "group_loss", "coef"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), **F64, msg=name)
        assert (want.p[6:] == 0).all() and want.group_loss[2] == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("validate", [True, False], ids=["validate", "no-validate"])
def test_weights_cost_no_read_back(backend, validate):
    """Their check joins the call's value checks: the read-backs of the same call without them
    (1 with validate=True, 0 without, padded and grouped by size: DESIGN.md section 3)."""
    b = _batch()
    b["labels"][0, 3:] = 1  # every completion counts, and every weight is finite
    recorders = []
    for log_weights in (None, torch.randn(N, dtype=torch.float64)):
        recorder = ReadBacks()
        with recorder:
            _run("tpo_loss", b, backend, seq_log_weights=log_weights, validate=validate)
        recorders.append(len(recorder.reads))
    assert recorders[1] == recorders[0] == (1 if validate else 0)


def test_the_module_takes_the_weights_per_call():
    b = _batch()
    module = tpo_kernels.TPOLoss(backend="torch")
    got = module(b["logits"], b["labels"], b["scores"], group_size=K, seq_log_weights=b["log_weights"])
    want = reference.tpo_loss(b["logits"], b["labels"], b["scores"], group_size=K, seq_log_weights=b["log_weights"])
    torch.testing.assert_close(got, want, **F64)


@pytest.mark.parametrize("bad,error,words", [
    (float("nan"), ValueError, "seq_log_weights must be finite or -inf"),
    (float("inf"), ValueError, "seq_log_weights must be finite or -inf"),
    ("shape", ValueError, "seq_log_weights must have shape [N]"),
    ("int", TypeError, "seq_log_weights must be a float tensor"),
])
def test_bad_weights_are_refused_by_name(bad, error, words):
    b = _batch()
    lw = b["log_weights"].clone()
    if bad == "shape":
        lw = lw[:-1]
    elif bad == "int":
        lw = torch.zeros(N, dtype=torch.int64)
    else:
        lw[2] = bad
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        tpo_kernels.tpo_loss(b["logits"], b["labels"], b["scores"], group_size=K, seq_log_weights=lw)


def _two_ranks(rank: int, world: int) -> dict:
    """This rank's half of the completions (one group each) with the process group vs the whole."""
    import torch.distributed as dist  # noqa: PLC0415

    b = _batch()
    kw = dict(old_logprobs=b["old_logprobs"], seq_log_weights=b["log_weights"])
    whole_loss, whole_grad, whole_aux = _run("tpo_loss", b, "torch", **kw)
    mine = slice(rank * K, (rank + 1) * K)
    part = dict(b, logits=b["logits"][mine], labels=b["labels"][mine], scores=b["scores"][mine])
    pairs = {}
    for validate in (True, False):  # w = 0: left out by the checks, or masked by the group op
        loss, grad, aux = _run("tpo_loss", part, "torch", old_logprobs=b["old_logprobs"][mine],
                               seq_log_weights=b["log_weights"][mine], process_group=dist.group.WORLD,
                               validate=validate)
        pairs.update({f"loss {validate}": (loss, whole_loss), f"grad {validate}": (grad / world, whole_grad[mine]),
                      f"p {validate}": (aux["p"], whole_aux["p"][mine]),
                      f"q {validate}": (aux["q"], whole_aux["q"][mine])})
    return pairs


def _two_vocab_shards(rank: int, world: int) -> dict:
    """This rank's half of the vocabulary (logits, and a fused head's weight) of every completion,
    with the weights, vs the whole vocabulary."""
    import torch.distributed as dist  # noqa: PLC0415

    b = _batch()
    kw = dict(old_logprobs=b["old_logprobs"], seq_log_weights=b["log_weights"], vocab_parallel_group=dist.group.WORLD)
    start, stop = (0, V // 2) if rank == 0 else (V // 2, V)
    pairs = {}
    whole_loss, whole_grad, _ = _run("tpo_loss", b, "torch", old_logprobs=b["old_logprobs"],
                                     seq_log_weights=b["log_weights"])
    loss, grad, _ = _run("tpo_loss", dict(b, logits=b["logits"][..., start:stop]), "torch", **kw)
    pairs.update(loss=(loss, whole_loss), grad_logits=(grad, whole_grad[..., start:stop]))
    whole_loss, whole_grad, _ = _run("fused_linear_tpo_loss", b, "cpu", old_logprobs=b["old_logprobs"],
                                     seq_log_weights=b["log_weights"])
    loss, grad, _ = _run("fused_linear_tpo_loss", dict(b, weight=b["weight"][start:stop]), "cpu", **kw)
    pairs.update(fused_loss=(loss, whole_loss), fused_grad_hidden=(grad, whole_grad))
    return pairs


def test_two_gloo_ranks_match_one_process():
    """The weights travel as one more float64 column with the gathered completion rows."""
    for rank, pairs in enumerate(run_ranks(2, _two_ranks, deadline_s=120)):
        for name, (got, want) in pairs.items():
            torch.testing.assert_close(got, want, **F64, msg=f"rank {rank}, {name}")


def test_two_vocabulary_shards_match_one_process():
    """Per completion, the weights are the same on every shard of ``vocab_parallel_group``."""
    for rank, pairs in enumerate(run_ranks(2, _two_vocab_shards, deadline_s=120)):
        for name, (got, want) in pairs.items():
            torch.testing.assert_close(got, want, **F64, msg=f"rank {rank}, {name}")
