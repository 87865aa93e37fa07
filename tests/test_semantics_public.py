"""``score_eps`` and ``length_normalize`` through every public loss, its module form and every
backend, against ``reference.tpo_loss`` / ``reference.token_tpo_loss``.

Batches hold one near-tied group (score std 1e-7: centered under the default ``score_eps``), an
exact tie and ordinary groups. Tolerances: float64 inputs 1e-10 (loss, p, q, u relative to its
scale, gradients); float32 2e-5 (fp32 row ops; the reference runs in float64).
"""

import pytest
import torch

import tpo_kernels
from tpo_kernels import reference

from _backends import DEVICE, DEVICE_BACKENDS, INTERPRETED_BACKENDS

BACKENDS = DEVICE_BACKENDS + INTERPRETED_BACKENDS
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
N, T, V, H, K = 8, 5, 13, 6, 4
SETTINGS = {
    "default": {},
    "exact_standardization": dict(score_eps=0.0),
    "wide_tolerance": dict(score_eps=2.0),
    "length_normalized": dict(length_normalize=True),
    "length_normalized_old_tokens": dict(length_normalize=True, old="token"),
    "length_normalized_old_seqs": dict(length_normalize=True, old="seq", score_eps=0.0),
}


def _scores() -> torch.Tensor:
    """Groups: ordinary, near-tied (std 1e-7), ordinary, exact tie."""
    near = 2.0 + 1e-7 * torch.tensor([-1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    return torch.cat([torch.tensor([0.3, -1.2, 0.8, 2.0], dtype=torch.float64), near,
                      torch.tensor([1.0, 0.0, 0.0, 0.5], dtype=torch.float64), torch.full((4,), 0.7)]).to(DEVICE)


def _batch(dtype, old):
    gen = torch.Generator().manual_seed(11)
    n = 2 * N
    labels = torch.randint(0, V, (n, T), generator=gen)
    labels[torch.arange(n), torch.randint(1, T, (n,), generator=gen)] = -100  # holes inside completions
    labels[:, -1] = -100
    hidden = torch.randn(n, T, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
    kwargs = dict(group_size=K)
    if old == "token":
        kwargs["old_logprobs"] = (-torch.rand(n, T, generator=gen, dtype=torch.float64) * 3).to(DEVICE, dtype)
    elif old == "seq":
        kwargs["old_logprobs"] = (-torch.rand(n, generator=gen, dtype=torch.float64) * 3).to(DEVICE, dtype)
    return hidden.to(DEVICE, dtype), weight.to(DEVICE, dtype), labels.to(DEVICE), kwargs


def _sequence_loss(function, backend, hidden, weight, labels, scores, options, batch):
    """(loss, aux, gradient on the hidden states) of one public sequence-level loss; ``options``
    are the settings, ``batch`` the grouping and old log-probs."""
    hidden = hidden.detach().requires_grad_(True)
    if function == "TPOLoss":  # the module holds the settings; the batch goes to forward
        loss, aux = tpo_kernels.TPOLoss(**options, backend=backend)(hidden @ weight.T, labels, scores,
                                                                    return_aux=True, **batch)
        (grad,) = torch.autograd.grad(loss, hidden)
        return loss, aux, grad
    options = dict(options, **batch)
    if function == "fused_linear_tpo_loss":
        loss, aux = tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores, backend=backend,
                                                      return_aux=True, **options)
    elif function == "tpo_loss":
        loss, aux = tpo_kernels.tpo_loss(hidden @ weight.T, labels, scores, backend=backend, return_aux=True,
                                         **options)
    else:
        logprobs = reference.token_logprobs(hidden @ weight.T, labels)
        loss, aux = tpo_kernels.tpo_loss_from_logprobs(logprobs, scores, mask=labels != -100, backend=backend,
                                                       return_aux=True, **options)
    (grad,) = torch.autograd.grad(loss, hidden)
    return loss, aux, grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("function", ["tpo_loss", "fused_linear_tpo_loss", "tpo_loss_from_logprobs", "TPOLoss"])
def test_sequence_losses_match_reference(function, setting, dtype, backend):
    settings = dict(SETTINGS[setting])
    hidden, weight, labels, kwargs = _batch(dtype, settings.pop("old", None))
    scores = _scores()
    options = dict(eta=0.6, **settings)
    loss, aux, grad = _sequence_loss(function, backend, hidden, weight, labels, scores, options, kwargs)

    ref_hidden = hidden.detach().double().requires_grad_(True)
    ref_kwargs = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in {**options, **kwargs}.items()}
    ref_loss, ref_aux = reference.tpo_loss(ref_hidden @ weight.double().T, labels, scores, return_aux=True,
                                           **ref_kwargs)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_hidden)

    tol = TOL[dtype]
    torch.testing.assert_close(loss.double(), ref_loss, rtol=tol, atol=tol)
    for name in ("p", "q", "seq_logprobs"):
        torch.testing.assert_close(aux[name].double(), ref_aux[name], rtol=tol, atol=tol)
    near = slice(K, 2 * K)  # the near-tied group: u ~ 1e-7 when centered
    for rows in (near, slice(0, K)):
        u, ref_u = aux["u"][rows].double(), ref_aux["u"][rows]
        torch.testing.assert_close(u, ref_u, rtol=tol, atol=tol * float(ref_u.abs().max()))
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol, atol=tol)
    assert bool(aux["zero_signal"][3]) == ("old" not in setting)  # the exact tie, on-policy


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("setting", ["default", "exact_standardization", "wide_tolerance"])
@pytest.mark.parametrize("function", ["token_tpo_loss", "fused_linear_token_tpo_loss", "TokenTPOLoss"])
def test_token_losses_match_reference(function, setting, backend):
    hidden, weight, _, _ = _batch(torch.float64, None)
    states = hidden[:4, 0].detach().requires_grad_(True)  # [R, H], one state per group of _scores()
    candidates = torch.randint(0, V, (states.shape[0], K), generator=torch.Generator().manual_seed(12)).to(DEVICE)
    scores = _scores().view(-1, K)
    options = dict(eta=0.6, **SETTINGS[setting])
    if function == "fused_linear_token_tpo_loss":
        loss, aux = tpo_kernels.fused_linear_token_tpo_loss(states, weight, candidates, scores, backend=backend,
                                                            return_aux=True, **options)
    elif function == "token_tpo_loss":
        loss, aux = tpo_kernels.token_tpo_loss(states @ weight.T, candidates, scores, backend=backend,
                                               return_aux=True, **options)
    else:
        loss, aux = tpo_kernels.TokenTPOLoss(**options, backend=backend)(states @ weight.T, candidates, scores,
                                                                         return_aux=True)
    (grad,) = torch.autograd.grad(loss, states)
    ref_states = states.detach().requires_grad_(True)
    ref_loss, ref_aux = reference.token_tpo_loss(ref_states @ weight.T, candidates, scores, return_aux=True,
                                                 **options)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_states)
    tol = TOL[torch.float64]
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(aux["u"], ref_aux["u"], rtol=tol, atol=1e-17)
    torch.testing.assert_close(aux["q"], ref_aux["q"], rtol=tol, atol=tol)
    torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=tol)


SPREADS = [1.0, 1e-3, 1e-7]


def _gradient_at_spread(spread: float, **options) -> torch.Tensor:
    """d tpo_loss_from_logprobs / d logprobs for two groups of scores with a fixed pattern times
    ``spread``."""
    gen = torch.Generator().manual_seed(13)
    logprobs = (-torch.rand(2 * K, T, generator=gen, dtype=torch.float64)).to(DEVICE).requires_grad_(True)
    pattern = torch.tensor([0.0, 1.0, 0.25, 0.5, 1.0, 0.0, 0.0, 0.75], dtype=torch.float64)
    scores = (3.0 + spread * pattern).to(DEVICE)
    loss = tpo_kernels.tpo_loss_from_logprobs(logprobs, scores, group_size=K, eta=0.5, **options)
    (grad,) = torch.autograd.grad(loss, logprobs)
    return grad


def test_reward_noise_spreads_through_the_public_loss():
    """Spreads 1, 1e-3, 1e-7: with the default score_eps the 1e-7 gradient is at most 1e-6 of
    the one at 1; with score_eps=0 all three are the same full-strength gradient."""
    default = {s: _gradient_at_spread(s) for s in SPREADS}
    exact = {s: _gradient_at_spread(s, score_eps=0.0) for s in SPREADS}
    assert default[1e-7].abs().max() <= 1e-6 * default[1.0].abs().max()
    for s in SPREADS:
        torch.testing.assert_close(exact[s], exact[1.0], rtol=1e-8, atol=1e-12)
    assert torch.equal(default[1.0], exact[1.0]) and torch.equal(default[1e-3], exact[1e-3])


@pytest.mark.parametrize("value, error", [(-1e-6, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                                          (1e-40, ValueError), (1e39, ValueError), ("1e-6", TypeError),
                                          (True, TypeError)])
def test_bad_score_eps_is_refused_by_name(value, error):
    logprobs = -torch.rand(4, 3, device=DEVICE)
    with pytest.raises(error, match="score_eps"):
        tpo_kernels.tpo_loss_from_logprobs(logprobs, torch.randn(4, device=DEVICE), group_size=2, score_eps=value)


def test_length_normalize_must_be_a_bool():
    logprobs = -torch.rand(4, 3, device=DEVICE)
    with pytest.raises(TypeError, match="length_normalize"):
        tpo_kernels.tpo_loss_from_logprobs(logprobs, torch.randn(4, device=DEVICE), group_size=2, length_normalize=1)
