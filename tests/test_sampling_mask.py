"""``sampling_mask=`` (kept-set replay) on the four public functions, against the float64 reference
(``tpo_kernels.reference``: vLLM's recipe, the logits masked to each token's kept set, then
log_softmax at the label; the entropy of the renormalized distribution).

A mask comes as a :class:`tpo_kernels.SamplingMask`, a ``(token_ids, offsets)`` CSR over every
token of the call, or a padded ``[*labels.shape, S]`` id tensor (negative: none); the forms give the
same result. A token with an empty set does not count; a counted label outside its set is a
ValueError under ``validate=True`` and NaN without it; the gradient lives on the kept ids only.
"""

import pytest
import torch

import tpo_kernels as tk
from tpo_kernels import reference

from _backends import backend_params

BACKENDS = backend_params("torch", "cpu")
KERNEL_BACKENDS = BACKENDS + backend_params("triton")  # the Triton interpreter: tiny calls only
V = 23


def _sets(labels, *, seed=0, max_extra=5, empty_every=7):
    """Per-token kept sets (flat row-major) holding each label plus a few other ids; every
    ``empty_every``-th token has an empty set (it does not count)."""
    gen = torch.Generator().manual_seed(seed)
    sets = []
    for i, label in enumerate(labels.reshape(-1).tolist()):
        if empty_every and i % empty_every == empty_every - 1:
            sets.append([])
            continue
        extra = torch.randperm(V, generator=gen)[: int(torch.randint(0, max_extra + 1, (1,), generator=gen))]
        sets.append(sorted({label, *extra.tolist()}))
    return sets


def _padded(sets, shape, width=8):
    ids = torch.full((len(sets), width), -1, dtype=torch.int64)
    for i, s in enumerate(sets):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.int64)  # holes first: any order counts
    return ids.view(*shape, width)


def _forms(sets, shape):
    mask = tk.SamplingMask.from_lists(sets)
    return {"SamplingMask": mask, "tuple": (mask.token_ids, mask.offsets), "padded": _padded(sets, shape)}


def _batch(n=4, t=6, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, t, V, generator=gen) * 2).to(dtype)
    labels = torch.randint(0, V, (n, t), generator=gen)
    scores = torch.randn(n, generator=gen)
    return logits, labels, scores


def _head(n=4, t=6, hidden_size=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, t, hidden_size, generator=gen).to(dtype)
    weight = torch.randn(V, hidden_size, generator=gen).to(dtype)
    bias = torch.randn(V, generator=gen).to(dtype)
    labels = torch.randint(0, V, (n, t), generator=gen)
    scores = torch.randn(n, generator=gen)
    return hidden, weight, bias, labels, scores


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- forms


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_three_forms_give_the_same_log_probs(backend):
    logits, labels, _ = _batch()
    forms = _forms(_sets(labels), labels.shape)
    results = {name: tk.selective_logprobs(logits, labels, sampling_mask=m, backend=backend)
               for name, m in forms.items()}
    torch.testing.assert_close(results["tuple"], results["SamplingMask"], rtol=0, atol=0)
    torch.testing.assert_close(results["padded"], results["SamplingMask"], rtol=0, atol=0)


def test_from_lists_builds_the_csr():
    mask = tk.SamplingMask.from_lists([[3, 1], [], [5]])
    assert mask.token_ids.tolist() == [3, 1, 5] and mask.offsets.tolist() == [0, 2, 2, 3]


# ----------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_logprobs_matches_the_reference(backend, dtype):
    logits, labels, _ = _batch(dtype=dtype)
    sets = _sets(labels)
    mask = tk.SamplingMask.from_lists(sets)
    transform = dict(temperature=0.7, logit_softcap=5.0)
    lp, ent = tk.selective_logprobs(logits, labels, sampling_mask=mask, return_entropy=True, backend=backend,
                                    **transform)
    ref_lp, ref_ent = reference.selective_logprobs(logits.double(), labels, sampling_mask=mask, return_entropy=True,
                                                   **transform)
    torch.testing.assert_close(lp.double(), ref_lp, **_tol(dtype))
    torch.testing.assert_close(ent.double(), ref_ent, **_tol(dtype))
    empty = torch.tensor([len(s) == 0 for s in sets]).view(labels.shape)
    assert (lp[empty] == 0).all() and (ent[empty] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_logprobs_of_a_shifted_view(backend):
    logits, labels, _ = _batch(t=7)
    view, labels = logits[:, :-1], labels[:, 1:]
    mask = tk.SamplingMask.from_lists(_sets(labels))
    lp = tk.selective_logprobs(view, labels, sampling_mask=mask, backend=backend)
    torch.testing.assert_close(lp.double(), reference.selective_logprobs(view.double(), labels, sampling_mask=mask),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_fused_linear_logprobs_matches_the_reference_on_the_logits(backend):
    hidden, weight, bias, labels, _ = _head()
    mask = tk.SamplingMask.from_lists(_sets(labels))
    lp, ent = tk.fused_linear_logprobs(hidden, weight, labels, bias=bias, sampling_mask=mask, return_entropy=True,
                                       temperature=0.8, backend=backend)
    logits = hidden.double() @ weight.double().T + bias.double()
    ref_lp, ref_ent = reference.selective_logprobs(logits, labels, sampling_mask=mask, return_entropy=True,
                                                   temperature=0.8)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)


LOSS_SETTINGS = [
    dict(),
    dict(entropy_coef=0.1, temperature=0.7, logit_softcap=4.0),
    dict(old_logprobs="per token", beta=0.05, length_normalize=True),
]


def _loss_inputs(settings, labels, logits_for_old):
    settings = dict(settings)
    if settings.get("old_logprobs") == "per token":
        gen = torch.Generator().manual_seed(3)
        settings["old_logprobs"] = -torch.rand(labels.shape, generator=gen, dtype=torch.float64).float()
        settings["ref_logprobs"] = -torch.rand(labels.shape, generator=gen, dtype=torch.float64).float()
    return settings


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("settings", LOSS_SETTINGS)
def test_tpo_loss_matches_the_reference_with_its_gradient(backend, settings):
    logits, labels, scores = _batch()
    mask = tk.SamplingMask.from_lists(_sets(labels))
    kwargs = _loss_inputs(settings, labels, logits)
    x = logits.clone().requires_grad_(True)
    loss = tk.tpo_loss(x, labels, scores, group_size=2, sampling_mask=mask, backend=backend, **kwargs)
    loss.backward()
    xr = logits.double().requires_grad_(True)
    ref = reference.tpo_loss(xr, labels, scores.double(), group_size=2, sampling_mask=mask, **kwargs)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tpo_loss_of_packed_inputs_with_group_ids(backend):
    logits, labels, scores = _batch(n=1, t=20)
    logits, labels = logits[0], labels[0]
    cu_seqlens = torch.tensor([0, 3, 9, 14, 20])
    scores, group_ids = torch.randn(4, generator=torch.Generator().manual_seed(5)), torch.tensor([7, 2, 7, 2])
    mask = tk.SamplingMask.from_lists(_sets(labels))
    batch = dict(cu_seqlens=cu_seqlens, group_ids=group_ids, sampling_mask=mask)
    loss = tk.tpo_loss(logits, labels, scores, backend=backend, **batch)
    ref = reference.tpo_loss(logits.double(), labels, scores.double(), **batch)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("settings", LOSS_SETTINGS[:2])
def test_fused_linear_tpo_loss_matches_the_reference_on_the_logits(backend, settings):
    hidden, weight, bias, labels, scores = _head()
    mask = _padded(_sets(labels), labels.shape)
    params = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    loss = tk.fused_linear_tpo_loss(params[0], params[1], labels, scores, bias=params[2], group_size=2,
                                    sampling_mask=mask, backend=backend, **settings)
    loss.backward()
    ref_params = [t.double().requires_grad_(True) for t in (hidden, weight, bias)]
    logits = ref_params[0] @ ref_params[1].T + ref_params[2]
    ref = reference.tpo_loss(logits, labels, scores.double(), group_size=2, sampling_mask=mask, **settings)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.grad.double(), r.grad, rtol=1e-4, atol=1e-5)


def test_the_modules_take_the_mask_per_call():
    logits, labels, scores = _batch()
    mask = tk.SamplingMask.from_lists(_sets(labels))
    module = tk.TPOLoss(backend="torch")
    expected = tk.tpo_loss(logits, labels, scores, group_size=2, sampling_mask=mask, backend="torch")
    assert torch.equal(module(logits, labels, scores, group_size=2, sampling_mask=mask), expected)


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_gradient_is_zero_off_the_kept_ids(backend):
    logits, labels, scores = _batch()
    sets = _sets(labels)
    x = logits.clone().requires_grad_(True)
    tk.tpo_loss(x, labels, scores, group_size=2, sampling_mask=tk.SamplingMask.from_lists(sets), backend=backend,
                entropy_coef=0.1).backward()
    keep = reference.kept_mask(tk.SamplingMask.from_lists(sets), labels.shape, V)
    assert (x.grad[~keep] == 0).all()
    assert (x.grad[keep] != 0).any()


# The loss's q is a target (no gradient flows through it): gradcheck the per-token log-probs and
# entropies, which carry every gradient the loss has.


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_on_the_logits(backend):
    logits, labels, _ = _batch(n=2, t=3)
    mask = tk.SamplingMask.from_lists(_sets(labels, empty_every=4))
    x = logits.double().requires_grad_(True)
    fn = lambda z: tk.selective_logprobs(z, labels, sampling_mask=mask, return_entropy=True,  # noqa: E731
                                         backend=backend, temperature=0.8, logit_softcap=3.0)
    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_on_hidden_weight_and_bias(backend):
    hidden, weight, bias, labels, _ = _head(n=2, t=3, hidden_size=4)
    mask = _padded(_sets(labels, empty_every=4), labels.shape, width=6)
    params = tuple(t.double().requires_grad_(True) for t in (hidden, weight, bias))
    fn = lambda h, w, b: tk.fused_linear_logprobs(h, w, labels, bias=b, sampling_mask=mask,  # noqa: E731
                                                  return_entropy=True, backend=backend, logit_softcap=3.0)
    assert torch.autograd.gradcheck(fn, params)


# ----------------------------------------------------------------------------- memory


def test_the_fused_head_with_a_mask_forms_no_vocabulary_sized_tensor():
    """Forward and backward of the fused loss with a mask: no tensor an op returns comes near
    ``[M, V]`` (the weight gradient ``[V, H]`` is the largest)."""
    from _dispatch import OutputSizes

    n, t, hidden_size, vocab = 8, 64, 16, 8192
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, t, hidden_size, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.1).requires_grad_(True)
    labels = torch.randint(0, vocab, (n, t), generator=gen)
    sets = [[int(label), *torch.randperm(vocab, generator=gen)[: i % 9].tolist()] for i, label
            in enumerate(labels.reshape(-1))]
    sets = [sorted(set(s)) for s in sets]
    recorder = OutputSizes()
    with recorder:
        loss = tk.fused_linear_tpo_loss(hidden, weight, labels, torch.randn(n, generator=gen), group_size=2,
                                        sampling_mask=tk.SamplingMask.from_lists(sets), backend="torch")
        loss.backward()
    largest = max(size for _, size in recorder.outputs)
    assert largest < n * t * vocab * 4 / 8, largest


# ----------------------------------------------------------------------------- errors


def test_a_label_outside_its_set_is_a_value_error_naming_it():
    logits, labels, scores = _batch()
    sets = _sets(labels)
    sets[2] = [i for i in range(V) if i != int(labels.reshape(-1)[2])][:3]
    with pytest.raises(ValueError, match=r"sampling_mask: the label of token 2 .* not in its kept set"):
        tk.selective_logprobs(logits, labels, sampling_mask=tk.SamplingMask.from_lists(sets))
    with pytest.raises(ValueError, match=r"sampling_mask: the label of token 2"):
        tk.tpo_loss(logits, labels, scores, group_size=2, sampling_mask=tk.SamplingMask.from_lists(sets))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_label_outside_its_set_is_nan_without_validation(backend):
    logits, labels, _ = _batch()
    sets = _sets(labels)
    sets[2] = [i for i in range(V) if i != int(labels.reshape(-1)[2])][:3]
    lp = tk.selective_logprobs(logits, labels, sampling_mask=tk.SamplingMask.from_lists(sets), validate=False,
                               backend=backend)
    assert torch.isnan(lp.reshape(-1)[2])
    assert torch.isfinite(lp.reshape(-1)[[0, 1, 3]]).all()


def test_an_ignored_label_needs_no_set_entry():
    logits, labels, _ = _batch()
    sets = _sets(labels)
    labels = labels.clone()
    labels.view(-1)[0] = -100
    sets[0] = [(s + 1) % V for s in sets[0]]  # whatever the set, the token does not count
    lp = tk.selective_logprobs(logits, labels, sampling_mask=tk.SamplingMask.from_lists(sets))
    assert lp.reshape(-1)[0] == 0


@pytest.mark.parametrize("mask, error, message", [
    (lambda m: (m.token_ids, m.offsets[:-1]), ValueError, r"sampling_mask.offsets must have M \+ 1"),
    (lambda m: (m.token_ids.float(), m.offsets), TypeError, "sampling_mask.token_ids"),
    (lambda m: (m.token_ids,), ValueError, r"\(token_ids, offsets\)"),
    (lambda m: [m.token_ids, m.offsets], TypeError, "sampling_mask must be"),
    (lambda m: torch.zeros(4, 5, 3, dtype=torch.int64), ValueError, r"\[\*labels.shape, S\]"),
    (lambda m: (m.token_ids + V, m.offsets), ValueError, r"token ids in \[0, 23\)"),
    (lambda m: (m.token_ids, m.offsets.flip(0)), ValueError, "must run from 0 to len"),
    (lambda m: (torch.cat([m.token_ids[:1], m.token_ids[:1], m.token_ids[1:]]),
                torch.cat([m.offsets[:1], m.offsets[1:] + 1])), ValueError, "id twice"),
])
def test_a_malformed_mask_is_refused_naming_it(mask, error, message):
    logits, labels, _ = _batch()
    sets = _sets(labels, empty_every=0)
    sets[0] = sorted({int(labels.reshape(-1)[0])})
    with pytest.raises(error, match=message):
        tk.selective_logprobs(logits, labels, sampling_mask=mask(tk.SamplingMask.from_lists(sets)))


def test_a_logits_cache_with_a_mask_is_refused():
    hidden, weight, _, labels, scores = _head()
    with pytest.raises(ValueError, match="logits_cache_bytes"):
        tk.fused_linear_tpo_loss(hidden, weight, labels, scores, group_size=2, logits_cache_bytes=1 << 20,
                                 sampling_mask=tk.SamplingMask.from_lists(_sets(labels)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fullgraph_compile_with_a_padded_mask_matches_eager(backend):
    """The padded form is built without a read-back: with validate=False the calls trace into one
    graph (``fullgraph=True``) and give eager's loss and gradients."""
    hidden, weight, _, labels, scores = _head()
    mask = _padded(_sets(labels), labels.shape)

    def step(h, w):
        common = dict(group_size=2, sampling_mask=mask, backend=backend, validate=False)
        return tk.fused_linear_tpo_loss(h, w, labels, scores, **common) + tk.tpo_loss(h @ w.T, labels, scores, **common)

    params = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    eager = step(*params)
    eager_grads = torch.autograd.grad(eager, params)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*params)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad(compiled, params), eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
