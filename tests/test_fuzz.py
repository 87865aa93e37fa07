"""Fuzz test of every public function: random valid calls with one thing broken: a
wrong shape, dtype or device (meta), a label or candidate id out of range, NaN/inf in a float
input, a bad hyper-parameter, or a NumPy scalar where a number goes.

Every outcome is one of:
* a ``ValueError`` / ``TypeError`` whose message names the public argument that was broken;
* a result with only finite values (valid calls, NumPy scalars, -inf logits);
* a result with non-finite values when NaN/+inf was put into an activation the result reads
  (logits, hidden, weight, bias): NaN propagates, as in torch (the package never checks every
  logit: that would cost a full extra read of the largest tensor, and AMP loss scaling relies on
  seeing the inf). It is never swallowed into a finite wrong value.

Never a crash (another exception), a hang or a silent NaN from finite inputs. Hypothesis runs
derandomized with no example database (reproducible in CI) and a bounded number of examples.
Also here: a repeated-call memory test.
"""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tpo_kernels as tk

FUNCTIONS = ("tpo_loss", "fused_linear_tpo_loss", "token_tpo_loss", "fused_linear_token_tpo_loss",
             "selective_logprobs", "fused_linear_logprobs")
BACKENDS = [b for b in ("torch", "cpu") if tk.backend_status()[b] == "available"]
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _base_call(fn: str, n: int, k: int, t: int, v: int, h: int, seed: int, backend: str):
    """A valid call: (positional tensors by name, keyword arguments)."""
    gen = torch.Generator().manual_seed(seed)
    n = n * k
    labels = torch.randint(0, v, (n, t), generator=gen)
    labels[:, -1] = -100 if t > 1 else labels[:, -1]
    scores = torch.randn(n, generator=gen)
    if fn in ("tpo_loss", "selective_logprobs"):
        args = {"logits": torch.randn(n, t, v, generator=gen) * 3, "labels": labels}
    elif fn in ("fused_linear_tpo_loss", "fused_linear_logprobs"):
        args = {"hidden": torch.randn(n, t, h, generator=gen), "weight": torch.randn(v, h, generator=gen),
                "labels": labels}
    elif fn == "token_tpo_loss":
        args = {"logits": torch.randn(n, v, generator=gen) * 3, "candidates": torch.randint(0, v, (n, k), generator=gen)}
    else:
        args = {"hidden": torch.randn(n, h, generator=gen), "weight": torch.randn(v, h, generator=gen),
                "candidates": torch.randint(0, v, (n, k), generator=gen)}
    kwargs = {"backend": backend}
    if fn in ("tpo_loss", "fused_linear_tpo_loss"):
        args["scores"] = scores
        kwargs["group_size"] = k
    elif fn in ("token_tpo_loss", "fused_linear_token_tpo_loss"):
        args["scores"] = torch.randn(n, k, generator=gen)
    return args, kwargs


def _call(fn, args, kwargs):
    order = {"tpo_loss": ("logits", "labels", "scores"), "selective_logprobs": ("logits", "labels"),
             "fused_linear_tpo_loss": ("hidden", "weight", "labels", "scores"),
             "fused_linear_logprobs": ("hidden", "weight", "labels"),
             "token_tpo_loss": ("logits", "candidates", "scores"),
             "fused_linear_token_tpo_loss": ("hidden", "weight", "candidates", "scores")}[fn]
    return getattr(tk, fn)(*(args[name] for name in order), **kwargs)


def _outputs(result):
    if isinstance(result, tuple):
        return [x for x in result if isinstance(x, torch.Tensor)]
    return [result]


# What a hyper-parameter mutation sets, and which functions take it.
SEQ = ("tpo_loss", "fused_linear_tpo_loss")
LOSSES = SEQ + ("token_tpo_loss", "fused_linear_token_tpo_loss")
LABELLED = SEQ + ("selective_logprobs", "fused_linear_logprobs")
LINEAR = ("fused_linear_tpo_loss", "fused_linear_token_tpo_loss", "fused_linear_logprobs")
BAD_SCALARS = [
    ("eta", LOSSES, [0.0, -1.0, float("nan"), float("inf"), 1e-300, "1", True, None]),
    ("temperature", FUNCTIONS, [0.0, -0.5, float("nan"), float("-inf"), 1e-320, [1.0], np.bool_(False)]),
    ("group_size", SEQ, [0, -2, 2.0, "2", True]),
    ("reduction", LOSSES, ["avg", None, 1]),
    ("backend", FUNCTIONS, ["gpu", 3, None]),
    ("beta", SEQ, [-1.0, float("nan"), "0.1", True]),
    ("score_eps", LOSSES, [-1e-6, float("nan"), float("inf"), 1e-300, 1e39, "0", True, None]),
    ("length_normalize", SEQ, [1, "yes", None]),
    ("ignore_index", LABELLED, [1.5, -100.0, "x", None]),
    ("chunk_size", LINEAR[:1] + LINEAR[2:], [0, -1, 2.5, "8"]),
    ("anchor", LOSSES, [1, "yes", None]),
    ("validate", FUNCTIONS, [0, "no"]),
    ("return_aux", LOSSES, [1, None]),
]
NUMPY_SCALARS = [
    ("eta", LOSSES, [np.float32(0.5), np.float64(2.0), np.int64(1)]),
    ("temperature", FUNCTIONS, [np.float32(0.7), np.float16(1.5), np.int32(2)]),
    ("group_size", SEQ, None),  # np.int64 of the group size
    ("beta", SEQ, [np.float32(0.0)]),
    ("score_eps", LOSSES, [np.float32(1e-6), np.float64(0.0), np.int64(0)]),
    ("ignore_index", LABELLED, [np.int64(-100), np.int16(-100)]),
    ("chunk_size", LINEAR[:1] + LINEAR[2:], [np.int64(3), np.uint8(1)]),
]


@st.composite
def fuzz_cases(draw):
    fn = draw(st.sampled_from(FUNCTIONS))
    k = draw(st.integers(1, 3))
    args, kwargs = _base_call(fn, draw(st.integers(1, 3)), k, draw(st.integers(1, 4)), draw(st.integers(2, 9)),
                              draw(st.integers(1, 4)), draw(st.integers(0, 2 ** 16)), draw(st.sampled_from(BACKENDS)))
    kind = draw(st.sampled_from(["valid", "shape", "ndim", "dtype", "meta", "not_tensor", "id_range", "nonfinite",
                                 "bad_scalar", "numpy_scalar", "neg_inf"]))
    # Any other exception (a crash) fails the test as it propagates.
    tensors = [name for name in args]
    expect = "finite"
    if kind in ("shape", "ndim", "dtype", "meta", "not_tensor"):
        name = draw(st.sampled_from(tensors))
        x = args[name]
        expect = name
        if kind == "shape":
            dim = draw(st.integers(0, x.dim() - 1))
            x = x.narrow(dim, 0, x.shape[dim] - 1) if x.shape[dim] > 1 else torch.cat([x, x], dim)
            vocab_dim = (name == "logits" and dim == x.dim() - 1) or (name == "weight" and dim == 0)
            if vocab_dim:  # another vocabulary size is valid, or an id falls outside it
                expect = "any"
        elif kind == "ndim":
            x = x.unsqueeze(0) if draw(st.booleans()) or x.dim() == 1 else x.reshape(-1)
        elif kind == "dtype":
            floating = x.dtype.is_floating_point
            x = x.to(draw(st.sampled_from([torch.int64, torch.bool, torch.complex64] if floating else
                                          [torch.float32, torch.bool, torch.complex64])))
            if name == "scores" and x.dtype == torch.int64:
                expect = "finite"  # integer rewards are rewards
        elif kind == "meta":
            x = x.to("meta")
        else:
            x = x.tolist()
        args[name] = x
    elif kind == "id_range":
        name = "labels" if "labels" in args else "candidates"
        ids = args[name].clone()
        v = args["logits"].shape[-1] if "logits" in args else args["weight"].shape[0]
        ids.view(-1)[0] = draw(st.sampled_from([v, v + 7, -5, -1]))  # position 0 always counts
        args[name] = ids
        expect = name
    elif kind == "nonfinite":
        floats = [n for n in tensors if args[n].dtype.is_floating_point]
        optional = (["old_logprobs", "ref_logprobs"] if fn in SEQ else []) + (["bias"] if fn in LINEAR else [])
        name = draw(st.sampled_from(floats + optional))
        value = draw(st.sampled_from([float("nan"), float("inf")]))
        token_level = "candidates" in args
        if name in ("old_logprobs", "ref_logprobs"):
            x = torch.randn(args["labels"].shape) - 3
            x[0, 0] = value
            if name == "ref_logprobs":
                kwargs["beta"] = 0.1
            kwargs[name] = x
            expect = name
        elif name == "scores":
            args[name] = args[name].clone()
            args[name].view(-1)[0] = value
            expect = "scores"
        elif name == "bias":
            v = args["weight"].shape[0]
            kwargs["bias"] = torch.zeros(v)
            column = int(args["candidates"][0, 0]) if token_level else draw(st.integers(0, v - 1))
            kwargs["bias"][column] = value
            expect = "nonfinite"  # every row reads the column (a candidate's, at token level)
        else:  # an activation, at a position the result reads
            x = args[name].clone()
            if name == "weight":
                x[int(args["candidates"][0, 0]) if token_level else 0, 0] = value
                # +inf * h can be -inf: a masked entry, and a finite result
                expect = "nonfinite" if value != value else "result"
            elif token_level:
                x[0, int(args["candidates"][0, 0]) if name == "logits" else 0] = value
                expect = "nonfinite"
            else:
                x[0, 0, 0] = value  # token 0 of completion 0 always counts
                expect = "nonfinite"
            args[name] = x
    elif kind in ("bad_scalar", "numpy_scalar"):
        table = BAD_SCALARS if kind == "bad_scalar" else NUMPY_SCALARS
        options = [(n, vals) for n, fns, vals in table if fn in fns]
        name, values = draw(st.sampled_from(options))
        kwargs[name] = np.int64(kwargs["group_size"]) if values is None else draw(st.sampled_from(values))
        expect = name if kind == "bad_scalar" else "finite"
    else:  # -inf logits / bias entries away from the label are a masked vocabulary: finite
        if "logits" in args and "labels" in args:
            x = args["logits"].clone()
            labels = args["labels"]
            mask = torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) < 0.3
            mask.scatter_(-1, labels.clamp(min=0).unsqueeze(-1), False)
            args["logits"] = x.masked_fill(mask, float("-inf"))
        expect = "finite"
    return fn, args, kwargs, expect, kind


@pytest.mark.skipif(not BACKENDS, reason="no CPU backend")
@FUZZ
@given(fuzz_cases())
def test_fuzz_every_public_function(case):
    fn, args, kwargs, expect, kind = case
    try:
        result = _call(fn, args, kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        assert expect not in ("finite", "nonfinite"), f"{kind}: {fn} raised {exc!r} on a valid call"
        assert expect != "result", f"{kind}: {fn} raised {exc!r} (a result was expected)"
        if expect != "any":
            assert expect in message, f"{kind}: {fn}'s error does not name {expect!r}: {message}"
        return
    assert expect in ("finite", "nonfinite", "any", "result"), f"{kind}: {fn} accepted a broken {expect!r}"
    outputs = _outputs(result)
    finite = all(bool(torch.isfinite(o).all()) for o in outputs)
    if expect == "finite":
        assert finite, f"{kind}: {fn} returned non-finite values from finite inputs: {outputs}"
    elif expect == "nonfinite":
        assert not finite, f"{kind}: {fn} swallowed a NaN/inf input into finite outputs"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some of torch's lazy module objects warns
        warnings.simplefilter("ignore")
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


@pytest.mark.skipif(not BACKENDS, reason="no CPU backend")
def test_repeated_calls_do_not_grow_memory():
    """Forward + backward of every public function, 30 times after a warm-up, on inputs of 1 MiB of
    logits: no Python-visible tensor survives a call, and resident memory grows by less than
    16 MiB (a leak of one logits-sized buffer per call would add 30 MiB)."""
    try:
        _rss_bytes()
    except OSError:
        pytest.skip("/proc/self/statm is not readable")
    calls = []
    for fn in FUNCTIONS:
        args, kwargs = _base_call(fn, 4, 2, 8, 4096, 32, 0, BACKENDS[-1])  # 64 rows x 4096: 1 MiB
        for name in ("logits", "hidden", "weight"):
            if name in args:
                args[name] = args[name].requires_grad_(True)
        calls.append((fn, args, kwargs))

    def run_all():
        for fn, args, kwargs in calls:
            out = _outputs(_call(fn, args, kwargs))
            sum(o.float().sum() for o in out).backward()
            for x in args.values():
                x.grad = None

    for _ in range(3):
        run_all()
    tensors, rss = _live_tensors(), _rss_bytes()
    for _ in range(30):
        run_all()
    assert _live_tensors() <= tensors
    assert _rss_bytes() - rss < 16 << 20
