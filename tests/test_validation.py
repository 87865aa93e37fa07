"""Every bad input to a public function raises a ValueError/TypeError that names the argument,
before any kernel runs: one section per public function (tpo_loss, selective_logprobs,
fused_linear_tpo_loss, fused_linear_logprobs, token_tpo_loss, fused_linear_token_tpo_loss).
The compiled extensions' own pointer-boundary checks are tested with the extensions
(test_cpu_extension.py, test_cuda_extension.py)."""

import pytest
import torch

import tpo_kernels

from _batches import make_batch

_DROP = object()
N, T, V = 4, 5, 37
H = 16

# ----------------------------------------------------------------------------------------------
# tpo_loss
# ----------------------------------------------------------------------------------------------

BAD_INPUTS = [
    ("logits", TypeError, dict(logits=torch.zeros(N, T, V, dtype=torch.int64))),
    ("logits", ValueError, dict(logits=torch.zeros(N, T, 1, V))),
    ("logits", TypeError, dict(logits=[[0.0]])),
    ("labels", ValueError, dict(labels=torch.zeros(N, T + 1, dtype=torch.int64))),
    ("labels", TypeError, dict(labels=torch.zeros(N, T))),
    ("labels", ValueError, dict(labels=torch.full((N, T), V, dtype=torch.int64))),
    ("labels", ValueError, dict(labels=torch.full((N, T), -5, dtype=torch.int64))),
    ("group_size", ValueError, dict(group_size=3)),
    ("group_size", ValueError, dict(group_size=0)),
    ("group_size", TypeError, dict(group_size=2.0)),
    ("group_size", ValueError, dict(group_size=_DROP)),
    ("group_size", ValueError, dict(group_ids=torch.zeros(N, dtype=torch.int64))),
    ("group_ids", ValueError, dict(group_size=_DROP, group_ids=torch.zeros(N + 1, dtype=torch.int64))),
    ("group_ids", TypeError, dict(group_size=_DROP, group_ids=torch.zeros(N))),
    ("scores", ValueError, dict(scores=torch.tensor([0.0, float("nan"), 1.0, 2.0]))),
    ("scores", ValueError, dict(scores=torch.tensor([0.0, float("inf"), 1.0, 2.0]))),
    ("scores", ValueError, dict(scores=torch.zeros(N + 1))),
    ("eta", ValueError, dict(eta=0.0)),
    ("eta", ValueError, dict(eta=-1.0)),
    ("eta", TypeError, dict(eta="1")),
    ("temperature", ValueError, dict(temperature=0.0)),
    ("temperature", ValueError, dict(temperature=float("inf"))),
    ("reduction", ValueError, dict(reduction="avg")),
    ("beta", ValueError, dict(beta=-0.1)),
    ("ref_logprobs", ValueError, dict(beta=0.1)),
    ("ref_logprobs", ValueError, dict(beta=0.1, ref_logprobs=torch.zeros(N))),
    ("old_logprobs", ValueError, dict(old_logprobs=torch.zeros(N, T + 1))),
    ("old_logprobs", TypeError, dict(old_logprobs=torch.zeros(N, dtype=torch.int64))),
    ("mask", ValueError, dict(mask=torch.ones(N, T + 1))),
    ("mask", ValueError, dict(mask=torch.full((N, T), 2))),
    ("cu_seqlens", ValueError, dict(cu_seqlens=torch.tensor([0, 1, 2, 3, 4]))),
    ("anchor", TypeError, dict(anchor=1)),
    ("backend", ValueError, dict(backend="jax")),
    # beyond the types' usable ranges (tests/test_argument_ranges.py: every type, every keyword)
    ("group_size", ValueError, dict(group_size=2 ** 63)),
    ("ignore_index", ValueError, dict(ignore_index=2 ** 64 + 2)),
    ("eta", ValueError, dict(eta=10 ** 400)),
    ("beta", ValueError, dict(beta=1e39, ref_logprobs=-torch.rand(N, T))),
    ("entropy_coef", ValueError, dict(entropy_coef=1e39)),
    ("reduction", TypeError, dict(reduction=1)),
    ("ref_logprobs", ValueError, dict(beta=0.1, ref_logprobs=torch.rand(N, T) + 1)),
]


@pytest.mark.parametrize("argument,error,overrides", BAD_INPUTS, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(argument, error, overrides):
    labels = torch.randint(0, V, (N, T))  # all counted, so only the override is wrong
    args = dict(logits=torch.randn(N, T, V), labels=labels, scores=torch.randn(N), group_size=2)
    args.update(overrides)
    for key in [k for k, v in overrides.items() if v is _DROP]:
        del args[key]
    with pytest.raises(error, match=argument):
        tpo_kernels.tpo_loss(args.pop("logits"), args.pop("labels"), args.pop("scores"), **{"backend": "torch", **args})


def test_a_batch_without_any_counted_token_is_rejected():
    # One completion without counted tokens is left out of its group (tests/test_empty_completions.py);
    # a batch with none at all has no loss to compute.
    labels = torch.full((N, T), -100)
    with pytest.raises(ValueError, match="no completion has a counted token"):
        tpo_kernels.tpo_loss(torch.randn(N, T, V), labels, torch.randn(N), group_size=2)


def test_packed_inputs_need_cu_seqlens():
    with pytest.raises(ValueError, match="cu_seqlens"):
        tpo_kernels.tpo_loss(torch.randn(10, V), torch.randint(0, V, (10,)), torch.randn(2), group_size=2)


@pytest.mark.parametrize("cu", [[1, 4, 10], [0, 6, 4], [0, 4, 11]])
def test_malformed_cu_seqlens_are_rejected(cu):
    with pytest.raises(ValueError, match="cu_seqlens"):
        tpo_kernels.tpo_loss(torch.randn(10, V), torch.randint(0, V, (10,)), torch.randn(2), group_size=2,
                             cu_seqlens=torch.tensor(cu))


def test_labels_under_the_mask_are_not_range_checked():
    labels = torch.randint(0, V, (N, T))
    labels[:, -1] = V + 100  # out of range but masked out
    mask = torch.ones(N, T, dtype=torch.bool)
    mask[:, -1] = False
    loss = tpo_kernels.tpo_loss(torch.randn(N, T, V), labels, torch.randn(N), group_size=2, mask=mask)
    assert torch.isfinite(loss)


def test_unusable_backend_explains_why():
    status = tpo_kernels.backend_status()
    unusable = [name for name, s in status.items() if s != "available"]
    if not unusable:
        pytest.skip("every backend is usable here")
    with pytest.raises((RuntimeError, ValueError), match=unusable[0]):
        tpo_kernels.tpo_loss(torch.randn(N, T, V), torch.randint(0, V, (N, T)), torch.randn(N), group_size=2,
                             backend=unusable[0])


# ----------------------------------------------------------------------------------------------
# selective_logprobs
# ----------------------------------------------------------------------------------------------


def test_selective_logprobs_rejects_out_of_range_labels():
    with pytest.raises(ValueError, match="labels"):
        tpo_kernels.selective_logprobs(torch.randn(3, V), torch.tensor([0, V, 1]))


def test_selective_logprobs_rejects_bad_temperature():
    with pytest.raises(ValueError, match="temperature"):
        tpo_kernels.selective_logprobs(torch.randn(3, V), torch.tensor([0, 1, 2]), temperature=-1.0)


# ----------------------------------------------------------------------------------------------
# fused_linear_tpo_loss
# ----------------------------------------------------------------------------------------------

_HIDDEN = torch.randn(N, T, H)
_WEIGHT = torch.randn(V, H)
_BIAS = torch.randn(V)
_LABELS = torch.randint(0, V, (N, T))


@pytest.mark.parametrize(
    "change, exc, match",
    [
        ({"weight": _WEIGHT[:, :-1]}, ValueError, "weight must have shape"),
        ({"weight": _WEIGHT.double()}, TypeError, "bias must have the dtype of weight"),  # mixed dtypes are fine; the bias follows the weight
        ({"bias": _BIAS[:-1]}, ValueError, "bias must have shape"),
        ({"bias": _BIAS.double()}, TypeError, "bias must have the dtype"),
        ({"hidden": _HIDDEN[0, 0]}, ValueError, "hidden must be 2-D or 3-D"),
        ({"labels": _LABELS[:, :-1]}, ValueError, "labels must have shape"),
        ({"labels": torch.full_like(_LABELS, V)}, ValueError, r"labels must hold ids in \[0, 37\)"),
        ({"chunk_size": 0}, ValueError, r"chunk_size must be an int in \[1, 2\*\*63\)"),
        ({"chunk_size": 2.0}, TypeError, "chunk_size must be an int"),
        ({"grad_accum_dtype": torch.int32}, TypeError, "grad_accum_dtype"),
        ({"temperature": 0.0}, ValueError, "temperature"),
    ],
)
def test_fused_linear_tpo_loss_bad_input_names_the_argument(change, exc, match):
    args = {"hidden": _HIDDEN, "weight": _WEIGHT, "labels": _LABELS, "scores": torch.randn(N), "bias": _BIAS,
            "group_size": 2, **change}
    with pytest.raises(exc, match=match):
        tpo_kernels.fused_linear_tpo_loss(args.pop("hidden"), args.pop("weight"), args.pop("labels"),
                                          args.pop("scores"), **args)


# ----------------------------------------------------------------------------------------------
# fused_linear_logprobs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, exc, match",
    [
        ({"labels": _LABELS[:, :-1]}, ValueError, "labels must have shape"),
        ({"labels": _LABELS.float()}, TypeError, "labels must be an integer tensor"),
    ],
)
def test_fused_linear_logprobs_bad_input_names_the_argument(change, exc, match):
    args = {"hidden": _HIDDEN, "weight": _WEIGHT, "labels": _LABELS, **change}
    with pytest.raises(exc, match=match):
        tpo_kernels.fused_linear_logprobs(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


# ----------------------------------------------------------------------------------------------
# token_tpo_loss
# ----------------------------------------------------------------------------------------------

_LOGITS = torch.randn(3, 10)
_CANDS = torch.randint(0, 10, (3, 4))
_SCORES = torch.randn(3, 4)
_NAN_SCORES = _SCORES.index_fill(1, torch.tensor([1]), float("nan"))
# Inputs on the "meta" device stand in for inputs on a second device: the device checks run
# before any computation.


@pytest.mark.parametrize(
    "change, exc, match",
    [
        ({"logits": _LOGITS.long()}, TypeError, "logits must be float16"),
        ({"logits": _LOGITS[0]}, ValueError, "logits must be 2-D"),
        ({"candidates": _CANDS.float()}, TypeError, "candidates must be an integer"),
        ({"candidates": [[0]]}, TypeError, "candidates must be a torch.Tensor"),
        ({"candidates": _CANDS[:2]}, ValueError, r"candidates must have shape \[R, K\]"),
        ({"candidates": _CANDS[:, :0], "scores": _SCORES[:, :0]}, ValueError, "K >= 1"),
        ({"candidates": _CANDS + 10}, ValueError, r"token ids in \[0, 10\)"),
        ({"candidates": _CANDS - 11}, ValueError, r"token ids in \[0, 10\)"),
        ({"candidates": _CANDS.to("meta")}, ValueError, "candidates is on meta but logits is on cpu"),
        ({"scores": _SCORES[:, :3]}, ValueError, "scores must have the shape"),
        ({"scores": _SCORES > 0}, TypeError, "scores must be a real tensor"),
        ({"scores": _NAN_SCORES}, ValueError, "scores must be finite"),
        ({"scores": _SCORES.to("meta")}, ValueError, "scores is on meta but logits is on cpu"),
        ({"old_logprobs": torch.randn(3, 5)}, ValueError, "old_logprobs must have the shape"),
        ({"old_logprobs": torch.zeros(3, 4, dtype=torch.long)}, TypeError, "old_logprobs must be a float"),
        ({"old_logprobs": torch.full((3, 4), float("-inf"))}, ValueError, "old_logprobs must be finite"),
        ({"eta": 0.0}, ValueError, "eta must be a finite number > 0"),
        ({"temperature": -1.0}, ValueError, "temperature must be a finite number > 0"),
        ({"temperature": "hot"}, TypeError, "temperature must be a number"),
        ({"reduction": "max"}, ValueError, "reduction must be one of"),
        ({"anchor": 1}, TypeError, "anchor must be a bool"),
        ({"backend": "tpu"}, ValueError, "backend must be 'auto' or one of"),
        ({"logits": _LOGITS[:0], "candidates": _CANDS[:0], "scores": _SCORES[:0]}, ValueError, r"R == 0"),
    ],
)
def test_token_tpo_loss_bad_input_names_the_argument(change, exc, match):
    args = {"logits": _LOGITS, "candidates": _CANDS, "scores": _SCORES, **change}
    with pytest.raises(exc, match=match):
        tpo_kernels.token_tpo_loss(args.pop("logits"), args.pop("candidates"), args.pop("scores"), **args)


# ----------------------------------------------------------------------------------------------
# fused_linear_token_tpo_loss
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, exc, match",
    [
        ({"weight": torch.randn(10, 5)}, ValueError, r"weight must have shape \[V, H\] with H=6"),
        ({"weight": torch.randn(10, 6).double()}, TypeError, "weight must have the dtype of hidden"),
        ({"weight": torch.randn(10, 6, device="meta")}, ValueError, "weight is on meta but hidden is on cpu"),
        ({"bias": torch.randn(9)}, ValueError, r"bias must have shape \[V\]=\(10,\)"),
        ({"bias": torch.randn(10, dtype=torch.float64)}, TypeError, "bias must have the dtype of weight"),
        ({"hidden": torch.randn(3, 6, 1)}, ValueError, "hidden must be 2-D"),
        ({"candidates": torch.randint(0, 10, (4, 2))}, ValueError, r"R=3 \(the rows of hidden\)"),
        ({"candidates": torch.tensor([[0, 10], [1, 2], [3, 4]])}, ValueError, r"token ids in \[0, 10\)"),
        ({"scores": torch.tensor([[0, float("inf")], [1, 2], [3, 4]])}, ValueError, "scores must be finite"),
    ],
)
def test_fused_linear_token_tpo_loss_bad_input_names_the_argument(change, exc, match):
    args = {
        "hidden": torch.randn(3, 6),
        "weight": torch.randn(10, 6),
        "candidates": torch.randint(0, 10, (3, 2)),
        "scores": torch.randn(3, 2),
        "bias": torch.randn(10),
    }
    args.update(change)
    with pytest.raises(exc, match=match):
        tpo_kernels.fused_linear_token_tpo_loss(
            args["hidden"], args["weight"], args["candidates"], args["scores"], bias=args["bias"]
        )


# ----------------------------------------------------------------------------- loss settings and heads


def test_return_entropy_needs_return_aux():
    logits, labels, scores, kwargs = make_batch()
    with pytest.raises(ValueError, match="return_entropy"):
        tpo_kernels.tpo_loss(logits, labels, scores, return_entropy=True, **kwargs)


def test_fused_linear_bias_must_have_the_weight_dtype():
    _, labels, scores, kwargs = make_batch()
    hidden = torch.randn(*labels.shape, 16).bfloat16()
    weight, bias = torch.randn(37, 16), torch.randn(37).bfloat16()
    with pytest.raises(TypeError, match="bias"):
        tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores, bias=bias, **kwargs)


# ----------------------------------------------------------------------------- tpo_loss_from_logprobs


@pytest.mark.parametrize("bad, error", [
    (dict(logprobs=torch.zeros(4, 3, dtype=torch.int64)), TypeError),
    (dict(logprobs=torch.zeros(4, 3, 2)), ValueError),
    (dict(mask=torch.ones(4, 2)), ValueError),
])
def test_tpo_loss_from_logprobs_bad_input_names_the_argument(bad, error):
    args = {"logprobs": -torch.rand(4, 3), "mask": torch.ones(4, 3), **bad}
    name = next(iter(bad))
    with pytest.raises(error, match=name):
        tpo_kernels.tpo_loss_from_logprobs(args["logprobs"], torch.randn(4), mask=args["mask"], group_size=2)


# ----------------------------------------------------------------------------- logit_scale and logit_softcap


def _transform_calls():
    """Each public function that takes logits or an lm_head, as ``call(**transform_kwargs)``."""
    logits, labels, scores, kwargs = make_batch()
    hidden, weight = torch.randn(*labels.shape, 8), torch.randn(37, 8)
    candidates, cand_scores = torch.randint(0, 37, (4, 3)), torch.randn(4, 3)
    return {
        "tpo_loss": lambda **t: tpo_kernels.tpo_loss(logits, labels, scores, **kwargs, **t),
        "selective_logprobs": lambda **t: tpo_kernels.selective_logprobs(logits, labels, **t),
        "fused_linear_tpo_loss": lambda **t: tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores,
                                                                               **kwargs, **t),
        "fused_linear_logprobs": lambda **t: tpo_kernels.fused_linear_logprobs(hidden, weight, labels, **t),
        "token_tpo_loss": lambda **t: tpo_kernels.token_tpo_loss(logits[0], candidates, cand_scores, **t),
        "fused_linear_token_tpo_loss": lambda **t: tpo_kernels.fused_linear_token_tpo_loss(
            hidden[0], weight, candidates, cand_scores, **t),
    }


@pytest.mark.parametrize("function", list(_transform_calls()))
@pytest.mark.parametrize("bad, error, match", [
    (dict(logit_softcap=0.0), ValueError, "logit_softcap must be a finite number > 0"),
    (dict(logit_softcap=-30.0), ValueError, "logit_softcap must be a finite number > 0"),
    (dict(logit_softcap=float("inf")), ValueError, "logit_softcap must be a finite number > 0"),
    (dict(logit_softcap=float("nan")), ValueError, "logit_softcap must be a finite number > 0"),
    (dict(logit_softcap="30"), TypeError, "logit_softcap must be a number"),
    (dict(logit_softcap=1e39), ValueError, "logit_softcap must lie in"),
    (dict(logit_scale=0.0), ValueError, "logit_scale must be a finite number > 0"),
    (dict(logit_scale=-1.0), ValueError, "logit_scale must be a finite number > 0"),
    (dict(logit_scale=float("nan")), ValueError, "logit_scale must be a finite number > 0"),
    (dict(logit_scale=None), TypeError, "logit_scale must be a number"),
    (dict(logit_scale=1e30, temperature=1e-30), ValueError, "logit_scale / temperature must lie in"),
    (dict(logit_scale=1e-30, logit_softcap=1e30), ValueError, "logit_scale / logit_softcap must lie in"),
])
def test_logit_transform_bad_values_name_the_argument(function, bad, error, match):
    with pytest.raises(error, match=match):
        _transform_calls()[function](**bad)


# ----------------------------------------------------------------------------- trainer step benchmark CLI


@pytest.mark.parametrize("argv, match", [
    (["--variants", "eager,bogus"], "--variants"),
    (["--variants", ","], "--variants"),
    (["--group-size", "1"], "--group-size"),
    (["--reps", "0"], "--reps"),
    (["--vocab", "0"], "--vocab"),
])
def test_trainer_step_cli_bad_option_names_it(argv, match):
    from bench import trainer_step

    with pytest.raises(SystemExit, match=match):
        trainer_step.main(argv)


# ----------------------------------------------------------------------------- tpo-kernels bench CLI


@pytest.mark.parametrize("argv, match", [
    (["--case", "logitz"], "unknown case 'logitz'"),
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--case", "logits", "--variant", "sparse"], "--variant: unknown variant 'sparse'"),
])
def test_bench_cli_bad_option_names_it(argv, match, tmp_path):
    from tpo_kernels.bench import run

    with pytest.raises(SystemExit, match=match):
        run.main([*argv, "--device", "cpu", "--out", str(tmp_path), "--no-plots"])


# ----------------------------------------------------------------------------------------------
# logits_cache_bytes: the integers every other integer keyword takes, within an int64
# ----------------------------------------------------------------------------------------------

def _fused_with_cache(budget, function="fused_linear_tpo_loss"):
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(N, T, H, generator=gen), torch.randn(V, H, generator=gen)
    labels = torch.randint(0, V, (N, T), generator=gen)
    if function == "fused_linear_logprobs":
        return tpo_kernels.fused_linear_logprobs(hidden, weight, labels, logits_cache_bytes=budget)
    return tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, torch.randn(N, generator=gen), group_size=2,
                                             logits_cache_bytes=budget)


@pytest.mark.parametrize("function", ["fused_linear_tpo_loss", "fused_linear_logprobs"])
def test_numpy_logits_cache_bytes_is_accepted(function):
    import numpy as np

    for budget in (np.int64(1 << 20), np.uint32(1 << 20), np.int8(0)):
        torch.testing.assert_close(_fused_with_cache(budget, function), _fused_with_cache(int(budget), function),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("function", ["fused_linear_tpo_loss", "fused_linear_logprobs"])
@pytest.mark.parametrize("budget", [2 ** 63, 2 ** 64 + 5, -1])
def test_logits_cache_bytes_outside_int64_is_a_value_error_naming_it(function, budget):
    with pytest.raises(ValueError, match=r"logits_cache_bytes must be an int in \[0, 2\*\*63\)"):
        _fused_with_cache(budget, function)


@pytest.mark.parametrize("budget", [1.0, True, "1024"])
def test_logits_cache_bytes_of_another_type_is_a_type_error_naming_it(budget):
    with pytest.raises(TypeError, match="logits_cache_bytes must be an int"):
        _fused_with_cache(budget)
