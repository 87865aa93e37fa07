"""The Triton kept-set kernels on token-level TPO's candidates (``[R, K]`` ids as kept sets of K
pairs per row, :meth:`KeptSets.from_candidates`), op by op (the losses built on them are tested end
to end in test_token_level.py; ragged sets in test_kept_kernels.py).

Logits path: equal to the PyTorch default ops bit for bit in fp32 / fp64 (same order of sums; the
op multiplies by ``inv_t`` before the scatter, so each product is rounded before its sum; the
interpreter's bf16 / fp16 casts may round one output ulp differently), duplicates summed in
ascending k order, any strides of ``out``. Fused-linear path: dH, dW and db against float64 sums
over the (state, candidate) pairs, at 1e-5 (fp32) and 1e-12 (fp64), on uniform and skewed
candidates whose runs cross the weight-gradient segments (64 pairs) in every way; bitwise
repeatable. Kernels compile for sm_80 / sm_90 without spills. Shapes stay small: on CPU the
kernels run under the Triton interpreter.
"""

import textwrap

import pytest
import torch

import tpo_kernels.backends.torch_kept as torch_ops
from bench import kernel_report
from tpo_kernels.backends.kept_sets import KeptSets
from tpo_kernels.group_math import pair_runs

from _backends import DEVICE, needs_triton
from _triton_compile import assert_kernels_compile_without_spills

pytestmark = needs_triton

SEGMENT = 64  # candidate_weight_grad.SEGMENT_PAIRS, spelled out: the cases below are built around it

# ----------------------------------------------------------------------------- logits path


@pytest.fixture(scope="module")
def ck():
    from tpo_kernels.backends.triton import kept_kernels

    return kept_kernels


def _sets(cands):
    return KeptSets.from_candidates(cands)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_gather_and_scatter_match_default_ops(ck, dtype):
    gen = torch.Generator().manual_seed(12)
    num_states, num_cand, vocab = 5, 6, 1500
    logits = torch.randn(num_states, vocab, generator=gen).to(dtype).to(DEVICE)
    cands = torch.randint(0, vocab, (num_states, num_cand), generator=gen)
    cands[0, 3] = cands[0, 1]
    cands[1] = vocab - 1
    cands = cands.to(DEVICE)
    kept = _sets(cands)
    got = ck.kept_gather(logits, kept)
    assert torch.equal(got, torch_ops.kept_gather(logits, kept))
    for inv_t in (1.0, 1 / 0.7):
        grad = torch.randn(num_states * num_cand, generator=gen, dtype=got.dtype).to(DEVICE) * inv_t
        out = torch.full_like(logits, float("nan"))
        expected = torch.empty_like(logits)
        ck.kept_scatter(grad, kept, out=out)
        torch_ops.kept_scatter(grad, kept, out=expected)
        if dtype in (torch.float32, torch.float64) or DEVICE.type == "cuda":
            assert torch.equal(out, expected)
        else:  # the interpreter's float -> bf16/fp16 cast may round differently: one output ulp
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-3
            torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
            assert torch.equal(out == 0, expected == 0)


def test_scatter_sums_duplicates_in_ascending_k_order(ck):
    """Sums that depend on the order: (0 + 1e8 + 1) - 1e8 is 0 in fp32, any other order gives 1
    or 2. K = 70 spans five 16-lane blocks, with copies of one id in the first and the last."""
    grad = torch.zeros(2, 70)
    cands = torch.arange(70).repeat(2, 1)
    cands[0, [3, 10, 66]] = 7
    grad[0, [3, 10, 66]] = torch.tensor([1e8, 1.0, -1e8])
    cands[1, [5, 69]] = 0
    grad[1, [0, 5, 69]] = torch.tensor([1.0, 1e8, -1e8])
    out = torch.full((2, 80), float("nan"), device=DEVICE)
    kept = _sets(cands.to(DEVICE))
    ck.kept_scatter(grad.reshape(-1).to(DEVICE), kept, out=out)
    expected = torch.empty_like(out)
    torch_ops.kept_scatter(grad.reshape(-1).to(DEVICE), kept, out=expected)
    assert torch.equal(out, expected)
    assert out[0, 7] == 0 and out[1, 0] == 0
    assert bool((out[:, 70:] == 0).all())  # ids no candidate holds: zero, not left as they were


def test_scatter_into_strided_out(ck):
    cands = torch.tensor([[1, 1, 4], [0, 2, 3]], device=DEVICE)
    grad = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], device=DEVICE)
    out = torch.full((5, 2), float("nan"), device=DEVICE).T  # [2, 5], column stride 2
    ck.kept_scatter(grad.reshape(-1) * 0.5, _sets(cands), out=out)
    expected = torch.tensor([[0.0, 1.5, 0.0, 0.0, 1.5], [2.0, 0.0, 2.5, 3.0, 0.0]], device=DEVICE)
    assert torch.equal(out, expected)


# ----------------------------------------------------------------------------- fused-linear path


def _skewed_candidates(case: str, gen: torch.Generator) -> torch.Tensor:
    """[48, 4] candidate ids (192 pairs: three weight-gradient segments) over a vocabulary of 29."""
    num_states, num_cand, vocab = 48, 4, 29
    if case == "uniform":  # short runs, some crossing a segment end by chance
        return torch.randint(0, vocab, (num_states, num_cand), generator=gen)
    if case == "one_token_dominates":  # a run of 144+ pairs from mid-segment, crossing two ends
        cands = torch.full((num_states, num_cand), 11)
        cands[:, 0] = torch.randint(0, vocab, (num_states,), generator=gen)
        return cands
    if case == "all_one_token":  # one run: every pair, all three segments
        return torch.full((num_states, num_cand), 28)
    if case == "segment_aligned":  # three runs of exactly one segment each: none crosses
        return (torch.arange(num_states * num_cand) // SEGMENT * 10)[torch.randperm(192, generator=gen)].view(48, 4)
    raise ValueError(case)


def _explicit_weight_grads(grad, hidden, cands, vocab):
    """dW, db as plain float64 sums over the (state, candidate) pairs."""
    dweight = torch.zeros(vocab, hidden.shape[1], dtype=torch.float64)
    dbias = torch.zeros(vocab, dtype=torch.float64)
    for (r, k), token in zip(torch.cartesian_prod(*map(torch.arange, cands.shape)).tolist(), cands.reshape(-1)):
        dweight[token] += grad[r, k].double() * hidden[r].double()
        dbias[token] += grad[r, k].double()
    return dweight, dbias


CASES = ["uniform", "one_token_dominates", "all_one_token", "segment_aligned"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("hidden_size", [40, 1100])  # one column block; two, the second partial
def test_linear_backward_matches_pair_sums(ck, case, dtype, hidden_size):
    gen = torch.Generator().manual_seed(13)
    cands = _skewed_candidates(case, gen)
    vocab = 29
    hidden = torch.randn(cands.shape[0], hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    grad = torch.randn(cands.shape, generator=gen, dtype=torch.float64).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    expected_w, expected_b = _explicit_weight_grads(grad, hidden, cands, vocab)
    expected_h = torch.einsum("rk,rkh->rh", grad.double(), weight.double()[cands])
    args = [t.to(DEVICE) for t in (grad, hidden, weight, cands)]
    runs = pair_runs(args[3])
    for with_hidden, with_weight, with_bias in ((True, True, True), (False, False, True), (False, True, False)):
        dhidden, dweight, dbias = ck.kept_linear_backward(
            args[0].reshape(-1), args[1], args[2], _sets(args[3]), runs=runs, with_hidden=with_hidden,
            with_weight=with_weight, with_bias=with_bias,
        )
        for got, expected, wanted in ((dhidden, expected_h, with_hidden), (dweight, expected_w, with_weight),
                                      (dbias, expected_b, with_bias)):
            assert (got is None) == (not wanted)
            if wanted:
                assert got.dtype == dtype
                torch.testing.assert_close(got.cpu().double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_forward_matches_default_op(ck, dtype):
    gen = torch.Generator().manual_seed(14)
    cands = _skewed_candidates("uniform", gen)[:6].to(DEVICE)
    hidden = torch.randn(6, 40, generator=gen, dtype=dtype).to(DEVICE)
    weight = torch.randn(29, 40, generator=gen, dtype=dtype).to(DEVICE)
    bias = torch.randn(29, generator=gen, dtype=dtype).to(DEVICE)
    got = ck.kept_linear_forward(hidden, weight, _sets(cands), bias=bias)
    expected = torch_ops.kept_linear_forward(hidden, weight, _sets(cands), bias=bias)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", ["uniform", "one_token_dominates"])
def test_linear_backward_is_bitwise_repeatable(ck, case):
    gen = torch.Generator().manual_seed(15)
    cands = _skewed_candidates(case, gen).to(DEVICE)
    hidden = torch.randn(cands.shape[0], 40, generator=gen).to(DEVICE)
    weight = torch.randn(29, 40, generator=gen).to(DEVICE)
    grad = torch.randn(cands.shape, generator=gen).to(DEVICE)
    flags = dict(runs=pair_runs(cands), with_hidden=True, with_weight=True, with_bias=True)
    first = ck.kept_linear_backward(grad.reshape(-1), hidden, weight, _sets(cands), **flags)
    second = ck.kept_linear_backward(grad.reshape(-1), hidden, weight, _sets(cands), **flags)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ----------------------------------------------------------------------------- GPU code generation

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from bench import kernel_report as KR

    scenarios = [s for s in KR.triton_scenarios(vocabs=(50257,), dtypes=("bf16", "fp64"))
                 if s.label.startswith("candidate")]
    rows = [row for arch in (80, 90) for row in KR.collect_triton(arch, scenarios)]
    with open(sys.argv[1], "w") as f:
        json.dump([r.to_json() for r in rows], f)
    """
)

KERNELS = {"_kept_gather_kernel", "_kept_scatter_kernel", "_kept_dot_kernel", "_kept_hidden_grad_kernel",
           "_weight_grad_run_kernel", "_weight_grad_segment_kernel", "_weight_grad_combine_kernel"}


@pytest.mark.skipif(kernel_report.triton_tool("cuobjdump") is None, reason="Triton's NVIDIA tools are absent")
def test_kernels_compile_for_sm80_and_sm90_without_spills(tmp_path):
    """The interpreter accepts programs the compiler may reject: the kernel report's launch capture
    compiles every kernel the candidates run as its launcher specializes it (no GPU needed), including the
    segment and combine passes of the weight gradient (the report's scenario has a long run)."""
    assert_kernels_compile_without_spills(_COMPILE_SCRIPT, KERNELS, tmp_path / "rows.json")
