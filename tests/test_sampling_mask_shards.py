"""``sampling_mask=`` (kept-set replay) with a vocabulary split over ranks: 2 and 3 gloo ranks.

The mask holds global vocabulary ids and is the same on every rank; each rank replays its part of
every kept set and the shards' summaries merge into the whole sets'. Against one process with the
whole vocabulary and the same mask: log-probs, entropies, the loss and every gradient (the logits
shard; hidden, the weight and bias shards) within 1e-12 in float64 and ``FP32_TOL`` in float32
(the shards' merge sums in another order than one row pass), on the logits path and the fused
head, for the CSR and the padded forms. The sets include a row kept entirely on the first shard,
one entirely on the last, and one whose label is on the last shard while its other ids are on the
first. Without validation a label outside its set is NaN at its token (as in one process); with
it, the same ValueError naming ``sampling_mask`` on every rank, as is a kept id beyond the
vocabulary. DTensor vocabulary shards take the same path. The collectives are those of an
unmasked shard (measured max error in float32: 1e-6).

One spawn of 3 ranks runs every case (process start-up dominates): the 2-rank cases on a subgroup.
"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch

from _distributed import run_ranks

V, HIDDEN, N, T = 11, 6, 4, 5  # V % 2 and V % 3 != 0: uneven shards
FP64_TOL = dict(atol=1e-12, rtol=1e-12)
FP32_TOL = dict(atol=2e-6, rtol=2e-5)


def _shards(world):
    """``[(start, stop)]`` of each rank: torch.tensor_split's uneven contiguous shards (DTensor's
    ``Shard`` splits like torch.chunk: the DTensor cases place themselves)."""
    parts = torch.arange(V).tensor_split(world)
    return [(int(p[0]), int(p[-1]) + 1) for p in parts]


def _problem(dtype, seed=0):
    """The whole problem, the same on every rank: logits, hidden states, head, labels, scores and
    kept sets (flat row-major lists) holding each counted label."""
    import tpo_kernels as tk

    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, T, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, HIDDEN, generator=gen, dtype=torch.float64)
    bias = torch.randn(V, generator=gen, dtype=torch.float64)
    logits = torch.randn(N, T, V, generator=gen, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (N, T), generator=gen)
    flat = labels.view(-1)
    sets = []
    for i in range(N * T):
        extra = torch.randperm(V, generator=gen)[: int(torch.randint(0, 5, (1,), generator=gen))]
        sets.append(sorted({int(flat[i]), *extra.tolist()}))
    flat[0], sets[0] = 1, [0, 1]  # kept entirely on the first shard
    flat[1], sets[1] = V - 1, [V - 2, V - 1]  # entirely on the last
    flat[2], sets[2] = V - 1, [0, 2, V - 1]  # label on the last shard, the rest on the first
    flat[3], sets[3] = 0, [0]  # one id: log-prob 0
    sets[4] = []  # an empty set does not count
    flat[5] = -100  # an ignored token: its set is not read
    scores = torch.randn(N, generator=gen, dtype=torch.float64)
    cast = lambda x: x.to(dtype)  # noqa: E731
    return dict(hidden=cast(hidden), weight=cast(weight), bias=cast(bias), logits=cast(logits), labels=labels,
                scores=scores, sets=sets, mask=tk.SamplingMask.from_lists(sets))


def _padded(sets, width=6):
    ids = torch.full((len(sets), width), -1, dtype=torch.int64)
    for i, s in enumerate(sets):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.int64)
    return ids.view(N, T, width)


def _leaf(x):
    return None if x is None else x.detach().clone().requires_grad_(True)


def _call(fn_name, path, inputs, vp, loss_kw):
    """``(outputs, leaves)``: the function's result on ``inputs`` (whole or shards) and its leaves."""
    import tpo_kernels as tk

    if path == "logits":
        leaves = dict(logits=_leaf(inputs["logits"]))
        if fn_name == "logprobs":
            out = tk.selective_logprobs(leaves["logits"], inputs["labels"], return_entropy=True, **loss_kw, **vp)
        else:
            out = tk.tpo_loss(leaves["logits"], inputs["labels"], inputs["scores"], group_size=2, **loss_kw, **vp)
    else:
        leaves = dict(hidden=_leaf(inputs["hidden"]), weight=_leaf(inputs["weight"]), bias=_leaf(inputs["bias"]))
        head = (leaves["hidden"], leaves["weight"], inputs["labels"])
        if fn_name == "logprobs":
            out = tk.fused_linear_logprobs(*head, bias=leaves["bias"], return_entropy=True, **loss_kw, **vp)
        else:
            out = tk.fused_linear_tpo_loss(*head, inputs["scores"], bias=leaves["bias"], group_size=2, **loss_kw, **vp)
    return out, leaves


def _objective(out, coefs):
    if isinstance(out, tuple):  # log-probs and entropies: a random linear functional of both
        return (out[0] * coefs[0]).sum() + (out[1] * coefs[1]).sum()
    return out


def replay_case(rank, world, group, *, fn_name, path, form, dtype, backend):
    """One function on the whole vocabulary and on this rank's shard, the same mask."""
    problem = _problem(dtype)
    start, stop = _shards(world)[rank]
    mask = problem["mask"] if form == "csr" else _padded(problem["sets"])
    loss_kw = dict(sampling_mask=mask, temperature=0.7, logit_scale=1.3, backend=backend)
    if fn_name == "loss":
        loss_kw["entropy_coef"] = 0.05  # the entropy's gradient joins the row backward
    whole = {k: problem[k] for k in ("logits", "hidden", "weight", "bias", "labels", "scores")}
    shard = dict(whole, logits=whole["logits"][..., start:stop], weight=whole["weight"][start:stop],
                 bias=whole["bias"][start:stop])
    gen = torch.Generator().manual_seed(7)
    coefs = (torch.randn(N, T, generator=gen, dtype=dtype), torch.randn(N, T, generator=gen, dtype=dtype))
    ref, ref_leaves = _call(fn_name, path, whole, {}, loss_kw)
    got, leaves = _call(fn_name, path, shard, dict(vocab_parallel_group=group), loss_kw)
    _objective(ref, coefs).backward()
    _objective(got, coefs).backward()
    pairs = {}
    if isinstance(got, tuple):
        pairs["logprobs"], pairs["entropy"] = (got[0].detach(), ref[0].detach()), (got[1].detach(), ref[1].detach())
    else:
        pairs["loss"] = (got.detach(), ref.detach())
    if path == "logits":
        pairs["grad_logits_shard"] = (leaves["logits"].grad, ref_leaves["logits"].grad[..., start:stop])
    else:
        pairs["grad_hidden"] = (leaves["hidden"].grad, ref_leaves["hidden"].grad)
        pairs["grad_weight_shard"] = (leaves["weight"].grad, ref_leaves["weight"].grad[start:stop])
        pairs["grad_bias_shard"] = (leaves["bias"].grad, ref_leaves["bias"].grad[start:stop])
    return {"pairs": pairs}


def dtensor_case(rank, world, group, *, path, dtype, backend):
    """Vocabulary-sharded DTensors (logits ``Shard(2)``; weight and bias ``Shard(0)``) with a mask."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import tpo_kernels as tk

    mesh = _MESH
    problem = _problem(dtype, seed=1)
    kw = dict(sampling_mask=problem["mask"], temperature=0.7, entropy_coef=0.05, group_size=2, backend=backend)
    labels, scores = problem["labels"], problem["scores"]
    if path == "logits":
        ref_leaf = _leaf(problem["logits"])
        dt = distribute_tensor(problem["logits"], mesh, [Shard(2)]).requires_grad_(True)
        ref, got = tk.tpo_loss(ref_leaf, labels, scores, **kw), tk.tpo_loss(dt, labels, scores, **kw)
        ref.backward()
        got.backward()
        pairs = {"grad_logits": (dt.grad.full_tensor(), ref_leaf.grad)}
    else:
        ref_h, ref_w, ref_b = (_leaf(problem[k]) for k in ("hidden", "weight", "bias"))
        h = _leaf(problem["hidden"])
        w, b = (distribute_tensor(problem[k], mesh, [Shard(0)]).requires_grad_(True) for k in ("weight", "bias"))
        ref = tk.fused_linear_tpo_loss(ref_h, ref_w, labels, scores, bias=ref_b, **kw)
        got = tk.fused_linear_tpo_loss(h, w, labels, scores, bias=b, **kw)
        ref.backward()
        got.backward()
        pairs = {"grad_hidden": (h.grad, ref_h.grad), "grad_weight": (w.grad.full_tensor(), ref_w.grad),
                 "grad_bias": (b.grad.full_tensor(), ref_b.grad)}
    pairs["loss"] = (got.detach(), ref.detach())
    return {"pairs": pairs}


def error_case(rank, world, group, *, path, fault):
    """A bad mask, the same on every rank: every rank raises the same ValueError (none hangs)."""
    import tpo_kernels as tk

    problem = _problem(torch.float32)
    start, stop = _shards(world)[rank]
    sets = [list(s) for s in problem["sets"]]
    if fault == "label_outside":  # token 2's label (on the last shard) is not in its set
        sets[2] = [0, 2]
    else:  # an id beyond the vocabulary (its bound is known only once the shards are placed)
        sets[6] = sets[6] + [V + 3]
    mask = tk.SamplingMask.from_lists(sets)
    vp = dict(vocab_parallel_group=group, sampling_mask=mask)
    try:
        if path == "logits":
            tk.tpo_loss(problem["logits"][..., start:stop], problem["labels"], problem["scores"], group_size=2, **vp)
        else:
            tk.fused_linear_logprobs(problem["hidden"], problem["weight"][start:stop], problem["labels"], **vp)
    except ValueError as error:
        return {"error_type": "ValueError", "message": str(error)}
    return {"error_type": None, "message": ""}


def unchecked_case(rank, world, group, *, path):
    """``validate=False``: a label outside its set gives NaN at that token on every rank, as in one
    process, whether or not the first shard holds any of its set; the other tokens are unchanged."""
    import tpo_kernels as tk

    problem = _problem(torch.float64)
    start, stop = _shards(world)[rank]
    sets = [list(s) for s in problem["sets"]]
    sets[1], sets[2] = [V - 2], [0, 2]  # token 1: its set on the last shard only; token 2: on the first
    mask = tk.SamplingMask.from_lists(sets)
    kw = dict(sampling_mask=mask, validate=False)
    if path == "logits":
        whole = tk.selective_logprobs(problem["logits"], problem["labels"], **kw)
        got = tk.selective_logprobs(problem["logits"][..., start:stop], problem["labels"], vocab_parallel_group=group,
                                    **kw)
    else:
        whole = tk.fused_linear_logprobs(problem["hidden"], problem["weight"], problem["labels"], **kw)
        got = tk.fused_linear_logprobs(problem["hidden"], problem["weight"][start:stop], problem["labels"],
                                       vocab_parallel_group=group, **kw)
    return {"pairs": {"logprobs": (got, whole)}}


def bytes_case(rank, world, group):
    """The collectives of a masked fused-head loss on a shard: the agreement record and the
    ``[4, M]`` fp32 partials forward, the ``[M, H]`` dH all-reduce backward, as without a mask."""
    import tpo_kernels as tk
    from tpo_kernels import distributed as tpo_dist

    problem = _problem(torch.float32)
    start, stop = _shards(world)[rank]
    h, w = _leaf(problem["hidden"]), _leaf(problem["weight"][start:stop])
    with tpo_dist.count_collectives() as forward:
        loss = tk.fused_linear_tpo_loss(h, w, problem["labels"], problem["scores"], group_size=2,
                                        sampling_mask=problem["mask"], vocab_parallel_group=group)
    with tpo_dist.count_collectives() as backward:
        loss.backward()
    return {"forward": [(r.op, r.purpose, r.payload_bytes) for r in forward],
            "backward": [(r.op, r.purpose, r.payload_bytes) for r in backward]}


def _cases(world):
    cases = {}
    for fn_name in ("logprobs", "loss"):
        for path in ("logits", "fused"):
            for form in ("csr", "padded"):
                for dtype in (torch.float64, torch.float32):
                    backend = "cpu" if (form == "padded") == (dtype == torch.float64) else "torch"
                    name = f"{fn_name}-{path}-{form}-{str(dtype)[6:]}-{backend}"
                    cases[name] = ("replay_case", dict(fn_name=fn_name, path=path, form=form, dtype=dtype,
                                                       backend=backend))
    for path in ("logits", "fused"):
        cases[f"dtensor-{path}"] = ("dtensor_case", dict(path=path, dtype=torch.float64,
                                                         backend="cpu" if path == "fused" else "torch"))
        cases[f"unchecked-{path}"] = ("unchecked_case", dict(path=path))
        for fault in ("label_outside", "id_beyond"):
            cases[f"error-{path}-{fault}"] = ("error_case", dict(path=path, fault=fault))
    cases["bytes"] = ("bytes_case", {})
    return cases


WORLDS = (2, 3)
_MESH = None  # the 1-D DeviceMesh of the ranks running the current cases (see run_all)
CASES = {world: _cases(world) for world in WORLDS}


def run_all(rank, world, cases_by_world):
    """For each world size ``w``: ranks ``0..w-1`` form a group and run its cases while the others
    wait; a failing case is reported under its name."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    global _MESH
    results = {}
    for size, cases in sorted(cases_by_world.items()):
        group = dist.group.WORLD if size == world else dist.new_group(list(range(size)))
        mesh = DeviceMesh("cpu", torch.arange(size))  # every rank takes part in creating it
        if rank < size:
            _MESH = mesh
            results[size] = {}
            for name, (fn_name, kwargs) in cases.items():
                try:
                    results[size][name] = globals()[fn_name](rank, size, group, **kwargs)
                except Exception:  # noqa: BLE001 - reported by the test of this case
                    results[size][name] = {"error": traceback.format_exc()}
        dist.barrier()
    return results


@functools.lru_cache(maxsize=None)
def _results():
    return run_ranks(max(WORLDS), run_all, CASES)


def _per_rank(world, name):
    per_rank = [ranks[world][name] for ranks in _results()[:world]]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank} of {world}, case {name}:\n{result['error']}"
    return per_rank


MATCH = [(w, n) for w in WORLDS for n in CASES[w] if not n.startswith(("error", "bytes"))]
ERRORS = [(w, n) for w in WORLDS for n in CASES[w] if n.startswith("error")]


@pytest.mark.parametrize("world,name", MATCH, ids=[f"{w}ranks-{n}" for w, n in MATCH])
def test_replay_on_vocabulary_shards_matches_one_process(world, name):
    per_rank = _per_rank(world, name)
    tol = FP32_TOL if "float32" in name else FP64_TOL
    for rank, result in enumerate(per_rank):
        for what, (got, want) in result["pairs"].items():
            torch.testing.assert_close(got, want, **tol, equal_nan="unchecked" in name,
                                       msg=lambda m, r=rank, w=what: f"rank {r}, {w}: {m}")
    if "unchecked" in name:  # the two tokens whose label is outside their set, and only they
        got = per_rank[0]["pairs"]["logprobs"][0].reshape(-1)
        assert torch.isnan(got).nonzero().view(-1).tolist() == [1, 2], got
    for what in ("loss", "logprobs", "entropy"):  # merged in rank order: the same bits everywhere
        if what in per_rank[0]["pairs"]:
            values = [r["pairs"][what][0] for r in per_rank]
            assert all(torch.equal(v, values[0]) or torch.allclose(v, values[0], rtol=0, atol=0, equal_nan=True)
                       for v in values), f"{what} differs between ranks"


@pytest.mark.parametrize("world,name", ERRORS, ids=[f"{w}ranks-{n}" for w, n in ERRORS])
def test_a_bad_mask_is_the_same_value_error_on_every_rank(world, name):
    per_rank = _per_rank(world, name)
    messages = {r["message"] for r in per_rank}
    assert all(r["error_type"] == "ValueError" for r in per_rank), per_rank
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "sampling_mask" in message, message
    if "label_outside" in name:
        assert "the label of token 2" in message and "not in its kept set" in message, message
    else:
        assert f"[0, {V})" in message and f"found {V + 3}" in message, message


@pytest.mark.parametrize("world", WORLDS)
def test_replay_moves_what_an_unmasked_shard_moves(world):
    tokens = N * T
    for rank, result in enumerate(_per_rank(world, "bytes")):
        (op, purpose, record), *rest = result["forward"]
        assert (op, purpose) == ("all_gather", "agreement") and record <= 1024, result
        assert rest == [("all_gather", "partials", 4 * tokens * 4)], (rank, rest)
        assert result["backward"] == [("all_reduce", "hidden_grad", tokens * HIDDEN * 4)], (rank, result)
