"""Every keyword of every public function takes a number of any Python or NumPy type, or refuses
it with one ValueError / TypeError naming the keyword, in the check pass.

For each function, its tiny batch on the torch backend is called with one keyword replaced by a
value from a table that holds every numeric type (Python ints of any size, floats, bools; NumPy
float16..longdouble, int8..uint64, bool_; Decimal, Fraction, complex; 0-d NumPy arrays and torch
tensors; None and a str), in range and out of it, and by values hypothesis draws. The call either
works, giving a finite result, or raises exactly one ValueError or TypeError (no chained error)
whose message names the keyword. A call whose logits' span in a row, times the factor
``logit_scale / temperature`` it is given, overflows float32 is exempt from the finite result:
the factor itself is range-checked, the logits' values are not read (DESIGN.md, numerics).

The module forms raise the same errors as their functions, and ``tpo-kernels check`` refuses an
out-of-range hyper-parameter as a usage error naming the option.
"""

from __future__ import annotations

import decimal
import fractions
import inspect
import warnings

import numpy as np
import pytest
import torch

import tpo_kernels
from tpo_kernels import cli, selfcheck

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

N, T, V, H, R, K = 4, 3, 5, 4, 3, 2
FP32_MAX = float(torch.finfo(torch.float32).max)

# ----------------------------------------------------------------------------- the values


def _numpy_values():
    values = []
    for kind in (np.float16, np.float32, np.float64, np.longdouble):
        values += [kind(0.5), kind(0), kind(np.finfo(kind).max), kind("nan")]
    for kind in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64):
        info = np.iinfo(kind)
        values += [kind(0), kind(1), kind(2), kind(info.max)] + ([kind(info.min)] if info.min < 0 else [])
    return values + [np.bool_(True), np.bool_(False)]


VALUES = [
    # Python ints: small, int32/int64 edges, beyond int64, beyond float
    0, 1, 2, 3, -1, -100, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64 + 2, -(2 ** 63), -(2 ** 63) - 1, 10 ** 400,
    -(10 ** 400),
    # Python floats: float32 edges and beyond
    0.0, 0.5, 1.0, 2.0, -1.0, 1e-39, 3e-39, 1e-300, 5e-324, 1e17, 1e18, 1e38, 3.4e38, 1e39, 1e300,
    float("inf"), -float("inf"), float("nan"),
    True, False,
    *_numpy_values(),
    decimal.Decimal("0.5"), decimal.Decimal("2"), fractions.Fraction(1, 2), fractions.Fraction(3),
    fractions.Fraction(10 ** 400, 3), complex(1, 0), np.complex64(1),
    np.array(0.5), np.array(2), np.array(True), torch.tensor(0.5), torch.tensor(2), torch.tensor(True),
    None, "1",
]

# ----------------------------------------------------------------------------- the calls


def _inputs():
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, V, (N, T), generator=gen)
    return dict(
        logits=torch.randn(N, T, V, generator=gen), labels=labels, scores=torch.randn(N, generator=gen),
        hidden=torch.randn(N, T, H, generator=gen), weight=torch.randn(V, H, generator=gen),
        ref_logprobs=-torch.rand(N, T, generator=gen), logprobs=-torch.rand(N, T, generator=gen),
        state_logits=torch.randn(R, V, generator=gen), state_hidden=torch.randn(R, H, generator=gen),
        candidates=torch.randint(0, V, (R, K), generator=gen), candidate_scores=torch.randn(R, K, generator=gen),
    )


def _base_calls():
    """``{function: every argument of its working call}``: each function's tiny batch (with
    ref_logprobs where it takes them, so that beta > 0 works), torch backend."""
    x = _inputs()
    sequence = dict(labels=x["labels"], scores=x["scores"], group_size=2, ref_logprobs=x["ref_logprobs"],
                    backend="torch")
    token = dict(candidates=x["candidates"], scores=x["candidate_scores"], backend="torch")
    return {
        "tpo_loss": dict(logits=x["logits"], **sequence),
        "fused_linear_tpo_loss": dict(hidden=x["hidden"], weight=x["weight"], **sequence),
        "tpo_loss_from_logprobs": dict(logprobs=x["logprobs"], scores=x["scores"], group_size=2,
                                       ref_logprobs=x["ref_logprobs"], backend="torch"),
        "selective_logprobs": dict(logits=x["logits"], labels=x["labels"], backend="torch"),
        "fused_linear_logprobs": dict(hidden=x["hidden"], weight=x["weight"], labels=x["labels"], backend="torch"),
        "token_tpo_loss": dict(logits=x["state_logits"], **token),
        "fused_linear_token_tpo_loss": dict(hidden=x["state_hidden"], weight=x["weight"], **token),
    }


BASE_CALLS = _base_calls()
FUNCTIONS = list(BASE_CALLS)
KEYWORDS = [(function, name) for function in FUNCTIONS
            for name in inspect.signature(getattr(tpo_kernels, function)).parameters]


def _logit_span(base: dict) -> float:
    """The largest difference of two logits of one row (the log-softmax forms those), untransformed."""
    logits = base["logits"] if "logits" in base else base["hidden"] @ base["weight"].T
    return float((logits.amax(-1) - logits.amin(-1)).max())


def _factor_overflows(base: dict, keyword: str, value) -> bool:
    """Whether ``keyword=value`` scales this call's logits beyond float32: the one non-finite
    result a range-checked keyword may give (the logits' values are not checked)."""
    if keyword not in ("temperature", "logit_scale"):
        return False
    try:
        factor = float(value) if keyword == "logit_scale" else 1.0 / float(value)
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
        return False
    return factor * _logit_span(base) > FP32_MAX


def _outcome(function: str, keyword: str, value):
    """The call with ``keyword=value``: None when it works with a finite result, else what it raised."""
    base = BASE_CALLS[function]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # group_size=1 warns (a loss of 0), and NumPy's casts
        try:
            out = getattr(tpo_kernels, function)(**{**base, keyword: value})
        except Exception as error:  # noqa: BLE001 - judged by the caller
            return error
    results = out if isinstance(out, tuple) else (out,)
    tensors = [r for r in results if isinstance(r, torch.Tensor)]
    if not all(bool(torch.isfinite(t).all()) for t in tensors) and not _factor_overflows(base, keyword, value):
        return AssertionError(f"{function}({keyword}={value!r}) gave a non-finite result: {tensors[0]}")
    return None


def _assert_works_or_names_it(function: str, keyword: str, value) -> None:
    error = _outcome(function, keyword, value)
    if error is None:
        return
    where = f"{function}({keyword}={value!r})"
    assert type(error) in (ValueError, TypeError), f"{where} raised {type(error).__name__}: {error}"
    assert keyword in str(error), f"{where}: the message does not name {keyword}: {error}"
    chained = error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__)
    assert not chained, f"{where}: raised while handling {error.__context__!r}"


# ----------------------------------------------------------------------------- the table


@pytest.mark.parametrize("function, keyword", KEYWORDS, ids=[f"{f}-{k}" for f, k in KEYWORDS])
def test_every_numeric_type_works_or_is_refused_naming_the_keyword(function, keyword):
    """Each value of the table: a finite result, or one ValueError / TypeError naming the keyword."""
    for value in VALUES:
        _assert_works_or_names_it(function, keyword, value)


def test_the_table_holds_every_numeric_type():
    """Every Python and NumPy numeric type is in the table (its case count printed for the record)."""
    kinds = {int, float, bool, decimal.Decimal, fractions.Fraction, complex, np.ndarray, torch.Tensor, np.bool_,
             np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.int8, np.int16, np.int32, np.int64,
             np.uint8, np.uint16, np.uint32, np.uint64}
    assert kinds <= {type(v) for v in VALUES}
    print(f"\n{len(KEYWORDS)} keywords x {len(VALUES)} values = {len(KEYWORDS) * len(VALUES)} table cases, "
          f"plus {len(FUNCTIONS)} x {DRAWN_EXAMPLES} drawn ones")


# ----------------------------------------------------------------------------- drawn values

DRAWN_EXAMPLES = 150  # per function


def _numbers():
    """Any int (to beyond a float), any float (subnormals, inf, NaN), and NumPy scalars of every
    kind of any value their dtype holds."""
    from hypothesis.extra import numpy as hnp

    dtypes = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
              "uint64", "bool"]
    numpy_scalars = st.sampled_from(dtypes).flatmap(
        lambda d: hnp.from_dtype(np.dtype(d)).map(lambda v, d=d: np.dtype(d).type(v)))
    return st.one_of(st.integers(-(2 ** 70), 2 ** 70), st.integers().map(lambda e: 10 ** min(abs(e), 500)),
                     st.floats(allow_nan=True, allow_infinity=True), st.booleans(), numpy_scalars,
                     st.fractions())


@pytest.mark.parametrize("function", FUNCTIONS)
@settings(max_examples=DRAWN_EXAMPLES, deadline=None)
@given(data=st.data())
def test_drawn_numbers_work_or_are_refused_naming_the_keyword(function, data):
    names = [k for f, k in KEYWORDS if f == function]
    keyword = data.draw(st.sampled_from(names), label="keyword")
    _assert_works_or_names_it(function, keyword, data.draw(_numbers(), label="value"))


# ----------------------------------------------------------------------------- the reported defects


@pytest.mark.parametrize("function", ["fused_linear_tpo_loss", "fused_linear_logprobs"])
@pytest.mark.parametrize("chunk_size", [2 ** 63, 2 ** 64 - 1, 10 ** 30, np.uint64(2 ** 63)])
def test_chunk_size_beyond_int64_fails_the_check_pass(function, chunk_size):
    with pytest.raises(ValueError, match=r"chunk_size must be an int in \[1, 2\*\*63\)"):
        getattr(tpo_kernels, function)(**{**BASE_CALLS[function], "chunk_size": chunk_size})


@pytest.mark.parametrize("function", ["fused_linear_tpo_loss", "fused_linear_logprobs"])
def test_the_largest_int64_chunk_size_works(function):
    out = getattr(tpo_kernels, function)(**{**BASE_CALLS[function], "chunk_size": 2 ** 63 - 1})
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("field, value, error", [
    ("logits_bytes", -1, ValueError), ("min_tile_tokens", 2 ** 63, ValueError), ("accum_bytes", 1.5, TypeError),
    ("matmul_out_dtype", 1, TypeError),
])
def test_tile_policy_sizes_are_checked_as_the_integer_keywords(field, value, error):
    """The sizes a tile policy hands the ops are int64 like chunk_size; its switch is a bool."""
    import dataclasses

    policy = dataclasses.replace(tpo_kernels.TilePolicy.for_device(torch.device("cpu")), **{field: value})
    with pytest.raises(error, match=rf"^tile_policy.{field} must be"):
        tpo_kernels.fused_linear_logprobs(**BASE_CALLS["fused_linear_logprobs"], tile_policy=policy)


@pytest.mark.parametrize("keyword", ["eta", "temperature", "beta", "entropy_coef", "score_eps", "logit_scale",
                                     "logit_softcap"])
@pytest.mark.parametrize("value", [10 ** 400, -(10 ** 400), fractions.Fraction(10 ** 400, 3)])
def test_a_number_beyond_a_float_is_a_value_error_naming_it(keyword, value):
    with pytest.raises(ValueError, match=rf"^{keyword} must be .* \(beyond the range of a float\)$"):
        tpo_kernels.tpo_loss(**{**BASE_CALLS["tpo_loss"], keyword: value})


@pytest.mark.parametrize("function", ["tpo_loss", "selective_logprobs"])
@pytest.mark.parametrize("ignore_index", [2 ** 64 + 2, -(2 ** 63) - 1, 2 ** 63, np.uint64(2 ** 64 - 1)])
def test_ignore_index_beyond_int64_is_a_value_error_naming_it(function, ignore_index):
    with pytest.raises(ValueError, match=r"ignore_index must be an int in \[-2\*\*63, 2\*\*63\)"):
        getattr(tpo_kernels, function)(**{**BASE_CALLS[function], "ignore_index": ignore_index})


@pytest.mark.parametrize("dtype, wrapped", [(torch.int32, 2 ** 32 + 1), (torch.uint8, 257), (torch.int16, 2 ** 16 + 1)])
def test_ignore_index_is_compared_without_wrapping_into_the_labels_dtype(dtype, wrapped):
    """Labels 1 in a narrow dtype do not equal an ignore_index that wraps to 1 there: they count."""
    logits = BASE_CALLS["selective_logprobs"]["logits"]
    labels = torch.ones(N, T, dtype=dtype)
    got = tpo_kernels.selective_logprobs(logits, labels, ignore_index=wrapped, backend="torch")
    want = tpo_kernels.selective_logprobs(logits, labels.long(), backend="torch")
    assert torch.equal(got, want) and bool((got != 0).all())


@pytest.mark.parametrize("keyword", ["beta", "entropy_coef"])
@pytest.mark.parametrize("value", [1e39, 1e38, 1e19])
def test_term_weights_that_overflow_the_loss_are_refused(keyword, value):
    with pytest.raises(ValueError, match=rf"{keyword} must be a finite number >= 0 and at most 5.76"):
        tpo_kernels.tpo_loss(**{**BASE_CALLS["tpo_loss"], keyword: value})


@pytest.mark.parametrize("function", ["tpo_loss", "fused_linear_tpo_loss"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_largest_term_weights_keep_the_loss_finite(function, reduction):
    from tpo_kernels.checks.arguments import MAX_TERM_WEIGHT

    loss = getattr(tpo_kernels, function)(**{**BASE_CALLS[function], "beta": MAX_TERM_WEIGHT,
                                             "entropy_coef": MAX_TERM_WEIGHT, "reduction": reduction})
    assert bool(torch.isfinite(loss).all())


def test_a_soft_cap_whose_tempered_span_overflows_float32_is_refused():
    """Capped logits lie in [-c, c]; divided by the temperature their span 2c / temperature must be
    finite in float32 (1e20 / 1e-20 gave NaN)."""
    with pytest.raises(ValueError, match="logit_softcap / temperature must lie in"):
        tpo_kernels.tpo_loss(**BASE_CALLS["tpo_loss"], logit_softcap=1e20, logit_scale=1e20, temperature=1e-20)
    for function in ("tpo_loss", "fused_linear_tpo_loss", "token_tpo_loss"):  # a span of 2e38 is finite
        loss = getattr(tpo_kernels, function)(**BASE_CALLS[function], logit_softcap=1e38, logit_scale=1e38)
        assert bool(torch.isfinite(loss)), function


# ----------------------------------------------------------------------------- modules and the CLI

MODULES = {"TPOLoss": "tpo_loss", "FusedLinearTPOLoss": "fused_linear_tpo_loss", "TokenTPOLoss": "token_tpo_loss",
           "FusedLinearTokenTPOLoss": "fused_linear_token_tpo_loss"}
BAD_SETTINGS = [("eta", 10 ** 400), ("temperature", np.float32("nan")), ("beta", 1e39), ("entropy_coef", 1e39),
                ("score_eps", decimal.Decimal("1e-6")), ("logit_scale", torch.tensor(2.0)), ("chunk_size", 2 ** 63),
                ("ignore_index", 2 ** 64 + 2), ("logits_cache_bytes", -1), ("anchor", np.array(True))]


MODULE_CASES = [(module, keyword, value) for module, function in MODULES.items() for keyword, value in BAD_SETTINGS
                if keyword in inspect.signature(getattr(tpo_kernels, function)).parameters]


@pytest.mark.parametrize("module, keyword, value", MODULE_CASES, ids=[f"{m}-{k}" for m, k, _ in MODULE_CASES])
def test_modules_raise_their_functions_error(module, keyword, value):
    """A module's setting out of range raises, at its call, the error of its function's keyword."""
    function = MODULES[module]
    cls = getattr(tpo_kernels, module)
    want = _outcome(function, keyword, value)
    assert isinstance(want, (ValueError, TypeError)), want
    base = dict(BASE_CALLS[function])
    tensors = [base.pop(name) for name in list(inspect.signature(cls.forward).parameters)[1:-1]]
    batch = {name: base.pop(name) for name in cls.batch_keywords if name in base}
    with pytest.raises(type(want)) as caught:
        cls(**base, **{keyword: value})(*tensors, **batch)
    assert str(caught.value) == str(want)


@pytest.mark.parametrize("argv, option, words", [
    (["--eta", "1e400"], "--eta", "finite number > 0"),
    (["--temperature", "1e-39"], "--temperature", "temperature must be at least"),
    (["--logit-softcap", "2e38", "--logit-scale", "2e38"], "--logit-softcap",
     "logit_softcap / temperature must lie in"),
    (["--logit-scale", "1e39"], "--logit-scale", "logit_scale / temperature must lie in"),
])
def test_the_check_command_refuses_out_of_range_hyper_parameters(argv, option, words, capsys, monkeypatch):
    def reached(*args, **kwargs):
        raise AssertionError("the command started its work")

    monkeypatch.setattr(selfcheck, "check", reached)
    try:
        status = cli.main(["check", *argv])
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err.splitlines()
    assert status == 2 and len(err) == 1, (status, err)
    assert err[0].startswith(f"tpo-kernels check: error: {option}: ") and words in err[0], err
