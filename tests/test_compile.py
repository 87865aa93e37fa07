"""torch.compile(fullgraph=True) traces a training step through every public path without graph
breaks (the kernels are custom ops with fake implementations), and gives the eager results."""

import pathlib

import pytest
import torch

import tpo_kernels
from tpo_kernels.group_math import GroupRule
from tpo_kernels.ops import RowRequest

from _backends import backend_available, backend_params, needs_triton

N, T, H, V, K = 4, 6, 16, 50, 2
COMPILE_BACKENDS = backend_params("torch", "cpu")
_native_mark = pytest.mark.skipif(not backend_available("cpu"), reason="cpu backend: not built")


def _model_and_batch():
    gen = torch.Generator().manual_seed(0)
    embedding, lm_head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(V, H, generator=gen))
        lm_head.weight.copy_(torch.randn(V, H, generator=gen) / H**0.5)
    tokens = torch.randint(0, V, (N, T), generator=gen)
    labels = torch.randint(0, V, (N, T), generator=gen)
    labels[:, 4:] = -100
    scores = torch.randn(N, generator=gen)
    candidates = torch.randint(0, V, (N * T, 3), generator=gen)
    return embedding, lm_head, tokens, labels, scores, candidates


def _step(backend, embedding, lm_head, tokens, labels, scores, candidates):
    """One loss through each path, summed; validate=False: no read-back to the host."""
    hidden = embedding(tokens)
    logits = lm_head(hidden)
    common = dict(group_size=K, backend=backend, validate=False)
    loss = tpo_kernels.tpo_loss(logits, labels, scores, **common)
    log_weights = torch.tensor([0.0, -1.0, float("-inf"), 0.5], dtype=torch.float64)  # w = 0 masked in the op
    loss = loss + tpo_kernels.fused_linear_tpo_loss(hidden, lm_head.weight, labels, scores,
                                                    seq_log_weights=log_weights, **common)
    loss = loss + 0.01 * tpo_kernels.selective_logprobs(logits, labels, backend=backend, validate=False).sum()
    cand_scores = torch.arange(3.0).expand(N * T, 3)
    flat_hidden = hidden.reshape(-1, H)
    loss = loss + tpo_kernels.fused_linear_token_tpo_loss(flat_hidden, lm_head.weight, candidates, cand_scores,
                                                          backend=backend, validate=False)
    loss = loss + tpo_kernels.token_tpo_loss(logits.reshape(-1, V), candidates, cand_scores, backend=backend,
                                             validate=False)
    return loss


def _loss_and_grads(fn, embedding, lm_head):
    loss = fn()
    return loss.detach(), torch.autograd.grad(loss, [embedding.weight, lm_head.weight])


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_fullgraph_compile_matches_eager(backend):
    embedding, lm_head, *batch = _model_and_batch()
    eager = _loss_and_grads(lambda: _step(backend, embedding, lm_head, *batch), embedding, lm_head)
    torch._dynamo.reset()
    compiled_step = torch.compile(lambda: _step(backend, embedding, lm_head, *batch), fullgraph=True,
                                  backend="aot_eager")
    compiled = _loss_and_grads(compiled_step, embedding, lm_head)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
    for got, want in zip(compiled[1], eager[1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_inductor_compile_matches_eager():
    """The default compiler (inductor) on the cpu backend's custom ops."""
    backend = "cpu" if backend_available("cpu") else "torch"
    embedding, lm_head, *batch = _model_and_batch()
    eager = _loss_and_grads(lambda: _step(backend, embedding, lm_head, *batch), embedding, lm_head)
    torch._dynamo.reset()
    compiled_step = torch.compile(lambda: _step(backend, embedding, lm_head, *batch), fullgraph=True)
    compiled = _loss_and_grads(compiled_step, embedding, lm_head)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-6)
    for got, want in zip(compiled[1], eager[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["logprobs", "linear_logprobs", "group_targets", "candidate_logits",
                                "linear_candidate_logits"])
def test_custom_ops_pass_opcheck(op):
    """torch.library.opcheck: schema, fake implementation and autograd registration agree."""
    embedding, lm_head, tokens, labels, scores, candidates = _model_and_batch()
    hidden = embedding(tokens).detach().reshape(-1, H).requires_grad_()
    weight = lm_head.weight.detach().clone().requires_grad_()
    flat_labels = labels.reshape(-1)
    flat_labels = torch.where(flat_labels >= 0, flat_labels, -1)
    logits = (hidden @ weight.T).detach().requires_grad_()
    if op == "logprobs":
        args = (logits, flat_labels, RowRequest(token_fields=("entropy",)).to_op(), False, "torch")
    elif op == "linear_logprobs":
        args = (hidden, weight, None, flat_labels, RowRequest(token_fields=("entropy",)).to_op(), 8, 4, 1 << 20,
                torch.float32, "torch")
    elif op == "group_targets":
        from tpo_kernels.group_math import build_layout
        from tpo_kernels.ops.group import layout_op_args

        layout = build_layout(N * T, hidden.device, padded_shape=(N, T), group_size=K)
        token_lp = (-torch.rand(N * T)).requires_grad_()
        log_weights = torch.linspace(-1.0, 1.0, N, dtype=torch.float64)  # seq_log_weights
        args = (token_lp, *layout_op_args(layout), scores, None, log_weights, GroupRule(score_eps=1e-6).to_op(),
                "torch")
    elif op == "candidate_logits":
        args = (logits, candidates, 1.0, "torch")
    else:
        args = (hidden, weight, None, candidates, 1.0, "torch")
    torch.library.opcheck(getattr(torch.ops.tpo_kernels, op).default, args)


# ----------------------------------------------------------------------------------------------
# torch.compile as the first tpo_kernels call of a process: each case in a fresh interpreter, so
# that no eager call has loaded a backend (backends load on first use) before Dynamo traces.
# ----------------------------------------------------------------------------------------------

_FRESH_STEP = """
import sys, torch, tpo_kernels
backend, eager_first = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
V, K, H = 40, 2, 8
lm_head = torch.nn.Linear(H, V, bias=False)
hidden = torch.randn(4, 5, H)
labels = torch.randint(0, V, (4, 5))
scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
if eager_first != "none":  # an eager call that loads another backend first
    tpo_kernels.tpo_loss(lm_head(hidden), labels, scores, group_size=K, backend=eager_first)

def step():
    loss = tpo_kernels.tpo_loss(lm_head(hidden), labels, scores, group_size=K, backend=backend, validate=False)
    return loss + tpo_kernels.fused_linear_tpo_loss(hidden, lm_head.weight, labels, scores, group_size=K,
                                                    backend=backend, validate=False)

compiled = torch.compile(step, fullgraph=True, backend="aot_eager")()
compiled.backward()
eager = step()
torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
print("OK", float(compiled))
"""


def _run_fresh(*args, script=_FRESH_STEP, env_extra=None):
    import os
    import subprocess
    import sys

    env = dict(os.environ, **(env_extra or {}))  # the child imports the tpo_kernels this test imported
    package_parent = str(pathlib.Path(tpo_kernels.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.mark.parametrize("backend", [pytest.param("auto", marks=pytest.mark.quick)]
                         + backend_params("torch", "cpu", "triton"))
def test_compile_as_the_first_call_of_a_fresh_process(backend):
    result = _run_fresh(backend, "none")
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("backend,eager_first", [pytest.param("torch", "cpu", marks=_native_mark, id="cpu_then_torch"),
                                                 pytest.param("cpu", "torch", marks=_native_mark, id="torch_then_cpu")])
def test_compile_after_an_eager_call_loaded_another_backend(backend, eager_first):
    result = _run_fresh(backend, eager_first)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# Dynamic shapes: compile(dynamic=True) over several (N, T), and mark_dynamic on the batch or the
# time dimension, through every public function, in a fresh process per case. Validation stays
# symbolic (no size is formatted or read back with validate=False), so one graph serves every
# shape (a second may come from a size guard of PyTorch's own, e.g. for N < 4).
# ----------------------------------------------------------------------------------------------

_DYNAMIC_STEPS = """
import sys, torch, tpo_kernels
from torch._dynamo.utils import counters
backend, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
V, K, H, C = 40, 2, 8, 3
lm_head = torch.nn.Linear(H, V, bias=False)

def step(hidden, labels, scores, candidates, candidate_scores, old_seq_logprobs):
    logits = lm_head(hidden)
    common = dict(backend=backend, validate=False)
    token_logprobs = tpo_kernels.selective_logprobs(logits, labels, **common)
    loss = 0.01 * token_logprobs.sum()
    loss = loss + tpo_kernels.tpo_loss(logits, labels, scores, group_size=K, **common)
    loss = loss + tpo_kernels.fused_linear_tpo_loss(hidden, lm_head.weight, labels, scores, group_size=K, **common)
    loss = loss + tpo_kernels.tpo_loss_from_logprobs(token_logprobs, scores, mask=labels != -100, group_size=K,
                                                     old_logprobs=old_seq_logprobs, **common)
    flat_hidden = hidden.reshape(-1, H)
    loss = loss + tpo_kernels.token_tpo_loss(lm_head(flat_hidden), candidates, candidate_scores, **common)
    return loss + tpo_kernels.fused_linear_token_tpo_loss(flat_hidden, lm_head.weight, candidates,
                                                          candidate_scores, **common)

compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True if mode == "dynamic" else None)
shapes = {"dynamic": [(4, 5), (6, 7), (2, 3), (10, 9), (6, 4)],
          "mark_batch": [(4, 5), (6, 5), (8, 5), (10, 5)],
          "mark_time": [(4, 5), (4, 7), (4, 3), (4, 9)]}[mode]
for N, T in shapes:
    hidden = torch.randn(N, T, H)
    labels = torch.randint(0, V, (N, T))
    labels[:, -1] = -100
    scores = torch.randn(N)
    candidates = torch.randint(0, V, (N * T, C))
    candidate_scores = torch.randn(N * T, C)
    args = (hidden, labels, scores, candidates, candidate_scores, torch.randn(N))
    marked = {"mark_batch": [(x, 0) for x in args],  # token-level rows are N * T
              "mark_time": [(hidden, 1), (labels, 1), (candidates, 0), (candidate_scores, 0)]}.get(mode, [])
    for tensor, dim in marked:
        torch._dynamo.mark_dynamic(tensor, dim)
    got = compiled(*args)
    got.backward()
    torch.testing.assert_close(got, step(*args), rtol=1e-5, atol=1e-5)
print("GRAPHS", counters["stats"]["unique_graphs"], "SHAPES", len(shapes))
"""


@pytest.mark.parametrize("backend,mode", [
    *[("torch", mode) for mode in ("dynamic", "mark_batch", "mark_time")],
    *[pytest.param("cpu", mode, marks=_native_mark) for mode in ("dynamic", "mark_batch", "mark_time")],
    *[pytest.param("triton", mode, marks=needs_triton) for mode in ("dynamic", "mark_time")],
])
def test_dynamic_shapes_compile_at_most_two_graphs(backend, mode):
    result = _run_fresh(backend, mode, script=_DYNAMIC_STEPS)
    assert result.returncode == 0 and "GRAPHS" in result.stdout, result.stderr[-3000:]
    graphs, shapes = (int(word) for word in result.stdout.split()[1::2])
    assert shapes >= 4 and graphs <= 2, result.stdout


# ----------------------------------------------------------------------------------------------
# What cannot be one graph says so: value checks (validate=True) and distributed calls.
# ----------------------------------------------------------------------------------------------

def _every_public_call(validate, **extra):
    """``{function name: zero-argument call}`` of every public function on a tiny batch."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(N, T, V, generator=gen)
    hidden, weight = torch.randn(N, T, H, generator=gen), torch.randn(V, H, generator=gen)
    labels = torch.randint(0, V, (N, T), generator=gen)
    scores = torch.randn(N, generator=gen)
    candidates = torch.randint(0, V, (N, 3), generator=gen)
    cand_scores = torch.randn(N, 3, generator=gen)
    common = dict(validate=validate, backend="torch", **extra)
    return {
        "tpo_loss": lambda: tpo_kernels.tpo_loss(logits, labels, scores, group_size=K, **common),
        "fused_linear_tpo_loss": lambda: tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores,
                                                                           group_size=K, **common),
        "tpo_loss_from_logprobs": lambda: tpo_kernels.tpo_loss_from_logprobs(-logits[..., 0].abs(), scores,
                                                                             group_size=K, **common),
        "selective_logprobs": lambda: tpo_kernels.selective_logprobs(logits, labels, **common).sum(),
        "fused_linear_logprobs": lambda: tpo_kernels.fused_linear_logprobs(hidden, weight, labels, **common).sum(),
        "token_tpo_loss": lambda: tpo_kernels.token_tpo_loss(logits[:, 0], candidates, cand_scores, **common),
        "fused_linear_token_tpo_loss": lambda: tpo_kernels.fused_linear_token_tpo_loss(
            hidden[:, 0], weight, candidates, cand_scores, **common),
    }


PUBLIC_FUNCTIONS = sorted(_every_public_call(True))


@pytest.mark.parametrize("function", PUBLIC_FUNCTIONS)
def test_fullgraph_with_validate_raises_one_error_naming_validate_false(function):
    """Dynamo would stop at the value checks' read-back with "Tensor.tolist() with non-integer
    tensor"; the call says instead what to pass."""
    call = _every_public_call(True)[function]
    torch._dynamo.reset()
    with pytest.raises(Exception) as caught:
        torch.compile(call, fullgraph=True, backend="aot_eager")()
    first_line = str(caught.value).splitlines()[0]
    assert first_line.startswith(f"RuntimeError: {function} with validate=True cannot be traced into one graph"), \
        first_line
    assert "Pass validate=False under torch.compile(fullgraph=True)" in first_line


def test_compile_without_fullgraph_still_validates():
    """Without fullgraph the value checks run eagerly between graphs: the result is the eager one,
    and a bad label is still refused with the eager error."""
    calls = _every_public_call(True)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(calls["tpo_loss"], backend="aot_eager")(), calls["tpo_loss"]())
    bad = torch.randint(0, V, (N, T))
    bad[0, 0] = V + 4

    def bad_call():
        return tpo_kernels.tpo_loss(torch.randn(N, T, V), bad, torch.randn(N), group_size=K, backend="torch")

    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"labels must hold ids in \[0, 50\)"):
        torch.compile(bad_call, backend="aot_eager")()


def test_fullgraph_with_validate_false_is_unaffected():
    calls = _every_public_call(False)
    for function in PUBLIC_FUNCTIONS:
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(calls[function], fullgraph=True, backend="aot_eager")(),
                                   calls[function](), msg=function)


_DISTRIBUTED_FULLGRAPH = """
import os, sys, torch, torch.distributed as dist, tpo_kernels
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
N, T, H, V, K = 4, 3, 8, 11, 2
hidden, weight = torch.randn(N, T, H), torch.randn(V, H)
labels, scores = torch.randint(0, V, (N, T)), torch.randn(N)
keyword = sys.argv[2]
step = lambda: tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores, group_size=K, validate=False,
                                                 **{keyword: dist.group.WORLD})
try:
    torch.compile(step, fullgraph=True, backend="aot_eager")()
    print("NO ERROR")
except Exception as error:
    print("ERROR", str(error).splitlines()[0])
dist.destroy_process_group()
"""


@pytest.mark.parametrize("keyword", ["process_group", "vocab_parallel_group"])
def test_fullgraph_distributed_call_says_distributed_calls_run_eagerly(keyword):
    """A one-rank gloo group in a fresh process (this one keeps no process group)."""
    from _distributed import free_port, loopback_env

    result = _run_fresh(str(free_port()), keyword, script=_DISTRIBUTED_FULLGRAPH, env_extra=loopback_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"ERROR RuntimeError: fused_linear_tpo_loss with {keyword} cannot be traced into one graph: "
            f"distributed calls run eagerly") in result.stdout, result.stdout + result.stderr[-2000:]
