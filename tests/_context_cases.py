"""What each rank runs in the context-parallel tests (tests/test_context_parallel.py,
tests/test_context_mesh.py).

Every rank builds the whole problem from a fixed seed, computes the single-process result on the
whole batch itself (no collective), then the distributed result on its share: the completions of
its data rank, its positions of each (context rank), its vocabulary shard (tensor rank). It
returns ``{"pairs": {name: (distributed, single_process)}, "zeros": {name: bool}}``. Gradients are
returned as the contract defines them: a rank's tokens get ``D * S`` times their gradient (divided
back here), parameter gradients are averaged over the data x context ranks (as FSDP2 over a
``dp x cp`` mesh dimension does), per vocabulary shard.

Position splits (each completion's positions over ``S`` context ranks): ``contiguous`` (uneven
``tensor_split``), ``head_tail`` (``2S`` equal chunks, rank r holds chunks r and 2S-1-r, as torch's
``context_parallel`` load balancer; lengths multiples of 2S), ``random`` (a seeded partition: some
completion may have no position on a rank).
"""

from __future__ import annotations

import sys
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

import tpo_kernels
from tpo_kernels import distributed as tpo_dist

from _distributed_cases import _attempt, _leaf, _my_shard, _offsets, attempt_bad_label_and_score

VOCAB, HIDDEN = 37, 16
_GROUP = None  # the ranks running the current cases (see run_all)


# ----------------------------------------------------------------------------- splits and batches


def positions(length: int, world: int, rank: int, split: str, seed: int = 0) -> torch.Tensor:
    """This context rank's positions of a completion of ``length`` positions."""
    if split == "contiguous":
        return torch.arange(length).tensor_split(world)[rank]
    if split == "head_tail":
        assert length % (2 * world) == 0, (length, world)
        chunks = torch.arange(length).chunk(2 * world)
        return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])
    owner = torch.randperm(length, generator=torch.Generator().manual_seed(seed)) % world
    return torch.nonzero(owner == rank).squeeze(1)


def cp_batch(n: int, *, cp: int, packed: bool, split: str, grouping: str = "size", group_size: int = 3,
             old: Optional[str] = None, kl: bool = False, seed: int = 0, vocab: int = VOCAB, hidden: int = HIDDEN,
             max_len: int = 8, dtype: torch.dtype = torch.float64, weights: bool = False,
             kept: bool = False) -> dict:
    """A whole batch of ``n`` completions, float tensors in ``dtype``. Padded: ``[n, max_len]``,
    ``-100`` past each completion's length. Packed: lengths from 1 (multiples of 2S for the
    head-tail split). ``weights``: ``seq_log_weights`` too, completion 1's ``-inf`` (w = 0). ``kept``:
    a padded ``sampling_mask [*token_shape, 3]`` too (per token, like the labels): each counted
    label and two other ids, about one counted token in six with an empty set (it does not count)."""
    gen = torch.Generator().manual_seed(seed)
    if packed and split == "head_tail":
        lengths = torch.randint(1, max(2, max_len // (2 * cp)) + 1, (n,), generator=gen) * 2 * cp
    else:
        lengths = torch.randint(1, max_len + 1, (n,), generator=gen)
    if packed:
        token_shape = (int(lengths.sum()),)
        labels = torch.randint(0, vocab, token_shape, generator=gen)
    else:
        token_shape = (n, max_len)
        labels = torch.randint(0, vocab, token_shape, generator=gen)
        labels[torch.arange(max_len)[None, :] >= lengths[:, None]] = -100
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    group_of = torch.arange(n) // group_size if grouping == "size" else torch.randint(0, 3, (n,), generator=gen)
    batch = dict(n=n, lengths=lengths, labels=labels, packed=packed, token_shape=token_shape, grouping=grouping,
                 group_size=group_size, group_ids=group_of * 5 + 2, group_of=group_of,
                 scores=rand(n), logits=(rand(*token_shape, vocab) * 2).to(dtype),
                 hidden=rand(*token_shape, hidden).to(dtype), weight=(rand(vocab, hidden) * 0.5).to(dtype),
                 bias=rand(vocab).to(dtype), logprobs=(-torch.rand(token_shape, generator=gen, dtype=torch.float64)
                                                      * 3).to(dtype))
    if old == "token":
        batch["old_logprobs"] = (-torch.rand(token_shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
    elif old == "seq":
        batch["old_logprobs"] = (-torch.rand(n, generator=gen, dtype=torch.float64) * 10).to(dtype)
    if kl:
        batch["ref_logprobs"] = (-torch.rand(token_shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
        batch["beta"] = 0.1
    if weights:
        batch["seq_log_weights"] = rand(n)
        batch["seq_log_weights"][1] = float("-inf")
    if kept:  # label + a, label + b (mod V), a != b in [1, V): three distinct ids
        steps = torch.stack([torch.zeros((), dtype=torch.int64), *(torch.randperm(vocab - 1, generator=gen)[:2] + 1)])
        ids = (labels.clamp(min=0)[..., None] + steps) % vocab
        empty = (labels < 0) | (torch.rand(token_shape, generator=gen) < 0.17)
        batch["sampling_mask"] = torch.where(empty[..., None], -1, ids)
    return batch


def _grouping(batch: dict, seqs: slice) -> dict:
    if batch["grouping"] == "ids":
        return dict(group_ids=batch["group_ids"][seqs])
    return dict(group_size=batch["group_size"])


def whole_kwargs(batch: dict) -> dict:
    """The single-process keywords of the whole batch."""
    kwargs = _grouping(batch, slice(None))
    if batch["packed"]:
        kwargs["cu_seqlens"] = torch.tensor(_offsets(batch["lengths"].tolist()), dtype=torch.int64)
    for key in ("old_logprobs", "ref_logprobs", "beta", "seq_log_weights", "sampling_mask"):
        if key in batch:
            kwargs[key] = batch[key]
    return kwargs


def share(batch: dict, seqs: slice, cp: int, cp_rank: int, split: str) -> dict:
    """The completions ``seqs`` at this context rank's positions: ``index`` picks this rank's
    tokens out of any per-token tensor of the whole batch; ``kwargs``: the loss keywords."""
    n = batch["n"]
    if batch["packed"]:
        cu = _offsets(batch["lengths"].tolist())
        picked = [positions(int(batch["lengths"][i]), cp, cp_rank, split, seed=i) for i in range(n)[seqs]]
        rows = torch.cat([cu[i] + p for i, p in zip(range(n)[seqs], picked)] + [torch.zeros(0, dtype=torch.int64)])
        index = lambda x: x[rows]  # noqa: E731
        local_cu = torch.tensor(_offsets([len(p) for p in picked]), dtype=torch.int64)
        kwargs = dict(cu_seqlens=local_cu)
    else:
        cols = positions(batch["token_shape"][1], cp, cp_rank, split)
        index = lambda x: x[seqs][:, cols]  # noqa: E731
        kwargs = {}
    kwargs.update(_grouping(batch, seqs))
    if "old_logprobs" in batch:
        old = batch["old_logprobs"]
        kwargs["old_logprobs"] = old[seqs] if old.shape == (n,) else index(old)
    if "ref_logprobs" in batch:
        kwargs["ref_logprobs"], kwargs["beta"] = index(batch["ref_logprobs"]), batch["beta"]
    if "sampling_mask" in batch:  # per token: this rank's positions, like the labels
        kwargs["sampling_mask"] = index(batch["sampling_mask"])
    if "seq_log_weights" in batch:  # per completion: replicated over the context ranks
        kwargs["seq_log_weights"] = batch["seq_log_weights"][seqs]
    return dict(index=index, kwargs=kwargs, labels=index(batch["labels"]), scores=batch["scores"][seqs],
                seqs=seqs)


# ----------------------------------------------------------------------------- groups


def _mesh_groups(world: int, dp: int, cp: int, tp: int):
    """(data group, context group, vocabulary group, (d, s, t)): a DeviceMesh's groups, or the
    current group as the context group alone."""
    if dp == 1 and tp == 1:
        return None, _GROUP, None, (0, dist.get_rank(_GROUP), 0)
    from torch.distributed.device_mesh import init_device_mesh

    names, shape = zip(*[(name, size) for name, size in (("dp", dp), ("cp", cp), ("tp", tp)) if size > 1])
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    group = lambda name: mesh.get_group(name) if name in names else None  # noqa: E731
    coord = lambda name: mesh.get_local_rank(name) if name in names else 0  # noqa: E731
    return group("dp"), group("cp"), group("tp"), (coord("dp"), coord("cp"), coord("tp"))


def _mean_over_ranks(groups, x: torch.Tensor) -> torch.Tensor:
    """Average over the data x context ranks, as FSDP2 over that mesh dimension does (test-side)."""
    x = x.detach().clone()
    count = 1
    for group in groups:
        if group is not None:
            dist.all_reduce(x, group=group)
            count *= dist.get_world_size(group)
    return x / count


def _loss_value(loss: torch.Tensor) -> torch.Tensor:
    return loss.sum() if loss.dim() else loss


# ----------------------------------------------------------------------------- exactness


def context_case(rank: int, world: int, *, path: str, dp: int = 1, tp: int = 1, split: str = "contiguous",
                 packed: bool = False, dtype: str = "float64", backend: str = "torch", old: Optional[str] = None,
                 kl: bool = False, options: Optional[dict] = None, special: Optional[str] = None,
                 grouping: str = "size", n_per_rank: int = 6, seed: int = 0, weights: bool = False,
                 kept: bool = False) -> dict:
    """Loss, every gradient and every aux entry of a (dp x cp x tp) run vs one process.

    ``path``: ``logits`` (tpo_loss), ``fused`` (fused_linear_tpo_loss), ``logprobs``
    (tpo_loss_from_logprobs). ``special``: ``one_rank_and_none`` (completion 0's counted tokens
    all on the last context rank, completion 1 has none), ``zero_signal`` (group 0's scores tie:
    its tokens' gradient is exactly 0 on both sides)."""
    options = dict(options or {})
    cp = world // (dp * tp)
    dp_group, cp_group, tp_group, (d, s, t) = _mesh_groups(world, dp, cp, tp)
    float_dtype = getattr(torch, dtype)
    batch = cp_batch(n_per_rank * dp, cp=cp, packed=packed, split=split, grouping=grouping, old=old, kl=kl,
                     seed=seed, dtype=float_dtype, weights=weights, kept=kept)
    if special == "one_rank_and_none":
        # The whole batch's token positions held by the last context rank, by their flat index.
        marker = torch.arange(batch["labels"].numel()).view(batch["token_shape"])
        on_last = torch.zeros(batch["labels"].numel(), dtype=torch.bool)
        on_last[share(batch, slice(None), cp, cp - 1, split)["index"](marker).reshape(-1)] = True
        on_last = on_last.view(batch["token_shape"])
        first = _completion_rows(batch, 0)
        batch["labels"][first & on_last] = 1
        batch["labels"][first & ~on_last] = -100
        batch["labels"][_completion_rows(batch, 1)] = -100
    if special == "zero_signal":
        batch["scores"][batch["group_of"] == 0] = 0.5
    whole = whole_kwargs(batch)
    mine = share(batch, slice(d * n_per_rank, (d + 1) * n_per_rank), cp, s, split)
    index = mine["index"]
    start, stop = (0, VOCAB) if tp == 1 else _my_shard(VOCAB, tp, t, rotate=False)[:2]
    groups = dict(process_group=dp_group, context_parallel_group=cp_group)
    if tp_group is not None:
        groups["vocab_parallel_group"] = tp_group
    common = dict(backend=backend, return_aux=True, **options)
    scale = dp * cp
    pairs, grads = {}, {}
    if path == "logits":
        ref_leaf = _leaf(batch["logits"])
        ref_loss, ref_aux = tpo_kernels.tpo_loss(ref_leaf * 1.0, batch["labels"], batch["scores"], **whole, **common)
        leaf = _leaf(index(batch["logits"])[..., start:stop])
        loss, aux = tpo_kernels.tpo_loss(leaf * 1.0, mine["labels"], mine["scores"], **mine["kwargs"], **common,
                                         **groups)
        _loss_value(ref_loss).backward()
        _loss_value(loss).backward()
        grads["logits"] = (leaf.grad / scale, index(ref_leaf.grad)[..., start:stop])
    elif path == "fused":
        ref_h, ref_w, ref_b = _leaf(batch["hidden"]), _leaf(batch["weight"]), _leaf(batch["bias"])
        ref_loss, ref_aux = tpo_kernels.fused_linear_tpo_loss(ref_h, ref_w, batch["labels"], batch["scores"],
                                                              bias=ref_b, **whole, **common, chunk_size=5)
        h = _leaf(index(batch["hidden"]))
        w, b = _leaf(batch["weight"][start:stop]), _leaf(batch["bias"][start:stop])
        loss, aux = tpo_kernels.fused_linear_tpo_loss(h, w, mine["labels"], mine["scores"], bias=b, **mine["kwargs"],
                                                      **common, chunk_size=5, **groups)
        _loss_value(ref_loss).backward()
        _loss_value(loss).backward()
        grads["hidden"] = (h.grad / scale, index(ref_h.grad))
        pairs["grad_weight_shard"] = (_mean_over_ranks((dp_group, cp_group), w.grad), ref_w.grad[start:stop])
        pairs["grad_bias_shard"] = (_mean_over_ranks((dp_group, cp_group), b.grad), ref_b.grad[start:stop])
    else:
        mask = batch["labels"] >= 0
        ref_leaf = _leaf(batch["logprobs"])
        ref_loss, ref_aux = tpo_kernels.tpo_loss_from_logprobs(ref_leaf, batch["scores"], mask=mask, **whole,
                                                               **common)
        leaf = _leaf(index(batch["logprobs"]))
        loss, aux = tpo_kernels.tpo_loss_from_logprobs(leaf, mine["scores"], mask=index(mask), **mine["kwargs"],
                                                       **common, **groups)
        _loss_value(ref_loss).backward()
        _loss_value(loss).backward()
        grads["logprobs"] = (leaf.grad / scale, index(ref_leaf.grad))
    pairs["loss"] = (loss.detach(), ref_loss.detach())
    pairs.update({f"grad_{name}": pair for name, pair in grads.items()})
    extra = set(aux) - set(ref_aux)
    assert set(ref_aux) <= set(aux) and extra == ({"seq_offset"} if dp > 1 else set()), (sorted(aux), sorted(ref_aux))
    seqs = mine["seqs"]
    for name in ("p", "q", "u", "coef", "seq_logprobs"):
        pairs[f"aux_{name}"] = (aux[name], ref_aux[name][seqs])
    for name in ("group_loss", "kl_q_p", "entropy_p", "entropy_q", "zero_signal"):
        pairs[f"aux_{name}"] = (aux[name], ref_aux[name])
    for name in [key for key in ref_aux if key.startswith("token_")]:
        pairs[f"aux_{name}"] = (aux[name], index(ref_aux[name]))
    zeros = {}
    if special == "zero_signal":
        tied = index(_completion_rows_of(batch, batch["group_of"] == 0))
        for name, (got, want) in grads.items():
            zeros[f"tied_{name}_zero"] = bool((got[tied] == 0).all()) and bool((want[tied] == 0).all())
            zeros[f"untied_{name}_nonzero"] = bool((got[~tied] != 0).any())
    if special == "one_rank_and_none" and d == 0:  # completions 0 and 1 are data rank 0's
        zeros["completion_without_tokens_left_out"] = bool(aux["p"][1] == 0 and aux["q"][1] == 0)
        zeros["completion_of_one_rank_kept"] = bool(aux["p"][0] > 0)
    return {"pairs": pairs, "zeros": zeros}


def _completion_rows_of(batch: dict, chosen: torch.Tensor) -> torch.Tensor:
    """Bool of the token shape: the positions of the ``chosen`` (``[n]`` bool) completions."""
    if batch["packed"]:
        return chosen.repeat_interleave(batch["lengths"])
    return chosen[:, None].expand(batch["token_shape"]).clone()


def _completion_rows(batch: dict, i: int) -> torch.Tensor:
    chosen = torch.zeros(batch["n"], dtype=torch.bool)
    chosen[i] = True
    return _completion_rows_of(batch, chosen)


# ----------------------------------------------------------------------------- bytes


def bytes_case(rank: int, world: int) -> dict:
    """What the context group moves per call (fused head, N=4): its agreement record and one
    all-reduce of ``[N, C]`` float64 partials in the forward, nothing in the backward, for any T,
    V; C grows with the options that add a column (per-token old, KL, entropy)."""
    out = {}
    shapes = {"T64_V37": (64, 37), "T4096_V37": (4096, 37), "T64_V101": (64, 101)}
    columns = {"plain": {}, "old": dict(old="token"), "old_kl_entropy": dict(old="token", kl=True)}
    for shape_name, (length, vocab) in shapes.items():
        for column_name, config in columns.items():
            if shape_name != "T64_V37" and column_name != "old_kl_entropy":
                continue
            batch = cp_batch(4, cp=world, packed=False, split="head_tail", max_len=length, vocab=vocab, hidden=8,
                             group_size=2,
                             seed=5, dtype=torch.float32, **config)
            batch["labels"][:, 0] = 1  # every completion counts somewhere
            mine = share(batch, slice(None), world, rank, "head_tail")
            h = _leaf(mine["index"](batch["hidden"]))
            options = dict(entropy_coef=0.01) if config.get("kl") else {}
            with tpo_dist.count_collectives() as forward:
                loss = tpo_kernels.fused_linear_tpo_loss(h, batch["weight"], mine["labels"], mine["scores"],
                                                         **mine["kwargs"], **options, backend="cpu",
                                                         context_parallel_group=_GROUP)
            with tpo_dist.count_collectives() as backward:
                loss.backward()
            out[f"{shape_name}_{column_name}"] = dict(
                forward=[(r.op, r.purpose, r.payload_bytes, r.output_bytes) for r in forward],
                backward=[(r.op, r.purpose, r.payload_bytes) for r in backward])
    return out


def mesh_bytes_case(rank: int, world: int) -> dict:
    """dp2 x cp2: the collectives of one call, in order."""
    dp_group, cp_group, _, (d, s, _) = _mesh_groups(world, 2, 2, 1)
    batch = cp_batch(8, cp=2, packed=False, split="head_tail", grouping="ids", seed=6, dtype=torch.float32)
    mine = share(batch, slice(4 * d, 4 * d + 4), 2, s, "head_tail")
    with tpo_dist.count_collectives() as forward:
        loss = tpo_kernels.fused_linear_tpo_loss(_leaf(mine["index"](batch["hidden"])), batch["weight"],
                                                 mine["labels"], mine["scores"], **mine["kwargs"], backend="cpu",
                                                 process_group=dp_group, context_parallel_group=cp_group)
    with tpo_dist.count_collectives() as backward:
        loss.backward()
    return dict(forward=[(r.op, r.purpose, r.payload_bytes) for r in forward],
                backward=[(r.op, r.purpose) for r in backward])


# ----------------------------------------------------------------------------- failures


def failures_case(rank: int, world: int) -> dict:
    """Calls that fail on the last context rank (or whose ranks disagree): every rank raises
    the same error, fast. Per scenario ``(error type, message, seconds)`` (None: no error)."""
    pg = _GROUP
    batch = cp_batch(6, cp=world, packed=False, split="contiguous", seed=9, dtype=torch.float32, old="token")
    batch["labels"][:, 0] = 1
    mine = share(batch, slice(None), world, rank, "contiguous")
    index, labels, scores = mine["index"], mine["labels"], mine["scores"]
    hidden = index(batch["hidden"])
    last = rank == world - 1
    outcomes = {}

    def fused(**kw):
        args = dict(hidden=hidden, labels=labels, scores=scores, group_size=3, context_parallel_group=pg)
        args.update(kw)
        return tpo_kernels.fused_linear_tpo_loss(args.pop("hidden"), batch["weight"], args.pop("labels"),
                                                 args.pop("scores"), **args)

    def attempt(name, fn):
        _attempt(outcomes, name, fn)

    attempt_bad_label_and_score(outcomes, fused, labels, scores, failing=last)
    attempt("scores_differ", lambda: fused(scores=scores + 1e-3 if last else scores))
    ids = batch["group_of"] * 5 + 2
    attempt("group_ids_differ", lambda: fused(group_size=None, group_ids=ids.flip(0) if last else ids))
    attempt("completions_differ", lambda: fused(hidden=hidden[:3] if last else hidden, labels=labels[:3] if last else
                                                labels, scores=scores[:3] if last else scores))
    attempt("old_per_token_vs_per_completion", lambda: fused(
        old_logprobs=batch["old_logprobs"][:, 0] if last else index(batch["old_logprobs"])))
    log_weights = torch.zeros(6, dtype=torch.float64)
    attempt("seq_log_weights_differ", lambda: fused(seq_log_weights=log_weights + (0.5 if last else 0.0)))
    attempt("seq_log_weights_on_one_rank", lambda: fused(seq_log_weights=log_weights if last else None))
    kept_labels = labels.clamp(min=0)[..., None]  # a padded set of one id: the label
    attempt("sampling_mask_on_one_rank", lambda: fused(sampling_mask=kept_labels if last else None))
    attempt("all_masked_everywhere", lambda: fused(labels=torch.full_like(labels, -100)))
    attempt("backend_unusable", lambda: fused(backend="cuda" if last else "torch"))
    attempt("same_group_as_process_group", lambda: fused(process_group=pg))
    attempt("same_group_as_vocab_group", lambda: fused(vocab_parallel_group=pg))
    return {"outcomes": outcomes}


def mesh_failures_case(rank: int, world: int, *, dp: int, cp: int, tp: int) -> dict:
    """The last global rank fails (or disagrees) on a mesh: every rank raises its error."""
    dp_group, cp_group, tp_group, (d, s, t) = _mesh_groups(world, dp, cp, tp)
    batch = cp_batch(4 * dp, cp=cp, packed=False, split="contiguous", seed=9, dtype=torch.float32)
    batch["labels"][:, 0] = 1
    mine = share(batch, slice(4 * d, 4 * d + 4), cp, s, "contiguous")
    start, stop = (0, VOCAB) if tp == 1 else _my_shard(VOCAB, tp, t, rotate=False)[:2]
    groups = dict(process_group=dp_group, context_parallel_group=cp_group, vocab_parallel_group=tp_group)
    failing = rank == world - 1
    outcomes = {}

    def fused(**kw):
        return tpo_kernels.fused_linear_tpo_loss(mine["index"](batch["hidden"]), batch["weight"][start:stop],
                                                 mine["labels"], mine["scores"], group_size=2, **groups, **kw)

    _attempt(outcomes, "backend_unusable", lambda: fused(backend="cuda" if failing else "torch"))
    _attempt(outcomes, "eta", lambda: fused(eta=0.5 if failing else 1.0))
    _attempt(outcomes, "none_fails", lambda: fused())  # the same call on every rank: no error
    return {"outcomes": outcomes}


# ----------------------------------------------------------------------------- driver


def run_cases(rank: int, world: int, cases: Dict[str, tuple]) -> Dict[str, dict]:
    """Run ``{name: (function name, kwargs)}`` in order on this rank; a failing case is reported
    under its name (the ranks stay in step as long as every rank fails alike)."""
    import traceback

    results = {}
    for name, (fn_name, kwargs) in cases.items():
        torch.manual_seed(0)
        begin = time.monotonic()
        try:
            results[name] = globals()[fn_name](rank, world, **kwargs)
        except Exception:  # noqa: BLE001 - reported by the test of this case
            results[name] = {"error": traceback.format_exc()}
            # At once: a rank that fails out of step with its peers ends the spawn in a collective
            # error of theirs, which would hide this one.
            print(f"rank {rank}, case {name}:\n{results[name]['error']}", file=sys.stderr, flush=True)
        results[name]["seconds"] = time.monotonic() - begin
    return results


def run_all(rank: int, world: int, cases_by_world: Dict[int, Dict[str, tuple]]) -> Dict[int, Dict[str, dict]]:
    """One spawn for every world size: for each ``w``, ranks ``0..w-1`` form a group and run
    ``cases_by_world[w]`` while the others wait."""
    global _GROUP
    results = {}
    for size, cases in sorted(cases_by_world.items()):
        group = dist.group.WORLD if size == world else dist.new_group(list(range(size)))
        if rank < size:
            _GROUP = group
            results[size] = run_cases(rank, size, cases)
        dist.barrier()
    return results


