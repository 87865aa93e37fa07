"""Token-level TPO: token_tpo_loss and fused_linear_token_tpo_loss against
reference.token_tpo_loss (full-vocab log_softmax, gather, Eq. 1-3 with autograd), gradcheck,
exact zeros for tied states, determinism, and no [R, V] tensor on the fused-linear path, on every
backend (the candidate ops are the backends' kept-set ops on K pairs per state). The kernels op by
op: test_candidate_kernels.py, test_kept_kernels.py. Bad inputs: see test_validation.py.

Tolerances: float64 inputs are compared at 1e-10 (everything is computed in float64); float32
at 1e-5; bf16 inputs are compared with a float64 reference run on the same (bf16-rounded)
values, at 1e-5 for the loss (fp32 math) and 2e-2 for gradients rounded to bf16 on output.
"""

import pytest
import torch

import tpo_kernels.backends.torch_kept as kept_ops
from tpo_kernels import fused_linear_token_tpo_loss, reference, token_tpo_loss
from tpo_kernels.backends import Backend
from tpo_kernels.backends.kept_sets import KeptSets
from tpo_kernels.group_math import pair_runs

from _backends import DEVICE, backend_params, needs_triton
from _dispatch import OutputSizes

# Backends whose own kept-set gather / scatter run the logits path on CPU tensors; the Triton
# kernels come in as "triton-kernels" (see the logits_backend fixture).
LOGITS_BACKENDS = backend_params("torch", "cpu")
# Backends with kept-set dot products of their own (the fused-linear path).
LINEAR_BACKENDS = backend_params("torch", "triton", "cuda")

TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 2e-2)}

CASES = {
    "default": {},
    "no_anchor": {"anchor": False},
    "eta_temperature": {"eta": 0.5, "temperature": 0.7},
    "old_logprobs": {"old_logprobs": "given"},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none", "temperature": 1.3},
}


def _candidates(num_states, num_cand, vocab, gen):
    cands = torch.randint(0, vocab, (num_states, num_cand), generator=gen)
    cands[0, 1] = cands[0, 0]  # a duplicate within a state
    cands[1, :] = cands[1, 0]  # a state whose candidates are all one token
    cands[num_states - 1, 0] = cands[2, 0]  # a token shared across states
    return cands


def _kwargs(case, num_states, num_cand, dtype, gen):
    kwargs = dict(CASES[case])
    if kwargs.get("old_logprobs") == "given":
        # Full-vocab log-probs of another policy would do; any per-state shift is irrelevant.
        kwargs["old_logprobs"] = torch.randn(num_states, num_cand, generator=gen, dtype=dtype) - 3.0
    return kwargs


def _backward_weights(loss, gen):
    """A random cotangent for reduction="none" (so each state's gradient is checked), else 1."""
    if loss.dim() == 0:
        return torch.ones_like(loss)
    return torch.rand(loss.shape, generator=gen, dtype=loss.dtype) + 0.5


def _triton_candidate_backend():
    """A backend whose gather / scatter are the Triton launchers: the wiring TritonBackend gets."""
    from tpo_kernels.backends.triton import kept_kernels

    class TritonCandidates(Backend):
        name = "triton-candidates"
        kept_gather = staticmethod(kept_kernels.kept_gather)
        kept_scatter = staticmethod(kept_kernels.kept_scatter)

        def supports_device(self, device):
            return True

    return TritonCandidates()


@pytest.fixture(params=LOGITS_BACKENDS + [pytest.param("triton-kernels", marks=needs_triton, id="triton-kernels")])
def logits_backend(request):
    """Backend for token_tpo_loss; "triton-kernels" is a Backend instance whose gather / scatter
    are the Triton launchers."""
    if request.param == "triton-kernels":
        return _triton_candidate_backend()
    return request.param


# ----------------------------------------------------------------------------- logits path


# Every case in float64; dtype coverage on two of them.
CASE_DTYPES = [(case, torch.float64) for case in sorted(CASES)] + [
    (case, dtype) for dtype in (torch.float32, torch.bfloat16) for case in ("default", "none")
]


@pytest.mark.parametrize("case, dtype", CASE_DTYPES)
def test_logits_path_matches_reference(logits_backend, case, dtype):
    gen = torch.Generator().manual_seed(1)
    num_states, num_cand, vocab = 6, 4, 37
    logits = (torch.randn(num_states, vocab, generator=gen, dtype=torch.float64) * 2).to(dtype).to(DEVICE)
    cands = _candidates(num_states, num_cand, vocab, gen).to(DEVICE)
    scores = torch.randn(num_states, num_cand, generator=gen, dtype=torch.float64).to(DEVICE)
    kwargs = _kwargs(case, num_states, num_cand, torch.float64, gen)
    kwargs = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in kwargs.items()}

    x = logits.clone().requires_grad_()
    loss = token_tpo_loss(x, cands, scores, backend=logits_backend, **kwargs)
    cot = _backward_weights(loss, gen).to(DEVICE)
    (grad,) = torch.autograd.grad(loss, x, cot.to(loss.dtype))

    x_ref = logits.detach().to(torch.float64).requires_grad_()
    loss_ref = reference.token_tpo_loss(x_ref, cands, scores, **kwargs)
    (grad_ref,) = torch.autograd.grad(loss_ref, x_ref, cot.to(torch.float64))

    loss_tol, grad_tol = TOL[dtype]
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(loss.double(), loss_ref, rtol=loss_tol, atol=loss_tol)
    assert grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(grad.double(), grad_ref, rtol=grad_tol, atol=grad_tol)
    # Only the candidate entries of each row carry gradient.
    off = torch.ones_like(grad, dtype=torch.bool).scatter_(1, cands, False)
    assert bool((grad[off] == 0).all())


def test_duplicate_candidates_are_separate_members(logits_backend):
    """A repeated id is two members with equal logits: p splits between them, and the logit's
    gradient is the sum of both members' coefficients."""
    logits = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64, device=DEVICE, requires_grad=True)
    cands = torch.tensor([[2, 2, 0]], device=DEVICE)
    scores = torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64, device=DEVICE)
    loss, aux = token_tpo_loss(logits, cands, scores, backend=logits_backend, return_aux=True)
    (grad,) = torch.autograd.grad(loss, logits)
    e2, e0 = torch.exp(torch.tensor(2.0, dtype=torch.float64)), torch.tensor(1.0, dtype=torch.float64)
    expected_p = torch.stack([e2, e2, e0]) / (2 * e2 + e0)
    torch.testing.assert_close(aux["p"][0], expected_p.to(DEVICE), rtol=1e-12, atol=1e-12)
    coef = aux["coef"][0]
    torch.testing.assert_close(grad[0], torch.stack([coef[2], torch.zeros_like(coef[0]), coef[0] + coef[1]]))
    torch.testing.assert_close(loss, reference.token_tpo_loss(logits, cands, scores), rtol=1e-12, atol=1e-12)


def test_old_logprobs_only_differences_within_a_state_matter(logits_backend):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 11, generator=gen, dtype=torch.float64)
    cands = torch.randint(0, 11, (4, 3), generator=gen)
    scores = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    old = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    shifted = old + torch.randn(4, 1, generator=gen, dtype=torch.float64) * 10
    a = token_tpo_loss(logits, cands, scores, old_logprobs=old, backend=logits_backend)
    b = token_tpo_loss(logits, cands, scores, old_logprobs=shifted, backend=logits_backend)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_return_aux(logits_backend):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 13, generator=gen)
    cands = torch.randint(0, 13, (5, 4), generator=gen)
    scores = torch.randn(5, 4, generator=gen)
    loss, aux = token_tpo_loss(
        logits, cands, scores, temperature=0.5, backend=logits_backend, return_aux=True
    )
    assert set(aux) == {"candidate_logits", "p", "q", "u", "coef", "state_loss"}
    torch.testing.assert_close(aux["candidate_logits"], logits.gather(1, cands) / 0.5)
    torch.testing.assert_close(aux["p"].sum(1), torch.ones(5))
    torch.testing.assert_close(aux["coef"], (aux["p"] - aux["q"]) / 5)
    torch.testing.assert_close(loss, aux["state_loss"].mean())
    assert not any(v.requires_grad for v in aux.values())


def test_logits_gradcheck(logits_backend):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    cands = torch.tensor([[0, 3, 3], [6, 1, 2], [5, 5, 5]])
    scores = torch.randn(3, 3, generator=gen, dtype=torch.float64)
    old = torch.randn(3, 3, generator=gen, dtype=torch.float64)
    # On-policy q is built from the logits themselves (held constant), so gradcheck needs q fixed:
    # given old log-probs, or anchor=False.
    cases = ({"old_logprobs": old, "temperature": 0.6, "eta": 0.7}, {"anchor": False, "reduction": "none"})
    for kwargs in cases:
        assert torch.autograd.gradcheck(
            lambda x: token_tpo_loss(x, cands, scores, backend=logits_backend, **kwargs),
            (logits,),
            fast_mode=logits_backend != "torch",  # the full Jacobian once is enough
        )


def test_tied_states_have_exactly_zero_gradient(logits_backend):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 19, generator=gen, requires_grad=True)
    cands = torch.randint(0, 19, (4, 5), generator=gen)
    scores = torch.randn(4, 5, generator=gen)
    scores[1] = 0.3  # tied states: u = 0, q == p bit for bit on-policy
    scores[3] = -2.0
    for temperature in (1.0, 0.7):
        loss = token_tpo_loss(logits, cands, scores, temperature=temperature, backend=logits_backend)
        (grad,) = torch.autograd.grad(loss, logits)
        assert bool((grad[1] == 0).all()) and bool((grad[3] == 0).all())
        assert bool((grad[0] != 0).any()) and bool((grad[2] != 0).any())


def test_logits_path_is_deterministic(logits_backend):
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(8, 10, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    cands = torch.randint(0, 4, (8, 6), generator=gen)  # many duplicates
    scores = torch.randn(8, 6, generator=gen)
    runs = []
    for _ in range(2):
        loss = token_tpo_loss(logits, cands, scores, backend=logits_backend)
        runs.append((loss, *torch.autograd.grad(loss, logits)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_logits_path_backward_allocates_only_the_gradient(logits_backend):
    """bf16 logits: the backward's largest tensor is the bf16 [R, V] gradient it returns, not an
    fp32 [R, V] accumulator (R spans several of the PyTorch scatter's chunks of states)."""
    num_states, num_cand, vocab = 600, 4, 8192
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(num_states, vocab, generator=gen) * 2).to(torch.bfloat16).to(DEVICE).requires_grad_()
    cands = _candidates(num_states, num_cand, vocab, gen).to(DEVICE)
    scores = torch.randn(num_states, num_cand, generator=gen).to(DEVICE)
    loss = token_tpo_loss(logits, cands, scores, backend=logits_backend)
    with OutputSizes() as recorder:
        loss.backward()
    assert max(nbytes for _, nbytes in recorder.outputs) == num_states * vocab * 2


def test_torch_scatter_rounds_each_sum_once_over_chunks_of_states():
    """The PyTorch scatter into bf16 sums each id's gradients in fp32 in ascending k, then rounds
    once, chunk of states by chunk: equal to a dense fp32 accumulation cast at the end."""
    num_states, num_cand, vocab = 700, 6, 8192  # 256 states per chunk: three chunks
    gen = torch.Generator().manual_seed(8)
    cands = torch.randint(0, 16, (num_states, num_cand), generator=gen)  # many duplicates
    grad = torch.randn(num_states, num_cand, generator=gen)
    dense = torch.zeros(num_states, vocab)
    for k in range(num_cand):
        dense.scatter_add_(1, cands[:, k : k + 1], grad[:, k : k + 1] * (1 / 0.7))
    out = torch.full((num_states, vocab), float("nan"), dtype=torch.bfloat16)
    kept_ops.kept_scatter((grad * (1 / 0.7)).reshape(-1), KeptSets.from_candidates(cands), out=out)
    assert torch.equal(out, dense.to(torch.bfloat16))


# ----------------------------------------------------------------------------- fused-linear path


def _linear_inputs(dtype, with_bias, gen, num_states=6, num_cand=4, hidden_size=8, vocab=29):
    hidden = torch.randn(num_states, hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64) * 0.7).to(dtype)
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype) if with_bias else None
    cands = _candidates(num_states, num_cand, vocab, gen)
    scores = torch.randn(num_states, num_cand, generator=gen, dtype=torch.float64)
    return hidden, weight, bias, cands, scores


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
@pytest.mark.parametrize("case, dtype", CASE_DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_linear_matches_reference(backend, case, dtype, with_bias):
    gen = torch.Generator().manual_seed(7)
    hidden, weight, bias, cands, scores = _linear_inputs(dtype, with_bias, gen)
    kwargs = _kwargs(case, *cands.shape, torch.float64, gen)
    params = [t.to(DEVICE).requires_grad_() for t in (hidden, weight, bias) if t is not None]
    loss = fused_linear_token_tpo_loss(
        params[0], params[1], cands.to(DEVICE), scores.to(DEVICE),
        bias=params[2] if with_bias else None, backend=backend,
        **{k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in kwargs.items()},
    )
    cot = _backward_weights(loss, gen)
    grads = torch.autograd.grad(loss, params, cot.to(DEVICE, loss.dtype))

    ref_params = [t.detach().cpu().to(torch.float64).requires_grad_() for t in params]
    logits = ref_params[0] @ ref_params[1].T + (ref_params[2] if with_bias else 0.0)
    loss_ref = reference.token_tpo_loss(logits, cands, scores, **kwargs)
    grads_ref = torch.autograd.grad(loss_ref, ref_params, cot.to(torch.float64))

    loss_tol, grad_tol = TOL[dtype]
    torch.testing.assert_close(loss.double().cpu(), loss_ref, rtol=loss_tol, atol=loss_tol)
    for grad, grad_ref, param in zip(grads, grads_ref, params):
        assert grad.dtype == param.dtype and grad.shape == param.shape
        torch.testing.assert_close(grad.double().cpu(), grad_ref, rtol=grad_tol, atol=grad_tol)
    untouched = torch.ones(weight.shape[0], dtype=torch.bool).scatter_(0, cands.reshape(-1), False)
    assert bool((grads[1].cpu()[untouched] == 0).all())


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_fused_linear_gradcheck(backend):
    gen = torch.Generator().manual_seed(8)
    hidden, weight, bias, cands, scores = _linear_inputs(torch.float64, True, gen, 3, 3, 4, 7)
    cands[2] = torch.tensor([6, 6, 1])
    old = torch.randn(3, 3, generator=gen, dtype=torch.float64)
    inputs = tuple(t.to(DEVICE).requires_grad_() for t in (hidden, weight, bias))
    assert torch.autograd.gradcheck(
        lambda h, w, b: fused_linear_token_tpo_loss(
            h, w, cands.to(DEVICE), scores.to(DEVICE), bias=b, old_logprobs=old.to(DEVICE),
            temperature=0.8, eta=0.6, backend=backend,
        ),
        inputs,
        fast_mode=backend != "torch",  # the full Jacobian once is enough
    )


def _tied_linear_inputs():
    """Linear inputs (hidden, weight, bias as leaves on DEVICE), candidates and scores in which
    state 4 ties; vocab 5, so candidates repeat across states."""
    gen = torch.Generator().manual_seed(9)
    hidden, weight, bias, cands, scores = _linear_inputs(torch.float32, True, gen, num_states=8, vocab=5)
    scores[4] = 1.5  # tied: no gradient from state 4
    params = [t.to(DEVICE).requires_grad_() for t in (hidden, weight, bias)]
    return params, cands, scores


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_fused_linear_is_deterministic(backend):
    params, cands, scores = _tied_linear_inputs()
    runs = []
    for _ in range(2):
        loss = fused_linear_token_tpo_loss(
            params[0], params[1], cands.to(DEVICE), scores.to(DEVICE), bias=params[2], backend=backend
        )
        runs.append((loss, *torch.autograd.grad(loss, params)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_fused_linear_tied_states_have_exactly_zero_gradient(backend):
    params, cands, scores = _tied_linear_inputs()
    loss = fused_linear_token_tpo_loss(
        params[0], params[1], cands.to(DEVICE), scores.to(DEVICE), bias=params[2], backend=backend
    )
    (dhidden, *_) = torch.autograd.grad(loss, params)
    assert bool((dhidden[4] == 0).all())  # dH of the tied state

    # A batch whose states all tie: every gradient is exactly zero.
    tied = torch.zeros_like(scores)
    loss = fused_linear_token_tpo_loss(
        params[0], params[1], cands.to(DEVICE), tied.to(DEVICE), bias=params[2], backend=backend
    )
    assert all(bool((g == 0).all()) for g in torch.autograd.grad(loss, params))


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_fused_linear_never_allocates_states_by_vocab(backend):
    # H << R, so the dense [V, H] weight gradient (the one vocab-sized output) is far below R*V.
    # Sizes are compared in bytes: the Triton interpreter views fp32 arguments as raw bytes.
    num_states, num_cand, hidden_size, vocab = 64, 4, 8, 1000
    gen = torch.Generator().manual_seed(10)
    hidden, weight, bias, cands, scores = _linear_inputs(
        torch.float32, True, gen, num_states, num_cand, hidden_size, vocab
    )
    params = [t.to(DEVICE).requires_grad_() for t in (hidden, weight, bias)]
    with OutputSizes() as recorder:
        loss = fused_linear_token_tpo_loss(
            params[0], params[1], cands.to(DEVICE), scores.to(DEVICE), bias=params[2], backend=backend
        )
        loss.backward()
    largest = max(nbytes for _, nbytes in recorder.outputs)
    assert largest < num_states * vocab * 4
    assert largest == vocab * hidden_size * 4  # the dense fp32 weight gradient, nothing bigger
    others = [shape for shape, _ in recorder.outputs if shape != (vocab, hidden_size)]
    assert all(len(shape) < 2 or vocab not in shape for shape in others)


def test_torch_weight_gradient_sums_pairs_in_order():
    """dW rows of the PyTorch ops equal an explicit sequential sum over (r, k) pairs."""
    gen = torch.Generator().manual_seed(11)
    hidden, weight, _, cands, _ = _linear_inputs(torch.float64, False, gen, num_states=7, vocab=6)
    grad = torch.randn(cands.shape, generator=gen, dtype=torch.float64)
    runs = pair_runs(cands)
    dhidden, dweight, dbias = kept_ops.kept_linear_backward(
        grad.reshape(-1), hidden, weight, KeptSets.from_candidates(cands), runs=runs, with_hidden=True,
        with_weight=True, with_bias=True,
    )
    expected_w = torch.zeros_like(weight)
    expected_b = torch.zeros(weight.shape[0], dtype=torch.float64)
    for r in range(cands.shape[0]):
        for k in range(cands.shape[1]):
            expected_w[cands[r, k]] += grad[r, k] * hidden[r]
            expected_b[cands[r, k]] += grad[r, k]
    torch.testing.assert_close(dweight, expected_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dbias, expected_b, rtol=1e-12, atol=1e-12)
    expected_h = torch.einsum("rk,rkh->rh", grad, weight[cands])
    torch.testing.assert_close(dhidden, expected_h, rtol=1e-12, atol=1e-12)
