"""What each rank runs in the multi-process tests (tests/test_distributed.py).

Every rank builds the whole problem from a fixed seed, computes the single-process result on the
whole batch / whole vocabulary itself (no collective), then the distributed result on its share,
and returns both: ``{"pairs": {name: (distributed, single_process)}, "zeros": {name: bool}}``.
Gradients are returned as the contract defines them: data-parallel tokens get ``P`` times their
gradient (divided back here), parameters are averaged over the data-parallel ranks (as DDP does).
"""

from __future__ import annotations

import traceback
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

import tpo_kernels
from tpo_kernels import distributed as tpo_dist

HIDDEN, VOCAB, MAX_LEN = 16, 37, 5

# The group (and a 1-D DeviceMesh over it) of the ranks running the current cases: ranks
# 0..world-1 of the spawned processes (see run_all).
_GROUP = None
_MESH = None


def _leaf(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.detach().clone().requires_grad_(True)


def _offsets(sizes: Sequence[int]) -> List[int]:
    return [sum(sizes[:r]) for r in range(len(sizes) + 1)]


# ----------------------------------------------------------------------------- batches


def dp_batch(sizes: Sequence[int], *, grouping: str, group_size: int = 4, old: Optional[str] = None,
             kl: bool = False, tie: bool = True, packed: bool = False, seed: int = 0, vocab: int = VOCAB,
             hidden: int = HIDDEN, max_len: int = MAX_LEN) -> dict:
    """A whole batch of ``sum(sizes)`` completions; rank r holds ``sizes[r]`` consecutive ones.

    ``grouping="ids"``: group 0 has the first completion of every rank (spread over all ranks),
    the others are random; ``"size"``: contiguous groups of ``group_size`` over the concatenation.
    With ``tie`` the scores of one group tie: for ids group 1, the last completion of every rank;
    for sizes a group straddling two ranks when there is one."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    starts = _offsets(sizes)
    if grouping == "ids":
        ids = torch.full((n,), -1, dtype=torch.int64)
        ids[torch.tensor(starts[:-1])] = 0  # the first completion of every rank
        ids[torch.tensor(starts[1:]) - 1] = torch.where(ids[torch.tensor(starts[1:]) - 1] < 0, 1, 0)  # the last
        rest = torch.nonzero(ids < 0).squeeze(1)
        num_groups = max(1, rest.numel() // 3)
        ids[rest] = torch.randperm(rest.numel(), generator=gen) % num_groups + 2
        group_of = ids
    else:
        group_of = torch.arange(n) // group_size
    scores = torch.randn(n, generator=gen, dtype=torch.float64)
    # Tied: a group spread over every rank (ids), or one straddling two ranks (size).
    tied = [1] if grouping == "ids" else [1 if n // group_size > 2 else 0]
    if tie:
        for g in tied:
            scores[group_of == g] = 0.25
    lengths = torch.randint(1, max_len + 1, (n,), generator=gen)
    if packed:
        total = int(lengths.sum())
        labels = torch.randint(0, vocab, (total,), generator=gen)
        token_shape = (total,)
    else:
        labels = torch.randint(0, vocab, (n, max_len), generator=gen)
        for i in range(n):
            labels[i, lengths[i]:] = -100
        token_shape = (n, max_len)
    batch = dict(
        sizes=list(sizes), lengths=lengths, labels=labels, scores=scores.float(), group_of=group_of,
        group_ids=group_of * 7 + 3, group_size=group_size, grouping=grouping, packed=packed, tied=tied,
        logits=(torch.randn(*token_shape, vocab, generator=gen, dtype=torch.float64) * 2).float(),
        hidden=torch.randn(*token_shape, hidden, generator=gen, dtype=torch.float64).float(),
        weight=(torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.5).float(),
        bias=torch.randn(vocab, generator=gen, dtype=torch.float64).float(),
    )
    if old == "token":
        batch["old_logprobs"] = (-torch.rand(token_shape, generator=gen, dtype=torch.float64) * 3).float()
    elif old == "seq":
        batch["old_logprobs"] = (-torch.rand(n, generator=gen, dtype=torch.float64) * 10).float()
    if kl:
        batch["ref_logprobs"] = (-torch.rand(token_shape, generator=gen, dtype=torch.float64) * 3).float()
        batch["beta"] = 0.1
    return batch


def _token_rows(batch: dict, first: int, count: int) -> slice:
    """Rows of completions [first, first + count) in the flat token order."""
    if not batch["packed"]:
        return slice(first, first + count)
    cu = _offsets(batch["lengths"].tolist())
    return slice(cu[first], cu[first + count])


def _share(batch: dict, rank: int) -> dict:
    """Rank ``rank``'s completions, as loss keywords plus the token tensors."""
    starts = _offsets(batch["sizes"])
    first, count = starts[rank], batch["sizes"][rank]
    seqs, rows = slice(first, first + count), _token_rows(batch, first, count)
    share = dict(labels=batch["labels"][rows], scores=batch["scores"][seqs], logits=batch["logits"][rows],
                 hidden=batch["hidden"][rows], rows=rows, seqs=seqs)
    kwargs = {}
    if batch["grouping"] == "ids":
        kwargs["group_ids"] = batch["group_ids"][seqs]
    else:
        kwargs["group_size"] = batch["group_size"]
    if batch["packed"]:
        lengths = batch["lengths"][seqs]
        kwargs["cu_seqlens"] = torch.tensor(_offsets(lengths.tolist()), dtype=torch.int32)
    if "old_logprobs" in batch:
        old = batch["old_logprobs"]
        kwargs["old_logprobs"] = old[seqs] if old.dim() == 1 and old.shape[0] == len(batch["scores"]) else old[rows]
    if "ref_logprobs" in batch:
        kwargs["ref_logprobs"], kwargs["beta"] = batch["ref_logprobs"][rows], batch["beta"]
    share["kwargs"] = kwargs
    return share


def _whole(batch: dict) -> dict:
    """The single-process loss keywords of the whole batch."""
    kwargs = {}
    if batch["grouping"] == "ids":
        kwargs["group_ids"] = batch["group_ids"]
    else:
        kwargs["group_size"] = batch["group_size"]
    if batch["packed"]:
        kwargs["cu_seqlens"] = torch.tensor(_offsets(batch["lengths"].tolist()), dtype=torch.int32)
    for key in ("old_logprobs", "ref_logprobs", "beta"):
        if key in batch:
            kwargs[key] = batch[key]
    return kwargs


def _tied_rows(batch: dict) -> torch.Tensor:
    """Tokens of the completions of tied groups: bool of the labels' shape."""
    tied = torch.isin(batch["group_of"], torch.tensor(batch["tied"]))
    if batch["packed"]:
        return tied.repeat_interleave(batch["lengths"])
    return tied[:, None].expand(batch["labels"].shape)


def _mean_over(group, x: torch.Tensor) -> torch.Tensor:
    """Average over the ranks of ``group``, as DDP / FSDP2 do with gradients (test-side, not
    counted)."""
    x = x.detach().clone()
    dist.all_reduce(x, group=group)
    return x / dist.get_world_size(group)


def _loss_value(loss: torch.Tensor) -> torch.Tensor:
    return loss.sum() if loss.dim() else loss


# ----------------------------------------------------------------------------- data parallel


def dp_case(rank: int, world: int, *, path: str, sizes, grouping: str, reduction: str = "mean",
            backend: str = "torch", old=None, kl=False, packed=False, seed=0, group_size: int = 4,
            tie: bool = True, entropy: bool = False, masked_rank: Optional[int] = None,
            options: Optional[dict] = None) -> dict:
    """Item 1: groups split over ranks; loss, every gradient and every aux entry vs the whole
    batch in one process. ``masked_rank``: every completion of that rank has no counted token
    (left out of its group, as in one process). ``options``: more loss keywords (score_eps,
    length_normalize)."""
    pg = _GROUP
    batch = dp_batch(sizes, grouping=grouping, old=old, kl=kl, packed=packed, seed=seed, group_size=group_size,
                     tie=tie)
    if masked_rank is not None:
        starts = _offsets(batch["sizes"])
        batch["labels"][_token_rows(batch, starts[masked_rank], batch["sizes"][masked_rank])] = -100
    whole, share = _whole(batch), _share(batch, rank)
    common = dict(reduction=reduction, backend=backend, return_aux=True, return_entropy=entropy, **(options or {}))
    if path == "logits":
        ref_leaf = _leaf(batch["logits"])
        ref_loss, ref_aux = tpo_kernels.tpo_loss(ref_leaf * 1.0, batch["labels"], batch["scores"], **whole, **common)
        _loss_value(ref_loss).backward()
        leaf = _leaf(share["logits"])
        loss, aux = tpo_kernels.tpo_loss(leaf * 1.0, share["labels"], share["scores"], **share["kwargs"], **common,
                                         process_group=pg)  # non-leaf logits: in-place backward
        _loss_value(loss).backward()
        pairs = {"loss": (loss.detach(), ref_loss.detach()),
                 "grad_logits": (leaf.grad / world, ref_leaf.grad[share["rows"]])}
        grads = {"logits": (leaf.grad, ref_leaf.grad[share["rows"]])}
    else:
        ref_h, ref_w, ref_b = _leaf(batch["hidden"]), _leaf(batch["weight"]), _leaf(batch["bias"])
        ref_loss, ref_aux = tpo_kernels.fused_linear_tpo_loss(ref_h, ref_w, batch["labels"], batch["scores"],
                                                              bias=ref_b, **whole, **common, chunk_size=7)
        _loss_value(ref_loss).backward()
        h, w, b = _leaf(share["hidden"]), _leaf(batch["weight"]), _leaf(batch["bias"])
        loss, aux = tpo_kernels.fused_linear_tpo_loss(h, w, share["labels"], share["scores"], bias=b,
                                                      **share["kwargs"], **common, chunk_size=7, process_group=pg)
        _loss_value(loss).backward()
        pairs = {"loss": (loss.detach(), ref_loss.detach()),
                 "grad_hidden": (h.grad / world, ref_h.grad[share["rows"]]),
                 "grad_weight": (_mean_over(pg, w.grad), ref_w.grad),
                 "grad_bias": (_mean_over(pg, b.grad), ref_b.grad)}
        grads = {"hidden": (h.grad, ref_h.grad[share["rows"]])}
    single_keys = set(ref_aux)
    assert single_keys <= set(aux) and set(aux) - single_keys == {"seq_offset"}, (sorted(aux), sorted(ref_aux))
    assert aux["seq_offset"] == share["seqs"].start
    for name in ("p", "q", "u", "coef", "seq_logprobs"):
        pairs[f"aux_{name}"] = (aux[name], ref_aux[name][share["seqs"]])
    for name in ("token_logprobs",) + (("token_entropy",) if entropy else ()):
        pairs[f"aux_{name}"] = (aux[name], ref_aux[name][share["rows"]])
    for name in ("group_loss", "kl_q_p", "entropy_p", "entropy_q", "zero_signal"):
        pairs[f"aux_{name}"] = (aux[name], ref_aux[name])
    tied = _tied_rows(batch)[share["rows"]]
    zeros = {}
    bonus = bool((options or {}).get("entropy_coef"))  # an entropy bonus moves tied groups' tokens too
    # zero-signal: tied on-policy groups, exactly zero on both sides
    if tie and not kl and (old is None) and masked_rank is None and not bonus:
        for name, (got, want) in grads.items():
            zeros[f"tied_{name}_zero"] = bool((got[tied] == 0).all()) and bool((want[tied] == 0).all())
            if (~tied).any():  # a rank holding no completion has nothing to look at
                zeros[f"untied_{name}_nonzero"] = bool((got[~tied] != 0).any())
    return {"pairs": pairs, "zeros": zeros, "tied_tokens": int(tied.sum())}


# ----------------------------------------------------------------------------- vocabulary parallel


def vocab_split(vocab: int, world: int) -> List[int]:
    """Uneven contiguous shard sizes (``torch.tensor_split``), in rank order."""
    return [len(part) for part in torch.arange(vocab).tensor_split(world)]


def _my_shard(vocab: int, world: int, rank: int, rotate: bool):
    """(start, stop, explicit start or None): rank r holds piece r, or piece (r+1) % P with an
    explicit vocab_start_index."""
    sizes = vocab_split(vocab, world)
    piece = (rank + 1) % world if rotate else rank
    start = sum(sizes[:piece])
    return start, start + sizes[piece], (start if rotate else None)


def vp_logprobs_case(rank: int, world: int, *, path: str, rotate: bool = False, backend: str = "torch",
                     seed: int = 1, packed: bool = False) -> dict:
    """Item 2 on the log-prob functions with entropy: per-token values on every rank and the
    shard's gradients vs the whole vocabulary."""
    pg = _GROUP
    batch = dp_batch([6], grouping="size", group_size=3, packed=packed, seed=seed)
    start, stop, explicit = _my_shard(VOCAB, world, rank, rotate)
    labels = batch["labels"]
    gen = torch.Generator().manual_seed(seed + 100)
    coef_lp = torch.randn(labels.shape, generator=gen)
    coef_ent = torch.randn(labels.shape, generator=gen)
    vp = dict(vocab_parallel_group=pg, vocab_start_index=explicit)
    if path == "logits":
        ref_leaf, leaf = _leaf(batch["logits"]), _leaf(batch["logits"][..., start:stop])
        ref_lp, ref_ent = tpo_kernels.selective_logprobs(ref_leaf, labels, return_entropy=True, temperature=0.7,
                                                         backend=backend)
        lp, ent = tpo_kernels.selective_logprobs(leaf, labels, return_entropy=True, temperature=0.7, backend=backend,
                                                 **vp)
        ((ref_lp * coef_lp + ref_ent * coef_ent).sum()).backward()
        ((lp * coef_lp + ent * coef_ent).sum()).backward()
        pairs = {"grad_logits_shard": (leaf.grad, ref_leaf.grad[..., start:stop])}
    else:
        ref_h, ref_w, ref_b = _leaf(batch["hidden"]), _leaf(batch["weight"]), _leaf(batch["bias"])
        h, w, b = _leaf(batch["hidden"]), _leaf(batch["weight"][start:stop]), _leaf(batch["bias"][start:stop])
        ref_lp, ref_ent = tpo_kernels.fused_linear_logprobs(ref_h, ref_w, labels, bias=ref_b, return_entropy=True,
                                                            temperature=0.7, backend=backend, chunk_size=5)
        lp, ent = tpo_kernels.fused_linear_logprobs(h, w, labels, bias=b, return_entropy=True, temperature=0.7,
                                                    backend=backend, chunk_size=5, **vp)
        ((ref_lp * coef_lp + ref_ent * coef_ent).sum()).backward()
        ((lp * coef_lp + ent * coef_ent).sum()).backward()
        pairs = {"grad_hidden": (h.grad, ref_h.grad), "grad_weight_shard": (w.grad, ref_w.grad[start:stop]),
                 "grad_bias_shard": (b.grad, ref_b.grad[start:stop])}
    pairs["logprobs"] = (lp.detach(), ref_lp.detach())
    pairs["entropy"] = (ent.detach(), ref_ent.detach())
    ignored = labels == -100
    zeros = {"ignored_rows_zero": bool((lp[ignored] == 0).all() and (ent[ignored] == 0).all())}
    return {"pairs": pairs, "zeros": zeros}


def vp_loss_case(rank: int, world: int, *, path: str, backend: str = "torch", rotate: bool = False,
                 old=None, kl=False, seed: int = 2, grouping: str = "ids", options: Optional[dict] = None) -> dict:
    """Item 2 on the TPO losses: the same batch on every rank, the vocabulary split. ``options``:
    more loss keywords (entropy_coef)."""
    pg = _GROUP
    batch = dp_batch([9], grouping=grouping, group_size=3, old=old, kl=kl, seed=seed)
    whole = dict(_whole(batch), **(options or {}))
    start, stop, explicit = _my_shard(VOCAB, world, rank, rotate)
    vp = dict(vocab_parallel_group=pg, vocab_start_index=explicit)
    if path == "logits":
        ref_leaf, leaf = _leaf(batch["logits"]), _leaf(batch["logits"][..., start:stop])
        ref_loss = tpo_kernels.tpo_loss(ref_leaf * 1.0, batch["labels"], batch["scores"], **whole, backend=backend)
        loss = tpo_kernels.tpo_loss(leaf * 1.0, batch["labels"], batch["scores"], **whole, backend=backend, **vp)
        ref_loss.backward()
        loss.backward()
        pairs = {"grad_logits_shard": (leaf.grad, ref_leaf.grad[..., start:stop])}
        grads = {"logits": (leaf.grad, ref_leaf.grad[..., start:stop])}
    else:
        ref_h, ref_w, ref_b = _leaf(batch["hidden"]), _leaf(batch["weight"]), _leaf(batch["bias"])
        h, w, b = _leaf(batch["hidden"]), _leaf(batch["weight"][start:stop]), _leaf(batch["bias"][start:stop])
        ref_loss = tpo_kernels.fused_linear_tpo_loss(ref_h, ref_w, batch["labels"], batch["scores"], bias=ref_b,
                                                     **whole, backend=backend)
        loss = tpo_kernels.fused_linear_tpo_loss(h, w, batch["labels"], batch["scores"], bias=b, **whole,
                                                 backend=backend, **vp)
        ref_loss.backward()
        loss.backward()
        pairs = {"grad_hidden": (h.grad, ref_h.grad), "grad_weight_shard": (w.grad, ref_w.grad[start:stop]),
                 "grad_bias_shard": (b.grad, ref_b.grad[start:stop])}
        grads = {"hidden": (h.grad, ref_h.grad)}
    pairs["loss"] = (loss.detach(), ref_loss.detach())
    zeros = {}
    if not kl and old is None and not (options or {}).get("entropy_coef"):
        tied = _tied_rows(batch)
        for name, (got, want) in grads.items():
            zeros[f"tied_{name}_zero"] = bool((got[tied] == 0).all()) and bool((want[tied] == 0).all())
    return {"pairs": pairs, "zeros": zeros, "tied_tokens": int(tied.sum()) if zeros else 0}


def dtensor_case(rank: int, world: int, *, path: str, backend: str = "torch", seed: int = 3) -> dict:
    """A DTensor sharded on the vocabulary (torchtitan style) needs no group nor offset: the weight
    and bias (fused path) or the logits (logits path) as ``Shard`` DTensors; gradients come back
    as DTensors with the same placement."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _MESH
    batch = dp_batch([6], grouping="size", group_size=3, seed=seed, old="seq", kl=True)
    whole = _whole(batch)
    if path == "logits":
        ref_leaf = _leaf(batch["logits"])
        dt = distribute_tensor(batch["logits"], mesh, [Shard(2)]).requires_grad_(True)
        ref_loss = tpo_kernels.tpo_loss(ref_leaf, batch["labels"], batch["scores"], **whole, backend=backend)
        loss = tpo_kernels.tpo_loss(dt, batch["labels"], batch["scores"], **whole, backend=backend)
        ref_loss.backward()
        loss.backward()
        pairs = {"grad_logits": (dt.grad.full_tensor(), ref_leaf.grad)}
        untouched = bool(torch.equal(dt.full_tensor().detach(), batch["logits"]))  # a leaf: never overwritten
    else:
        ref_h, ref_w, ref_b = _leaf(batch["hidden"]), _leaf(batch["weight"]), _leaf(batch["bias"])
        w = distribute_tensor(batch["weight"], mesh, [Shard(0)]).requires_grad_(True)
        b = distribute_tensor(batch["bias"], mesh, [Shard(0)]).requires_grad_(True)
        h = _leaf(batch["hidden"])
        ref_loss = tpo_kernels.fused_linear_tpo_loss(ref_h, ref_w, batch["labels"], batch["scores"], bias=ref_b,
                                                     **whole, backend=backend)
        loss = tpo_kernels.fused_linear_tpo_loss(h, w, batch["labels"], batch["scores"], bias=b, **whole,
                                                 backend=backend)
        ref_loss.backward()
        loss.backward()
        pairs = {"grad_hidden": (h.grad, ref_h.grad), "grad_weight": (w.grad.full_tensor(), ref_w.grad),
                 "grad_bias": (b.grad.full_tensor(), ref_b.grad)}
        untouched = type(w.grad).__name__ == "DTensor" and w.grad.placements == w.placements
    pairs["loss"] = (loss.detach(), ref_loss.detach())
    return {"pairs": pairs, "zeros": {"dtensor_ok": untouched}}


def two_d_case(rank: int, world: int, *, backend: str = "torch", dtensor: bool = False, seed: int = 4) -> dict:
    """Items 1 + 2 on a (data x tensor) mesh: the batch split over ``dp``, the vocabulary over
    ``tp``; ranks of one ``dp`` coordinate hold the same completions."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
    dp_rank, tp_rank, dp_size = mesh.get_local_rank("dp"), mesh.get_local_rank("tp"), world // 2
    sizes = [3, 5, 4][:dp_size] if dp_size > 1 else [6]
    batch = dp_batch(sizes, grouping="ids", old="token", kl=True, seed=seed)
    whole, share = _whole(batch), _share(batch, dp_rank)
    ref_h, ref_w, ref_b = _leaf(batch["hidden"]), _leaf(batch["weight"]), _leaf(batch["bias"])
    ref_loss = tpo_kernels.fused_linear_tpo_loss(ref_h, ref_w, batch["labels"], batch["scores"], bias=ref_b,
                                                 **whole, backend=backend)
    ref_loss.backward()
    h = _leaf(share["hidden"])
    if dtensor:
        w = distribute_tensor(batch["weight"], mesh, [Replicate(), Shard(0)]).requires_grad_(True)
        b = distribute_tensor(batch["bias"], mesh, [Replicate(), Shard(0)]).requires_grad_(True)
        vp = {}
        start = min(-(-VOCAB // 2) * tp_rank, VOCAB)  # DTensor's Shard splits like torch.chunk
    else:
        start, stop, _ = _my_shard(VOCAB, 2, tp_rank, rotate=False)
        w, b = _leaf(batch["weight"][start:stop]), _leaf(batch["bias"][start:stop])
        vp = dict(vocab_parallel_group=tp_group)
    loss = tpo_kernels.fused_linear_tpo_loss(h, w, share["labels"], share["scores"], bias=b, **share["kwargs"],
                                             backend=backend, process_group=dp_group, **vp)
    loss.backward()
    if dtensor:
        grad_w, grad_b = w.grad.to_local(), b.grad.to_local()
    else:
        grad_w, grad_b = w.grad, b.grad
    stop = start + grad_w.shape[0]
    return {"pairs": {
        "loss": (loss.detach(), ref_loss.detach()),
        "grad_hidden": (h.grad / dp_size, ref_h.grad[share["rows"]]),
        "grad_weight_shard": (_mean_over(dp_group, grad_w), ref_w.grad[start:stop]),
        "grad_bias_shard": (_mean_over(dp_group, grad_b), ref_b.grad[start:stop]),
    }, "zeros": {}}


# ----------------------------------------------------------------------------- bytes


def bytes_case(rank: int, world: int) -> dict:
    """The bytes each collective moves: item 1 depends on N only (not on T, V, H); item 2 on
    M (the partials) and M * H (the dH all-reduce), not on V."""
    pg = _GROUP
    out = {}
    sizes = [3, 5, 4][:world] if world > 1 else [4]
    for name, (max_len, vocab, hidden) in {"small": (5, 37, 16), "large": (12, 101, 24)}.items():
        batch = dp_batch(sizes, grouping="ids", old="token", kl=True, seed=5, vocab=vocab, hidden=hidden,
                         max_len=max_len)
        share = _share(batch, rank)
        h, w = _leaf(share["hidden"]), _leaf(batch["weight"])
        with tpo_dist.count_collectives() as forward:
            loss = tpo_kernels.fused_linear_tpo_loss(h, w, share["labels"], share["scores"], **share["kwargs"],
                                                     backend="torch", process_group=pg)
        with tpo_dist.count_collectives() as backward:
            loss.backward()
        out[f"dp_{name}"] = dict(forward=[(r.op, r.purpose, r.payload_bytes, r.output_bytes) for r in forward],
                                 backward=[(r.op, r.purpose, r.payload_bytes) for r in backward],
                                 max_n=max(sizes), tokens=share["labels"].numel(), hidden=hidden,
                                 received=forward.received_bytes() + backward.received_bytes())

        start, stop, _ = _my_shard(vocab, world, rank, rotate=False)
        full = dp_batch([6], grouping="ids", seed=6, vocab=vocab, hidden=hidden, max_len=max_len)
        h, w = _leaf(full["hidden"]), _leaf(full["weight"][start:stop])
        with tpo_dist.count_collectives() as forward:
            loss = tpo_kernels.fused_linear_tpo_loss(h, w, full["labels"], full["scores"], **_whole(full),
                                                     backend="torch", vocab_parallel_group=pg)
        with tpo_dist.count_collectives() as backward:
            loss.backward()
        with tpo_dist.count_collectives() as entropy:
            tpo_kernels.fused_linear_logprobs(h.detach(), w.detach(), full["labels"], return_entropy=True,
                                              backend="torch", vocab_parallel_group=pg, vocab_start_index=start)
        out[f"vp_{name}"] = dict(forward=[(r.op, r.purpose, r.payload_bytes, r.output_bytes) for r in forward],
                                 backward=[(r.op, r.purpose, r.payload_bytes) for r in backward],
                                 entropy=[(r.op, r.purpose, r.payload_bytes) for r in entropy],
                                 tokens=full["labels"].numel(), hidden=hidden,
                                 received=forward.received_bytes() + backward.received_bytes())
    return {"bytes": out}


# ----------------------------------------------------------------------------- token level, failures


def token_dp_case(rank: int, world: int, *, states: Sequence[int], fused: bool = False, reduction: str = "mean",
                  backend: str = "torch", old: bool = False) -> dict:
    """Token-level TPO with states split over ranks: the loss of every rank's states, and (after
    DDP's average) the single-process gradient."""
    pg, num_cand = _GROUP, 4
    gen = torch.Generator().manual_seed(11)
    total = sum(states)
    hidden = torch.randn(total, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5
    logits = torch.randn(total, VOCAB, generator=gen) * 2
    candidates = torch.randint(0, VOCAB, (total, num_cand), generator=gen)
    scores = torch.randn(total, num_cand, generator=gen)
    scores[0] = 0.5  # a tied state
    kwargs = dict(reduction=reduction, backend=backend, return_aux=True)
    old_all = -torch.rand(total, num_cand, generator=gen) * 3 if old else None
    starts = _offsets(states)
    mine = slice(starts[rank], starts[rank + 1])
    if fused:
        ref_h, ref_w, h, w = _leaf(hidden), _leaf(weight), _leaf(hidden[mine]), _leaf(weight)
        ref_loss, ref_aux = tpo_kernels.fused_linear_token_tpo_loss(ref_h, ref_w, candidates, scores,
                                                                    old_logprobs=old_all, **kwargs)
        loss, aux = tpo_kernels.fused_linear_token_tpo_loss(
            h, w, candidates[mine], scores[mine], old_logprobs=None if old_all is None else old_all[mine],
            process_group=pg, **kwargs)
        _loss_value(ref_loss).backward()
        _loss_value(loss).backward()
        pairs = {"grad_hidden": (h.grad / world, ref_h.grad[mine]), "grad_weight": (_mean_over(pg, w.grad), ref_w.grad)}
    else:
        ref_z, z = _leaf(logits), _leaf(logits[mine])
        ref_loss, ref_aux = tpo_kernels.token_tpo_loss(ref_z, candidates, scores, old_logprobs=old_all, **kwargs)
        loss, aux = tpo_kernels.token_tpo_loss(z, candidates[mine], scores[mine], process_group=pg,
                                               old_logprobs=None if old_all is None else old_all[mine], **kwargs)
        _loss_value(ref_loss).backward()
        _loss_value(loss).backward()
        pairs = {"grad_logits": (z.grad / world, ref_z.grad[mine])}
    pairs["loss"] = (loss.detach(), ref_loss.detach())
    for name in ("p", "q", "u", "coef", "candidate_logits"):
        pairs[f"aux_{name}"] = (aux[name], ref_aux[name][mine])
    pairs["aux_state_loss"] = (aux["state_loss"], ref_aux["state_loss"])
    assert aux["state_offset"] == mine.start
    return {"pairs": pairs, "zeros": {}}


def _attempt(outcomes: dict, name: str, fn) -> None:
    """Run ``fn``; record ``(error type, message, seconds)`` of what it raised (None: nothing).
    Any exception counts, a process group timeout too (it shows as a slow, different error)."""
    import time

    start = time.monotonic()
    try:
        fn()
        outcomes[name] = None
    except Exception as exc:  # noqa: BLE001 - compared across ranks by the test
        outcomes[name] = (type(exc).__name__, str(exc), time.monotonic() - start)


def attempt_bad_label_and_score(outcomes: dict, fused, labels: torch.Tensor, scores: torch.Tensor, *,
                                failing: bool) -> None:
    """The bad inputs every failures case tries on its failing rank, the others passing theirs
    unchanged: a label past the vocabulary (``label_out_of_range``) and a NaN score
    (``nan_score``). ``fused(labels=..., scores=...)`` makes the call with one of them replaced."""
    bad_labels = labels.clone()
    bad_labels[0, 0] = VOCAB + 3
    _attempt(outcomes, "label_out_of_range", lambda: fused(labels=bad_labels if failing else labels))
    nan_scores = scores.clone()
    nan_scores[1] = float("nan")
    _attempt(outcomes, "nan_score", lambda: fused(scores=nan_scores if failing else scores))


def failures_case(rank: int, world: int) -> dict:
    """Calls that fail on one rank (or whose ranks disagree): every rank must raise the same
    error, fast. Returns, per scenario, ``(error type, message, seconds)`` (None: no error)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    pg = _GROUP
    batch = dp_batch([4] * world, grouping="size", seed=9)
    share = _share(batch, rank)
    h, w, labels, scores, logits = share["hidden"], batch["weight"], share["labels"], share["scores"], share["logits"]
    last = rank == world - 1
    outcomes = {}

    def attempt(name, fn):
        _attempt(outcomes, name, fn)

    def fused(**kw):
        args = dict(hidden=h, weight=w, labels=labels, scores=scores, group_size=4, process_group=pg)
        args.update(kw)
        return tpo_kernels.fused_linear_tpo_loss(args.pop("hidden"), args.pop("weight"), args.pop("labels"),
                                                 args.pop("scores"), **args)

    attempt_bad_label_and_score(outcomes, fused, labels, scores, failing=last)
    everything_masked = torch.full_like(labels, -100)
    attempt("no_counted_token_anywhere", lambda: fused(labels=everything_masked))
    attempt("compute_dtype", lambda: tpo_kernels.tpo_loss(
        logits.double() if last else logits, labels, scores, group_size=4, process_group=pg))
    attempt("return_entropy", lambda: fused(return_aux=True, return_entropy=last))
    attempt("eta", lambda: fused(eta=0.5 if last else 1.0))
    attempt("reduction", lambda: fused(reduction="sum" if last else "mean"))
    attempt("score_eps", lambda: fused(score_eps=0.0 if last else 1e-6))
    attempt("length_normalize", lambda: fused(length_normalize=last))
    attempt("entropy_coef", lambda: fused(entropy_coef=0.1 if last else 0.0))
    attempt("old_on_one_rank", lambda: fused(old_logprobs=scores * 0 - 1.0 if last else None))
    attempt("bad_type_on_one_rank", lambda: fused(group_size=4.0 if last else 4))
    attempt("token_level_nan", lambda: tpo_kernels.token_tpo_loss(
        logits.reshape(-1, VOCAB)[:3], torch.zeros(3, 2, dtype=torch.int64),
        torch.full((3, 2), float("nan")) if last else torch.zeros(3, 2), process_group=pg))
    # Raised before the checks used to be exchanged: the backend's resolution, the placement
    # keywords, the cache budget.
    attempt("backend_unusable", lambda: fused(backend="cuda" if last else "torch"))
    attempt("token_level_backend_unusable", lambda: tpo_kernels.token_tpo_loss(
        logits.reshape(-1, VOCAB)[:3], torch.zeros(3, 2, dtype=torch.int64), torch.randn(3, 2),
        backend="cuda" if last else "torch", process_group=pg))
    attempt("start_without_vocab_group", lambda: fused(vocab_start_index=0 if last else None))
    attempt("cache_budget_too_large", lambda: fused(logits_cache_bytes=2 ** 63 if last else 0))
    attempt("cache_budget_not_an_int", lambda: fused(logits_cache_bytes=1.5 if last else 0))
    # Out of range on one rank: refused by its check pass, never inside the op or the agreement
    # record (an int beyond int64 there used to fail that rank alone while its peers waited).
    attempt("chunk_size_beyond_int64", lambda: fused(chunk_size=2 ** 63 if last else None))
    attempt("group_size_beyond_int64", lambda: fused(group_size=2 ** 63 if last else 4))
    attempt("ignore_index_beyond_int64", lambda: fused(ignore_index=2 ** 64 + 2 if last else -100))
    attempt("eta_beyond_a_float", lambda: fused(eta=10 ** 400 if last else 1.0))
    attempt("beta_overflowing_the_loss", lambda: fused(beta=1e39 if last else 0.0))
    attempt("temperature_as_a_tensor", lambda: fused(temperature=torch.tensor(0.5) if last else 0.5))
    token_logprobs = -logits[..., 0].abs()
    attempt("positive_logprobs", lambda: tpo_kernels.tpo_loss_from_logprobs(
        -token_logprobs if last else token_logprobs, scores, group_size=4, process_group=pg))
    # Vocabulary-parallel: every rank holds a shard of the head and the same tokens.
    sizes = vocab_split(VOCAB, world)
    start = sum(sizes[:rank])
    w_shard = w[start:start + sizes[rank]]
    whole_labels = batch["labels"][:4]
    other_labels = whole_labels.clone()
    other_labels[0, 0] = (int(other_labels[0, 0]) + 1) % VOCAB
    vp = dict(vocab_parallel_group=pg)
    attempt("vp_label_out_of_range", lambda: tpo_kernels.fused_linear_logprobs(
        batch["hidden"][:4], w_shard, torch.where(whole_labels >= 0, VOCAB + 1, whole_labels), **vp))
    attempt("vp_labels_differ", lambda: tpo_kernels.fused_linear_logprobs(
        batch["hidden"][:4], w_shard, other_labels if last else whole_labels, **vp))
    attempt("vp_tokens_differ", lambda: tpo_kernels.fused_linear_logprobs(
        batch["hidden"][:3 if last else 4], w_shard, whole_labels[:3 if last else 4], **vp))
    attempt("vp_dtype", lambda: tpo_kernels.fused_linear_logprobs(
        batch["hidden"][:4].double() if last else batch["hidden"][:4], w_shard.double() if last else w_shard,
        whole_labels, **vp))
    attempt("vp_softcap", lambda: tpo_kernels.selective_logprobs(
        batch["logits"][:4][..., start:start + sizes[rank]], whole_labels, logit_softcap=30.0, **vp))
    attempt("overlapping_shards", lambda: tpo_kernels.fused_linear_logprobs(
        batch["hidden"][:4], w[:10], whole_labels, vocab_parallel_group=pg, vocab_start_index=0))
    attempt("vp_negative_start", lambda: tpo_kernels.tpo_loss(
        batch["logits"][:4][..., start:start + sizes[rank]], whole_labels, batch["scores"][:4], group_size=2,
        vocab_parallel_group=pg, vocab_start_index=-1 if last else start))
    attempt("vp_start_beyond_int64", lambda: tpo_kernels.tpo_loss(
        batch["logits"][:4][..., start:start + sizes[rank]], whole_labels, batch["scores"][:4], group_size=2,
        vocab_parallel_group=pg, vocab_start_index=2 ** 63 if last else start))
    attempt("vp_empty_shard", lambda: tpo_kernels.fused_linear_logprobs(
        batch["hidden"][:4], w_shard[:0] if last else w_shard, whole_labels, **vp))
    attempt("vp_weight_none", lambda: tpo_kernels.fused_linear_tpo_loss(
        batch["hidden"][:4], None if last else w_shard, whole_labels, batch["scores"][:4], group_size=2, **vp))
    attempt("vp_backend_unusable", lambda: tpo_kernels.selective_logprobs(
        batch["logits"][:4][..., start:start + sizes[rank]], whole_labels, backend="cuda" if last else "torch",
        **vp))
    fsdp_like = distribute_tensor(w, _MESH, [Shard(0)])  # FSDP2's sharded lm_head, outside forward
    attempt("same_group_for_both", lambda: fused(weight=fsdp_like))
    attempt("group_size_total", lambda: fused(group_size=5))
    attempt("start_without_group", lambda: tpo_kernels.fused_linear_logprobs(h, w, labels, vocab_start_index=0))
    return {"outcomes": outcomes}


def two_d_failures_case(rank: int, world: int) -> dict:
    """On a (data x tensor) mesh, global rank 3 (data rank 1, tensor rank 1) fails or disagrees:
    all four ranks raise the same error, naming the global rank with its group rank beside it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    batch = dp_batch([4] * (world // 2), grouping="size", seed=9)
    share = _share(batch, dp_rank)
    start, stop, _ = _my_shard(VOCAB, 2, tp_rank, rotate=False)
    failing = rank == world - 1
    outcomes = {}

    def fused(labels=None, **kw):
        return tpo_kernels.fused_linear_tpo_loss(
            share["hidden"], batch["weight"][start:stop], share["labels"] if labels is None else labels,
            share["scores"], bias=batch["bias"][start:stop], group_size=4, process_group=dp_group,
            vocab_parallel_group=tp_group, **kw)

    _attempt(outcomes, "backend_unusable", lambda: fused(backend="cuda" if failing else "torch"))
    _attempt(outcomes, "negative_start", lambda: fused(vocab_start_index=-1 if failing else start))
    _attempt(outcomes, "eta", lambda: fused(eta=0.5 if failing else 1.0))
    bad = share["labels"].clone()
    bad[0, 0] = VOCAB + 3
    # Out-of-range labels on data rank 1 (both of its tensor ranks hold the same tokens).
    _attempt(outcomes, "label_out_of_range", lambda: fused(labels=bad if dp_rank == 1 else None))
    return {"outcomes": outcomes}


def dp_numpy_group_size_case(rank: int, world: int) -> dict:
    """The split path takes the integers the single-process path takes (np.int64 group_size)."""
    import numpy as np

    batch = dp_batch([4] * world, grouping="size", seed=5)
    share = _share(batch, rank)
    loss = tpo_kernels.fused_linear_tpo_loss(share["hidden"], batch["weight"], share["labels"], share["scores"],
                                             group_size=np.int64(4), process_group=_GROUP)
    ref = tpo_kernels.fused_linear_tpo_loss(batch["hidden"], batch["weight"], batch["labels"], batch["scores"],
                                            group_size=4)
    return {"pairs": {"loss": (loss.detach(), ref.detach())}, "zeros": {}}


# ----------------------------------------------------------------------------- DDP / FSDP2


class TinyCausalLM(nn.Module):
    """Embedding, a causal running mean over positions, one MLP block, an lm_head."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.block = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        positions = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)
        x = x.cumsum(dim=1) / positions[:, None]  # causal: position t sees tokens <= t
        return x + self.block(x)


class TPOPolicy(nn.Module):
    """The model and its loss in one forward, so that FSDP2 has the lm_head weight unsharded
    when the fused loss reads it."""

    def __init__(self, lm: TinyCausalLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels, scores, group_ids, process_group=None):
        hidden = self.lm.hidden_states(input_ids)
        return tpo_kernels.fused_linear_tpo_loss(hidden, self.lm.lm_head.weight, labels, scores, group_ids=group_ids,
                                                 backend="cpu", chunk_size=8, process_group=process_group)


def _lm_batch(sizes, seed: int = 7):
    batch = dp_batch(sizes, grouping="ids", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    n = sum(sizes)
    input_ids = torch.randint(0, VOCAB, (n, MAX_LEN), generator=gen)
    return input_ids, batch


def train_case(rank: int, world: int, *, wrapper: str, steps: int = 2) -> dict:
    """A tiny causal LM trained for a few SGD steps with fused_linear_tpo_loss under DDP or FSDP2
    (``fully_shard`` on the block and the root) vs the same steps in one process on the whole
    batch: losses, first-step gradients and final parameters."""
    from torch.nn.parallel import DistributedDataParallel

    pg = _GROUP
    sizes = [3, 5, 4][:world]
    input_ids, batch = _lm_batch(sizes)
    share = _share(batch, rank)
    torch.manual_seed(0)
    reference = TPOPolicy(TinyCausalLM())
    torch.manual_seed(0)
    model = TPOPolicy(TinyCausalLM())
    if wrapper == "ddp":
        wrapped = DistributedDataParallel(model, process_group=pg)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.lm.block, mesh=_MESH)
        wrapped = fully_shard(model, mesh=_MESH)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    pairs = {}
    for step in range(steps):
        ref_loss = reference(input_ids, batch["labels"], batch["scores"], batch["group_ids"])
        loss = wrapped(input_ids[share["seqs"]], share["labels"], share["scores"], share["kwargs"]["group_ids"],
                       process_group=pg)
        ref_loss.backward()
        loss.backward()
        pairs[f"loss_step{step}"] = (loss.detach(), ref_loss.detach())
        if step == 0:
            for (name, p), (_, ref_p) in zip(model.named_parameters(), reference.named_parameters()):
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                pairs[f"grad_{name}"] = (grad, ref_p.grad)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    for (name, p), (_, ref_p) in zip(model.named_parameters(), reference.named_parameters()):
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        pairs[f"param_{name}"] = (value.detach(), ref_p.detach())
    return {"pairs": pairs, "zeros": {}}


# ----------------------------------------------------------------------------- driver


def run_cases(rank: int, world: int, cases: Dict[str, tuple]) -> Dict[str, dict]:
    """Run ``{name: (function name, kwargs)}`` in order on this rank; a failing case is reported
    under its name (the ranks stay in step as long as every rank fails alike)."""
    results = {}
    for name, (fn_name, kwargs) in cases.items():
        torch.manual_seed(0)
        try:
            results[name] = globals()[fn_name](rank, world, **kwargs)
        except Exception:  # noqa: BLE001 - reported by the test of this case
            results[name] = {"error": traceback.format_exc()}
    return results


def run_all(rank: int, world: int, cases_by_world: Dict[int, Dict[str, tuple]]) -> Dict[int, Dict[str, dict]]:
    """One spawn for every world size (process start-up dominates): for each ``w``, ranks
    ``0..w-1`` form a group and run ``cases_by_world[w]`` while the others wait."""
    from torch.distributed.device_mesh import DeviceMesh

    global _GROUP, _MESH
    results = {}
    for size, cases in sorted(cases_by_world.items()):
        group = dist.group.WORLD if size == world else dist.new_group(list(range(size)))
        mesh = DeviceMesh("cpu", torch.arange(size))  # every rank takes part in creating it
        if rank < size:
            _GROUP, _MESH = group, mesh
            results[size] = run_cases(rank, size, cases)
        dist.barrier()
    return results
