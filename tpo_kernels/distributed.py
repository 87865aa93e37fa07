"""TPO across devices: groups split over data-parallel ranks, and a vocabulary-parallel lm_head.

Two independent modes, combinable on a 2-D (data x tensor) mesh:

**Data parallel** (``process_group=`` on :func:`~tpo_kernels.tpo_loss` and
:func:`~tpo_kernels.fused_linear_tpo_loss`). The completions of one group may live on different
ranks. The row op (the vocabulary-sized work) stays local; the group stage needs only per-completion
numbers, so each rank sends its ``[N_r, C]`` rows (sequence log-prob, score, old sequence log-prob,
KL sums) plus an int64 group id per completion, and every rank runs the same group op on the
gathered ``[N, C]``. Nothing token- or vocabulary-sized crosses ranks.

Contract: every rank returns the loss of the *concatenated* batch (same value on every rank, so
the mean of the ranks' losses is the global loss), and its backward sends into this rank's
tokens ``P`` times their gradient of that loss (``P`` the size of ``process_group``). Data
parallelism (DDP's all-reduce, FSDP2's reduce-scatter) averages parameter gradients over the
``P`` ranks, so every parameter receives exactly the gradient of single-process training on the
concatenated batch. The factor ``P`` is not a convention picked for DDP: the gather's true
backward is a reduce-scatter (sum over ranks) of identical gradients, which equals ``P`` times the
local one, so no backward collective is needed.

**Vocabulary parallel** (``vocab_parallel_group=`` on the fused-linear and logits functions). Each
rank holds a contiguous vocabulary shard of the lm_head (weight ``[V_r, H]``, bias ``[V_r]``) or of
the logits (``[M, V_r]``), and the same tokens (hidden ``[M, H]`` and labels, replicated in the
group). Each rank computes per-token partials over its shard (logsumexp, the target logit when
it owns the label, and ``S = sum_v p_v z_v`` for the entropy); one all-gather of the ``[C, M]``
partials lets every rank merge them in rank order (deterministic, identical on every rank). The
backward is local on the shard (``dW``, ``db`` or the logits gradient of the shard) plus, for the
fused path, the one all-reduce of ``dH`` that any tensor-parallel linear layer needs.

Every collective goes through :func:`all_gather_stacked` or :func:`all_reduce_sum`, which
:func:`count_collectives` can log (the byte-counting tests use it).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .backends import backend_by_key
from .group_op import group_sum, segment_sum
from .layout import build_layout
from .ops.group import group_targets, reduce_groups
from .ops.linear import TiledLinearHead, TilePolicy

# ----------------------------------------------------------------------------- collectives


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as seen by the calling rank. ``payload_bytes``: the tensor this rank puts
    in (an all-gather's input, an all-reduce's buffer); ``output_bytes``: what it gets back."""

    op: str  # "all_gather" or "all_reduce"
    purpose: str
    world_size: int
    payload_bytes: int
    output_bytes: int


class CollectiveLog(List[CollectiveRecord]):
    """The collectives one rank issued inside :func:`count_collectives`, in order."""

    def payload_bytes(self, purpose: Optional[str] = None) -> int:
        return sum(r.payload_bytes for r in self if purpose is None or r.purpose == purpose)

    def received_bytes(self, purpose: Optional[str] = None) -> int:
        """Bytes that arrive from other ranks: ``(P-1) * payload`` for an all-gather,
        ``2 (P-1) / P * payload`` for a ring all-reduce (either direction)."""
        total = 0.0
        for r in self:
            if purpose is not None and r.purpose != purpose:
                continue
            p = r.world_size
            total += (p - 1) * r.payload_bytes if r.op == "all_gather" else 2 * (p - 1) / p * r.payload_bytes
        return int(round(total))


_LOGS: List[CollectiveLog] = []


@contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Log every collective tpo_kernels issues on this rank while the block runs (forward and
    backward)."""
    log = CollectiveLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def _record(op: str, purpose: str, world: int, payload: Tensor, output: Tensor) -> None:
    if not _LOGS:
        return
    record = CollectiveRecord(op, purpose, world, payload.numel() * payload.element_size(),
                              output.numel() * output.element_size())
    for log in _LOGS:
        log.append(record)


def all_gather_stacked(x: Tensor, group, purpose: str) -> Tensor:
    """``[P, *x.shape]``: every rank's ``x`` (same shape everywhere), in group rank order."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty(world * x.numel())  # the concatenated form (gloo has no stacked form)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.view(-1), group=group)
    _record("all_gather", purpose, world, x, out)
    return out.view(world, *x.shape)


def all_reduce_sum(x: Tensor, group, purpose: str) -> Tensor:
    """In-place sum of ``x`` over the group (the only float all-reduce: ``dH`` of the fused path)."""
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    _record("all_reduce", purpose, dist.get_world_size(group), x, x)
    return x


def _check_group(name: str, group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name} needs torch.distributed initialized (init_process_group)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")


class _GatherRows(torch.autograd.Function):
    """All-gather of ``[n_r, C]`` rows (``n_r`` may differ per rank) into ``[sum n_r, C]``.

    Backward: the computation downstream is replicated (every rank runs it on the same gathered
    rows), so the gradient of the gathered tensor is the same on every rank and its true backward,
    a reduce-scatter sum, is ``P`` times this rank's slice: no collective."""

    @staticmethod
    def forward(ctx, local: Tensor, group, sizes: Tuple[int, ...], rank: int, purpose: str) -> Tensor:
        width = max(sizes)
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[: local.shape[0]] = local
        stacked = all_gather_stacked(padded, group, purpose)
        ctx.start, ctx.count, ctx.world = sum(sizes[:rank]), local.shape[0], len(sizes)
        return torch.cat([stacked[r, :n] for r, n in enumerate(sizes)])

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[ctx.start: ctx.start + ctx.count] * ctx.world, None, None, None, None


def gather_rows(local: Tensor, group, sizes: Tuple[int, ...], purpose: str) -> Tensor:
    """Differentiable :class:`_GatherRows` (this rank's rows get ``P`` times their gradient)."""
    return _GatherRows.apply(local, group, tuple(sizes), dist.get_rank(group), purpose)


# ----------------------------------------------------------------------------- data parallel


class DataParallelGroups:
    """The group stage of sequence-level TPO when a batch is split over the ranks of
    ``process_group``.

    Grouping (the same kind on every rank): ``group_ids [N_r]`` hold global ids, a group being
    every completion with that id on any rank; ``group_size=K`` means K contiguous completions of
    the concatenation of the ranks' batches in rank order (a group may straddle ranks; only the
    total N must be a multiple of K). Ranks may hold different numbers of completions.
    """

    def __init__(self, process_group, group_size, group_ids, device: torch.device, input_name: str) -> None:
        _check_group("process_group", process_group)
        if (group_size is None) == (group_ids is None):
            raise ValueError("pass exactly one of group_size (K contiguous completions per prompt) or group_ids [N]")
        if group_size is not None:
            if not isinstance(group_size, int) or isinstance(group_size, bool):
                raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
            if group_size < 1:
                raise ValueError(f"group_size must be >= 1, got {group_size}")
        else:
            if not isinstance(group_ids, Tensor):
                raise TypeError(f"group_ids must be a torch.Tensor, got {type(group_ids).__name__}")
            if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
                raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
            if group_ids.device != device:
                raise ValueError(f"group_ids is on {group_ids.device} but {input_name} is on {device}")
        self.group, self.group_size, self.group_ids = process_group, group_size, group_ids

    @staticmethod
    def local_grouping() -> Tuple[int, None]:
        """``(group_size, group_ids)`` for checking the local batch: completions only (the real
        groups are formed after the gather), hence one group per completion."""
        return 1, None

    def loss(self, token_lp: Tensor, batch, settings, key: str):
        layout, acc = batch.layout, token_lp.dtype
        n = layout.num_seqs
        if self.group_ids is not None and tuple(self.group_ids.shape) != (n,):
            raise ValueError(f"group_ids must have shape [N]=({n},), got {tuple(self.group_ids.shape)}")
        columns = [segment_sum(token_lp, layout), batch.scores.to(acc)]
        has_old = batch.old_seq_logprobs is not None
        if has_old:
            columns.append(batch.old_seq_logprobs.to(acc))
        if batch.beta > 0:  # per-completion sums of the k3 term and of counted tokens
            diff = batch.ref_logprobs - token_lp
            k3 = torch.where(batch.valid, torch.exp(diff) - diff - 1.0, 0.0)
            columns += [segment_sum(k3, layout), segment_sum(batch.valid.to(acc), layout)]
        local = torch.stack(columns, dim=1)

        # Sizes, plus what every rank must agree on, so that a mismatch fails on every rank alike.
        kind = -1 if self.group_ids is None else -2
        meta = torch.tensor([n, local.shape[1], self.group_size or kind, int(batch.beta > 0), int(has_old)],
                            dtype=torch.int64, device=token_lp.device)
        metas = all_gather_stacked(meta, self.group, "sizes").tolist()
        if any(m[1:] != metas[0][1:] for m in metas):
            raise ValueError(
                "process_group: ranks disagree on the grouping (group_size / group_ids), on passing "
                f"old_logprobs or on beta > 0; per rank [N, columns, group_size, beta>0, old]: {metas}"
            )
        sizes = tuple(m[0] for m in metas)
        total, rank = sum(sizes), dist.get_rank(self.group)
        rows = gather_rows(local, self.group, sizes, "rows")
        if self.group_ids is None:
            if total % self.group_size != 0:
                raise ValueError(
                    f"group_size must divide the number of completions over all ranks, N={total} "
                    f"(per rank {list(sizes)}), got {self.group_size}"
                )
            global_layout = build_layout(total, token_lp.device, padded_shape=(total, 1), group_size=self.group_size)
        else:
            ids = self.group_ids.to(torch.int64)
            padded = ids.new_zeros(max(sizes))
            padded[:n] = ids
            stacked = all_gather_stacked(padded, self.group, "group_ids")
            global_ids = torch.cat([stacked[r, :m] for r, m in enumerate(sizes)])
            global_layout = build_layout(total, token_lp.device, padded_shape=(total, 1), group_ids=global_ids)

        ell = rows[:, 0].contiguous()
        scores = rows[:, 1].detach().contiguous()
        old = rows[:, 2].detach().contiguous() if has_old else None
        # Each completion is a "token" of a one-token sequence: the group op's layout is [N, 1].
        result = group_targets(ell, global_layout, scores, old_seq_logprobs=old, eta=settings.eta,
                               anchor=settings.anchor, backend=key)
        loss = reduce_groups(result.group_loss, settings.reduction)
        if batch.beta > 0:
            k3_sum, counted = rows[:, -2], rows[:, -1]
            if settings.reduction == "mean":
                kl = k3_sum.sum() / counted.sum()
            elif settings.reduction == "sum":
                kl = k3_sum.sum()
            else:
                kl = group_sum(k3_sum, global_layout) / group_sum(counted.detach(), global_layout)
            loss = loss + batch.beta * kl
        if not settings.return_aux:
            return loss
        mine = slice(sum(sizes[:rank]), sum(sizes[:rank]) + n)
        weight = 1.0 / global_layout.num_groups if settings.reduction == "mean" else 1.0
        aux = {
            "token_logprobs": token_lp.detach().view(batch.token_shape),
            "seq_logprobs": columns[0].detach(),
            "p": result.p[mine].detach(),
            "q": result.q[mine].detach(),
            "u": result.u[mine].detach(),
            "coef": ((result.p - result.q)[mine] * weight).detach(),
            "group_loss": result.group_loss.detach(),
            "seq_offset": mine.start,
        }
        return loss, aux


def data_parallel_groups(process_group, group_size, group_ids, device: torch.device, input_name: str,
                         shard: Optional["VocabShard"] = None) -> Optional[DataParallelGroups]:
    """None without a ``process_group`` (the single-process path), else the checked grouping.
    With a vocabulary ``shard`` too, the two groups must differ (a 2-D mesh): ranks splitting
    the batch hold different tokens, so they cannot also split one token's vocabulary."""
    if process_group is None:
        return None
    _check_group("process_group", process_group)
    if dist.get_world_size(process_group) == 1:  # nothing to gather: the single-process path
        return None
    groups = DataParallelGroups(process_group, group_size, group_ids, device, input_name)
    if shard is not None and _ranks(shard.group) == _ranks(process_group):
        raise ValueError(
            "the vocabulary is sharded over the ranks of process_group, which hold different completions; "
            "use a tensor-parallel group for the vocabulary (for FSDP2, call the loss inside the wrapped "
            "module's forward, where the lm_head weight is unsharded)"
        )
    return groups


def _ranks(group) -> List[int]:
    return list(dist.get_process_group_ranks(group))


# ----------------------------------------------------------------------------- vocabulary parallel


@dataclass(frozen=True)
class VocabShard:
    """This rank's contiguous slice ``[start, start + size)`` of a vocabulary of ``vocab_size``
    ids, split over ``group``."""

    group: object
    start: int
    size: int
    vocab_size: int


def _dtensor_type():
    # A DTensor can only exist once torch.distributed.tensor has been imported: avoid importing it.
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def _is_dtensor(x) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(x, cls)


def _dtensor_shard(name: str, x, dim: int, group, start: Optional[int]) -> Tuple[Tensor, VocabShard]:
    """The local shard of a DTensor sharded along ``dim`` (the vocabulary) on one mesh
    dimension and replicated on the others."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415

    dim = dim % x.dim()
    mesh, placements = x.device_mesh, x.placements
    sharded = [i for i, p in enumerate(placements) if type(p) is Shard and p.dim == dim]
    others_ok = all(isinstance(p, Replicate) for i, p in enumerate(placements) if i not in sharded)
    if len(sharded) != 1 or not others_ok:
        raise ValueError(
            f"{name} as a DTensor must be sharded on the vocabulary (dim {dim}) over one mesh dimension and "
            f"replicated on the others, got placements {placements}"
        )
    mesh_dim = sharded[0]
    mesh_group = mesh.get_group(mesh_dim)
    if group is not None and group is not mesh_group:
        raise ValueError(f"vocab_parallel_group differs from the mesh dimension {name} is sharded over")
    world, coord, vocab = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim), x.shape[dim]
    chunk = -(-vocab // world)  # DTensor's Shard splits like torch.chunk
    shard_start = min(coord * chunk, vocab)
    local = x.to_local()
    if local.shape[dim] != min(chunk, vocab - shard_start):
        raise ValueError(f"{name}: unexpected DTensor shard size {local.shape[dim]} for {vocab} ids over {world} ranks")
    if start is not None and start != shard_start:
        raise ValueError(f"vocab_start_index={start} but {name}'s DTensor shard starts at {shard_start}")
    return local, VocabShard(mesh_group, shard_start, local.shape[dim], vocab)


def vocab_shard(name: str, x, group, start, dim: int = -1) -> Tuple[Tensor, Optional[VocabShard]]:
    """Resolve a possibly vocabulary-sharded input: ``(local tensor, shard or None)``.

    A DTensor sharded along ``dim`` gives its local shard and its mesh dimension's group. A plain
    tensor with ``group`` is this rank's contiguous shard; shards are ordered by group rank
    (offset = sizes of the lower ranks) unless ``start`` gives the offset. Shard sizes (and the
    offsets) are all-gathered once, and the shards must tile ``[0, V)``."""
    if _is_dtensor(x):
        return _dtensor_shard(name, x, dim, group, start)
    if group is None:
        if start is not None:
            raise ValueError("vocab_start_index needs vocab_parallel_group")
        return x, None
    _check_group("vocab_parallel_group", group)
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
        raise ValueError(f"vocab_start_index must be an int >= 0 or None, got {start!r}")
    size = x.shape[dim]
    if size == 0:
        raise ValueError(f"{name} must hold at least one vocabulary entry on every rank")
    meta = torch.tensor([size, -1 if start is None else start], dtype=torch.int64, device=x.device)
    shards = all_gather_stacked(meta, group, "vocab_shards").tolist()
    explicit = [s for _, s in shards]
    if (start is None) != (explicit[0] == -1) or any((s == -1) != (explicit[0] == -1) for s in explicit):
        raise ValueError("vocab_start_index must be given on every rank of vocab_parallel_group or on none")
    if explicit[0] == -1:
        explicit = [sum(n for n, _ in shards[:r]) for r in range(len(shards))]
    spans = sorted(zip(explicit, (n for n, _ in shards)))
    vocab = sum(n for _, n in spans)
    if [s for s, _ in spans] != [sum(n for _, n in spans[:i]) for i in range(len(spans))]:
        raise ValueError(f"vocabulary shards (start, size) must tile [0, {vocab}) without gaps or overlap, got {spans}")
    rank = dist.get_rank(group)
    return x, VocabShard(group, explicit[rank], size, vocab)


def _merge_partials(lse: Tensor, target: Tensor, entropy: Optional[Tensor], counted: Tensor,
                    shard: VocabShard) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Per-token ``(lse, target, entropy | None)`` over the whole vocabulary from every rank's
    shard partials: one all-gather of ``[C, M]``, merged in rank order. ``target`` is 0 on
    ranks that do not own the label, so its sum is the owner's value exactly."""
    parts = [lse, target] if entropy is None else [lse, target, lse - entropy]  # S_r = sum_v p_v z_v
    gathered = all_gather_stacked(torch.stack(parts), shard.group, "partials")  # [P, C, M]
    shard_lse = gathered[:, 0]
    merged = torch.logsumexp(shard_lse, dim=0)
    merged_target = gathered[:, 1].sum(dim=0)
    merged_entropy = None
    if entropy is not None:
        merged_entropy = merged - (torch.exp(shard_lse - merged) * gathered[:, 2]).sum(dim=0)
        merged_entropy = torch.where(counted, merged_entropy, 0.0)
    return torch.where(counted, merged, 0.0), torch.where(counted, merged_target, 0.0), merged_entropy


def _shard_labels(labels: Tensor, shard: VocabShard) -> Tuple[Tensor, Tensor]:
    """``(owned, local)``: whether this shard holds the label, and its id in the shard."""
    local = labels - shard.start
    owned = (labels >= 0) & (local >= 0) & (local < shard.size)
    return owned, local


class _VocabParallelLogprobs(torch.autograd.Function):
    """Token log-probs (and entropies) of vocabulary-sharded ``[M, V_r]`` logits."""

    @staticmethod
    def forward(ctx, logits, labels, shard, inv_temperature, with_entropy, inplace_backward, key):
        counted = labels >= 0
        owned, local = _shard_labels(labels, shard)
        # Every counted row is read (label 0 stands in when another shard owns it).
        read_labels = torch.where(counted, torch.where(owned, local, 0), -1)
        lse, target, entropy = backend_by_key(key).row_forward(
            logits, read_labels, inv_temperature=inv_temperature, with_entropy=with_entropy
        )
        target = torch.where(owned, target, 0.0)
        lse, target, entropy = _merge_partials(lse, target, entropy, counted, shard)
        grad_labels = torch.where(owned, local, -1)
        ctx.save_for_backward(logits, grad_labels, counted, lse, entropy if with_entropy else None)
        ctx.settings = (inv_temperature, with_entropy, inplace_backward, key)
        return target - lse, entropy if with_entropy else lse.new_empty(0)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, grad_labels, counted, lse, entropy = ctx.saved_tensors
        inv_temperature, with_entropy, inplace_backward, key = ctx.settings
        grad_logprobs = torch.where(counted, grad_logprobs.to(lse.dtype), 0.0)
        if with_entropy and grad_entropy is not None:
            grad_entropy = torch.where(counted, grad_entropy.to(lse.dtype), 0.0)
        else:
            grad_entropy = entropy = None
        args = (grad_labels, lse, grad_logprobs, grad_entropy, entropy, inv_temperature, key)
        if inplace_backward:
            torch.ops.tpo_kernels.logprobs_backward_(logits, *args)
            grad = logits
        else:
            grad = torch.ops.tpo_kernels.logprobs_backward(logits, *args)
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: Tensor, labels: Tensor, shard: VocabShard, *, inv_temperature: float,
                            with_entropy: bool, inplace_backward: bool,
                            backend: str) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`tpo_kernels.ops.token_logprobs` of this rank's ``[M, V_r]`` logits shard: the same
    ``(logprobs [M], entropy [M] | None)`` on every rank of the shard's group, over the whole
    vocabulary. The logits gradient is local to the shard (no collective)."""
    logprobs, entropy = _VocabParallelLogprobs.apply(logits, labels, shard, inv_temperature, with_entropy,
                                                     inplace_backward, backend)
    return logprobs, (entropy if with_entropy else None)


class _VocabParallelLinearLogprobs(torch.autograd.Function):
    """Token log-probs (and entropies) of ``hidden @ weight_shard.T (+ bias_shard)``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, shard, inv_temperature, with_entropy, chunk_size, policy,
                grad_accum_dtype, key):
        head = TiledLinearHead(hidden, weight, bias, labels, backend_by_key(key), inv_temperature, chunk_size,
                               policy, vocab_offset=shard.start)
        lse, target, entropy = head.forward(with_entropy)
        lse, target, entropy = _merge_partials(lse, target, entropy, labels >= 0, shard)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy if with_entropy else None)
        ctx.settings = (shard, inv_temperature, with_entropy, chunk_size, policy, grad_accum_dtype, key)
        return target - lse, entropy if with_entropy else lse.new_empty(0)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        shard, inv_temperature, with_entropy, chunk_size, policy, grad_accum_dtype, key = ctx.settings
        counted = labels >= 0
        grad_logprobs = torch.where(counted, grad_logprobs.to(lse.dtype), 0.0)
        if with_entropy and grad_entropy is not None:
            grad_entropy = torch.where(counted, grad_entropy.to(lse.dtype), 0.0)
        else:
            grad_entropy = entropy = None
        head = TiledLinearHead(hidden, weight, bias, labels, backend_by_key(key), inv_temperature, chunk_size,
                               policy, vocab_offset=shard.start)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        grad_hidden, grad_weight, grad_bias = head.backward(lse, grad_logprobs, grad_entropy, entropy, needs,
                                                            grad_accum_dtype)
        if grad_hidden is not None:  # every shard's contribution to dH
            all_reduce_sum(grad_hidden, shard.group, "hidden_grad")
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def vocab_parallel_linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                                   shard: VocabShard, *, inv_temperature: float, with_entropy: bool,
                                   chunk_size: int, policy: TilePolicy, grad_accum_dtype: torch.dtype,
                                   backend: str) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`tpo_kernels.ops.linear_logprobs` with this rank's vocabulary shard of the head:
    the same ``(logprobs [M], entropy [M] | None)`` on every rank of the shard's group. Backward:
    ``dW`` / ``db`` of the shard, and ``dH`` summed over the group (one all-reduce)."""
    logprobs, entropy = _VocabParallelLinearLogprobs.apply(
        hidden, weight, bias, labels, shard, inv_temperature, with_entropy, chunk_size, policy,
        grad_accum_dtype, backend,
    )
    return logprobs, (entropy if with_entropy else None)


def vocab_parallel_head(hidden, weight, bias, group, start):
    """``(hidden, weight, bias, shard | None)``: the local tensors of an lm_head that may be
    split on the vocabulary (a plain shard with ``group``, or DTensors sharded on dim 0)."""
    weight, shard = vocab_shard("weight", weight, group, start, dim=0)
    if shard is None:
        return hidden, weight, bias, None
    hidden = replicated_local("hidden", hidden)
    if _is_dtensor(bias):
        bias, bias_shard = _dtensor_shard("bias", bias, 0, None, None)
        if (bias_shard.start, bias_shard.size) != (shard.start, shard.size):
            raise ValueError("bias must be sharded on the vocabulary like weight")
    return hidden, weight, bias, shard


def replicated_local(name: str, x):
    """A DTensor replicated on every mesh dimension (e.g. hidden states next to a
    vocabulary-sharded head) as its local tensor; anything else unchanged."""
    if not _is_dtensor(x):
        return x
    from torch.distributed.tensor import Replicate  # noqa: PLC0415

    if not all(isinstance(p, Replicate) for p in x.placements):
        raise ValueError(f"{name} as a DTensor must be replicated (the tokens of every vocabulary shard), "
                         f"got placements {x.placements}")
    return x.to_local()


__all__ = ["CollectiveLog", "CollectiveRecord", "DataParallelGroups", "VocabShard", "all_gather_stacked",
           "all_reduce_sum", "count_collectives", "data_parallel_groups", "gather_rows", "vocab_parallel_head",
           "vocab_parallel_linear_logprobs", "vocab_parallel_logprobs", "vocab_shard"]
