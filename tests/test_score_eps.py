"""The near-tie rule of the group op (``score_eps``, the authors' reference rule): within a group,
``u = s - mean`` (not divided) when the population std of the scores is at most ``score_eps``,
``u = (s - mean) / std`` otherwise, ``u = 0`` for an exact tie. Checked on every backend's group
op against ``reference.tpo_loss`` / ``reference.standardize``.

Tolerances: float64 token log-probs 1e-12; float32 ones 2e-6 (the group op computes in float64
from fp32 token log-probs and rounds its outputs to fp32; the reference runs in float64). Scores
are float64 throughout (as the losses pass them to the group op).
"""

from fractions import Fraction

import pytest
import torch

from tpo_kernels import reference
from tpo_kernels.group_math import standardize_dense

from _backends import DEVICE, DEVICE_BACKENDS, INTERPRETED_BACKENDS
from _batches import make_batch
from _group_stage import assert_matches_reference, group_stage_loss

BACKENDS = DEVICE_BACKENDS + INTERPRETED_BACKENDS
DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: 2e-6, torch.float64: 1e-12}
SPREADS = [1.0, 1e-3, 1e-7]
DEFAULT_EPS = 1e-6  # the losses' default


def _scores_with_spread(group_of: torch.Tensor, spread: float, offset: float = 3.0) -> torch.Tensor:
    """float64 scores for completions in groups ``group_of`` (``[N]``, 0..G-1): group g's members,
    in order, get ``offset + g + spread * pattern`` with a pattern of population std 1, so the
    group's std is ``spread`` (up to rounding)."""
    scores = torch.empty(group_of.numel(), dtype=torch.float64)
    for g in range(int(group_of.max()) + 1):
        members = torch.nonzero(group_of.cpu() == g).squeeze(1)
        pattern = torch.linspace(-1.0, 1.0, members.numel(), dtype=torch.float64).roll(g)
        scores[members] = offset + g + spread * (pattern - pattern.mean()) / pattern.std(unbiased=False)
    return scores.to(DEVICE)


def _contiguous(num_groups: int, group_size: int) -> torch.Tensor:
    return torch.arange(num_groups * group_size) // group_size


@pytest.mark.parametrize("score_eps", [0.0, DEFAULT_EPS])
@pytest.mark.parametrize("spread", [1.0, 1e-3, 1e-7, 0.0])
def test_reference_standardize_is_the_authors_rule(spread, score_eps):
    scores = _scores_with_spread(_contiguous(1, 5), spread).cpu()
    std = scores.std(unbiased=False)
    centered = scores - scores.mean()
    if spread == 0.0:
        expected = torch.zeros_like(scores)
    elif std <= score_eps:
        expected = centered
    else:
        expected = centered / std
    torch.testing.assert_close(reference.standardize(scores, score_eps), expected, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("score_eps", [0.0, DEFAULT_EPS])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_group_op_matches_reference(backend, dtype, spread, score_eps, layout):
    torch.manual_seed(0)
    grouping = "size" if layout == "padded" else "ids"
    logits, labels, _, kwargs = make_batch(layout=layout, grouping=grouping, num_groups=2, group_size=3,
                                           dtype=dtype, old="token")
    ids = kwargs.get("group_ids")
    group_of = _contiguous(2, 3) if ids is None else torch.unique(ids, return_inverse=True)[1]
    scores = _scores_with_spread(group_of, spread)
    settings = dict(eta=0.7, score_eps=score_eps, **kwargs)

    tol = TOL[dtype]
    result, aux = assert_matches_reference(logits, labels, scores, backend=backend, tol=tol, **settings)
    scale = float(aux["u"].abs().max())  # u is ~spread in a near tie: compare relative to it
    torch.testing.assert_close(result.u.double(), aux["u"], rtol=tol, atol=tol * scale)
    for name in ("p", "q"):
        torch.testing.assert_close(getattr(result, name).double(), aux[name], rtol=tol, atol=tol)


def _gradient_at_spread(backend: str, spread: float, score_eps: float) -> torch.Tensor:
    """d loss / d token log-probs, on-policy, for scores of the given spread (same pattern)."""
    gen = torch.Generator().manual_seed(1)
    n, t = 8, 6
    logits = torch.randn(n, t, 11, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_(True)
    labels = torch.randint(0, 11, (n, t), generator=gen).to(DEVICE)
    loss, _ = group_stage_loss(logits, labels, _scores_with_spread(_contiguous(2, 4), spread), backend=backend, group_size=4,
                               eta=0.5, score_eps=score_eps)
    (grad,) = torch.autograd.grad(loss, logits)
    return grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_reward_noise_carries_no_full_strength_update(backend):
    """Three spreads: with the default ``score_eps`` a 1e-7 spread (reward-model
    rounding noise) moves the policy at most 1e-6 as much as a spread of 1; with
    ``score_eps=0`` every spread gives the same full-strength gradient."""
    full = {spread: _gradient_at_spread(backend, spread, 0.0) for spread in SPREADS}
    for spread in SPREADS[1:]:
        torch.testing.assert_close(full[spread], full[1.0], rtol=1e-9, atol=1e-12)
    assert full[1.0].abs().max() > 0.1

    default = {spread: _gradient_at_spread(backend, spread, DEFAULT_EPS) for spread in SPREADS}
    assert default[1e-7].abs().max() <= 1e-6 * default[1.0].abs().max()
    assert default[1e-7].abs().max() > 0  # a near tie is weak, not silent
    for spread in (1.0, 1e-3):  # std above score_eps: the divided rule, bit for bit
        assert torch.equal(default[spread], full[spread])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("std", [0.9e-6, 1.1e-6])
def test_tolerance_is_on_the_population_std(backend, std):
    """Scores [-a, a] have population std a: at or below score_eps they are centered, above it
    divided (u = -1, 1)."""
    scores = torch.tensor([5.0 - std, 5.0 + std, 2.0, 4.0], dtype=torch.float64, device=DEVICE)
    labels = torch.zeros(4, 1, dtype=torch.int64, device=DEVICE)
    logits = torch.zeros(4, 1, 3, dtype=torch.float64, device=DEVICE)
    _, result = group_stage_loss(logits, labels, scores, backend=backend, group_size=2, score_eps=DEFAULT_EPS)
    near = torch.tensor([-std, std], dtype=torch.float64, device=DEVICE)
    expected = near if std <= DEFAULT_EPS else near / std
    torch.testing.assert_close(result.u[:2], expected, rtol=1e-8, atol=0)
    torch.testing.assert_close(result.u[2:], torch.tensor([-1.0, 1.0], dtype=torch.float64, device=DEVICE))


@pytest.mark.parametrize("backend", BACKENDS)
def test_centered_scores_keep_their_digits_at_a_large_offset(backend):
    """A near tie at scores ~1e6 (float64 spacing 1.2e-10): ``u = s - mean`` to float64
    accuracy of u itself, as from the exact differences (``s - s.mean()`` in float64 would be off
    by ~1e-10, i.e. 1e-3 relative)."""
    scores = torch.tensor([1e6 + 3e-7, 1e6 - 1e-7, 1e6 + 0.4e-7], dtype=torch.float64, device=DEVICE)
    exact = [Fraction(s) for s in scores.tolist()]
    mean = sum(exact) / len(exact)
    expected = torch.tensor([float(s - mean) for s in exact], dtype=torch.float64, device=DEVICE)
    logits = torch.zeros(3, 1, 3, dtype=torch.float64, device=DEVICE)
    labels = torch.zeros(3, 1, dtype=torch.int64, device=DEVICE)
    _, result = group_stage_loss(logits, labels, scores, backend=backend, group_size=3, score_eps=DEFAULT_EPS)
    torch.testing.assert_close(result.u, expected, rtol=1e-12, atol=0)
    dense = standardize_dense(scores.view(1, 3), torch.ones(1, 3, dtype=torch.bool, device=DEVICE), DEFAULT_EPS)
    torch.testing.assert_close(dense.view(3), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_ties_stay_exactly_zero_signal(backend, dtype):
    """With a tolerance, an exact tie still gets u = 0 and, on-policy, p == q bit for bit: its
    tokens' gradient is exactly 0 (what lets the kernels skip them); the near tie next to it
    gets a small nonzero one."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 4, 9, generator=gen, dtype=torch.float64).to(DEVICE, dtype).requires_grad_(True)
    labels = torch.randint(0, 9, (6, 4), generator=gen).to(DEVICE)
    v = 0.45938294312745087  # its float mean over three copies differs from v
    scores = torch.tensor([v, v, v, v, v + 1e-8, v - 1e-8], dtype=torch.float64, device=DEVICE)
    loss, result = group_stage_loss(logits, labels, scores, backend=backend, group_size=3, eta=0.5,
                                    score_eps=DEFAULT_EPS)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.equal(result.u[:3], torch.zeros(3, dtype=dtype, device=DEVICE))
    assert torch.equal(result.p[:3], result.q[:3])
    assert torch.equal(grad[:3], torch.zeros_like(grad[:3]))
    assert grad[3:].abs().max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spread", [1.0, 1e-7])
def test_gradcheck_float64(backend, spread):
    """Off-policy (old log-probs given, so q does not depend on the input): the analytic
    gradient of the group op on token log-probs, divided and centered rules."""
    torch.manual_seed(3)
    logits, labels, _, kwargs = make_batch(num_groups=2, group_size=2, max_len=2, vocab=3, dtype=torch.float64,
                                           old="seq")
    scores = _scores_with_spread(_contiguous(2, 2), spread)

    def loss(x):
        return group_stage_loss(x, labels, scores, backend=backend, eta=0.7, score_eps=DEFAULT_EPS, **kwargs)[0]

    assert torch.autograd.gradcheck(loss, (logits.detach().requires_grad_(True),), eps=1e-6, atol=1e-8)
