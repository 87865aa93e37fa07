"""The steps every public function runs, shared (layer 3): checked settings and batch, the row
op on a whole or vocabulary-sharded head, and the group stage with its aux."""

from __future__ import annotations

from typing import Optional, Tuple, Union

from torch import Tensor

from .. import _validate as check
from .. import distributed
from .._dtypes import compute_dtype
from ..backends import get_backend
from ..layout import candidate_layout
from .group import GroupObjective
from .linear import TilePolicy, linear_logprobs
from .logprobs import token_logprobs
from .transform import LogitTransform, folded_inv_temperature

LossOutput = Union[Tensor, Tuple[Tensor, dict]]


def sequence_setup(inputs: Tensor, vocab_size: int, input_name: str, labels, scores, backend,
                    settings: dict, batch: dict, process_group=None, shard=None):
    """Checked settings, the backend, the prepared batch of a sequence-level loss and, when its
    groups are split over data-parallel ranks, how to gather them."""
    settings = check.check_settings(**settings)
    chosen = get_backend(backend, inputs.device)
    data_parallel = distributed.data_parallel_groups(process_group, batch["group_size"], batch["group_ids"],
                                                     inputs.device, input_name, shard)
    if data_parallel is not None:  # the local batch is checked per completion; groups form after the gather
        batch["group_size"], batch["group_ids"] = data_parallel.local_grouping()
    batch = check.prepare_batch(inputs.shape[:-1], vocab_size, inputs.device, compute_dtype(inputs.dtype), labels,
                                scores, input_name=input_name, validate=settings.validate, **batch)
    return settings, chosen, batch, data_parallel


def row_logprobs(matrix: Tensor, labels: Tensor, shard, *, inv_temperature: float, logit_scale: float,
                 logit_softcap: Optional[float], **settings):
    """The logits row op, on a vocabulary shard when ``shard`` says so."""
    if shard is None:
        return token_logprobs(matrix, labels, inv_temperature=inv_temperature, logit_scale=logit_scale,
                              logit_softcap=logit_softcap, **settings)
    inv_temperature = _shard_inv_temperature(inv_temperature, logit_scale, logit_softcap)
    return distributed.vocab_parallel_logprobs(matrix, labels, shard, inv_temperature=inv_temperature, **settings)


def head_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, shard, *,
                  inv_temperature: float, logit_scale: float, logit_softcap: Optional[float], **settings):
    """The fused-linear row op, on a vocabulary shard of the head when ``shard`` says so."""
    if shard is None:
        return linear_logprobs(hidden, weight, bias, labels, inv_temperature=inv_temperature, logit_scale=logit_scale,
                               logit_softcap=logit_softcap, **settings)
    inv_temperature = _shard_inv_temperature(inv_temperature, logit_scale, logit_softcap)
    return distributed.vocab_parallel_linear_logprobs(hidden, weight, bias, labels, shard,
                                                      inv_temperature=inv_temperature, **settings)


def _shard_inv_temperature(inv_temperature: float, logit_scale: float, logit_softcap: Optional[float]) -> float:
    """A vocabulary shard's row ops take the scale folded into ``inv_temperature``; a soft cap
    is not wired through the shard merge."""
    if logit_softcap is not None:
        raise ValueError("logit_softcap is not supported with a vocabulary-parallel head or logits "
                         "(vocab_parallel_group / DTensor shards); logit_scale is")
    return folded_inv_temperature(inv_temperature, logit_scale, None)


def transformed_candidates(gather, settings: check.LossSettings) -> Tensor:
    """Tempered candidate logits through the logit transform. ``gather(inv_temperature)`` gives
    ``[R, K]`` candidate logits times that factor: the scale folds in without a cap; with one,
    the raw logits are gathered and capped in plain autograd (``[R, K]`` entries only)."""
    transform = LogitTransform.of(settings.logit_scale, settings.logit_softcap)
    if transform is None:
        return gather(folded_inv_temperature(settings.inv_temperature, settings.logit_scale, None))
    return transform.differentiable(gather(1.0)) * settings.inv_temperature


def sequence_loss(token_lp: Tensor, batch: check.PreparedBatch, settings: check.LossSettings, key: str,
                   entropy: Optional[Tensor] = None,
                   data_parallel: Optional[distributed.DataParallelGroups] = None) -> LossOutput:
    """The group stage of sequence-level TPO on flat token log-probs, and its aux (with the token
    entropies of the same vocabulary pass, when computed)."""
    if data_parallel is not None:  # groups spread over ranks: gather [N]-sized rows first
        return data_parallel.loss(token_lp, batch, settings, key)
    objective = GroupObjective(
        batch.layout, batch.scores, old_seq_logprobs=batch.old_seq_logprobs, eta=settings.eta,
        anchor=settings.anchor, reduction=settings.reduction, backend=key, beta=batch.beta,
        ref_logprobs=batch.ref_logprobs, valid=batch.valid,
    )
    loss = objective.forward(token_lp)
    if not settings.return_aux:
        return loss
    aux = objective.aux()
    aux["token_logprobs"] = aux["token_logprobs"].view(batch.token_shape)
    if entropy is not None:
        aux["token_entropy"] = entropy.detach().view(batch.token_shape)
    return loss, aux


def candidate_loss(cand_logits: Tensor, scores: Tensor, old_logprobs: Optional[Tensor],
                    settings: check.LossSettings, key: str) -> LossOutput:
    """The group stage of token-level TPO: each state's K candidates form a group."""
    num_states, num_cand = cand_logits.shape
    objective = GroupObjective(
        candidate_layout(num_states, num_cand, cand_logits.device), scores.reshape(-1),
        old_seq_logprobs=None if old_logprobs is None else old_logprobs.reshape(-1), eta=settings.eta,
        anchor=settings.anchor, reduction=settings.reduction, backend=key,
    )
    loss = objective.forward(cand_logits.reshape(-1))
    if not settings.return_aux:
        return loss
    aux = objective.aux()
    state_loss = aux.pop("group_loss")
    aux = {name: aux[name].view(num_states, num_cand) for name in ("seq_logprobs", "p", "q", "u", "coef")}
    aux["candidate_logits"] = aux.pop("seq_logprobs")
    aux["state_loss"] = state_loss
    return loss, aux


def rows(x: Tensor) -> Tuple[Tensor, bool]:
    """``[..., D]`` as a ``[M, D]`` matrix the row ops read in place (unit column stride, rows
    that flatten into one row stride >= D), else a contiguous copy; True when that needed a copy."""
    width = x.shape[-1]
    row_stride = _flat_row_stride(x)
    if x.numel() > 0 and x.stride(-1) == 1 and row_stride is not None and row_stride >= width:
        return x.reshape(-1, width), False  # a view
    return x.reshape(-1, width).contiguous(), True


def logits_rows(x: Tensor, shard=None) -> Tuple[Tensor, bool]:
    """:func:`rows` for the log-prob row op, which also reads ``[B, T, V]`` logits whose rows do
    not flatten into one row stride (``logits[:, :-1]``) piece by piece: such logits pass as they
    are, instead of a copy (which would triple the peak memory of the logits path). A vocabulary
    shard's row op takes a matrix."""
    if (shard is None and x.dim() == 3 and x.numel() > 0 and x.stride(-1) == 1 and _flat_row_stride(x) is None
            and x.stride(1) >= x.shape[2] and x.stride(0) >= x.shape[1] * x.stride(1)):  # rows never overlap
        return x, False
    return rows(x)


def _flat_row_stride(x: Tensor) -> Optional[int]:
    """The row stride of ``x`` flattened to ``[M, D]`` without a copy, or None when its leading
    dims do not merge (``logits[:, :-1]``: the rows of consecutive batch entries are further
    apart than those within one). Size-1 dims do not count."""
    dims = [(size, stride) for size, stride in zip(x.shape[:-1], x.stride()[:-1]) if size != 1]
    for (_, outer_stride), (inner_size, inner_stride) in zip(dims, dims[1:]):
        if outer_stride != inner_size * inner_stride:
            return None
    return dims[-1][1] if dims else x.shape[-1]


def linear_setup(hidden, weight, bias, chunk_size, grad_accum_dtype, tile_policy):
    check.check_head(hidden, weight, bias)
    chunk_size = check.check_chunk_size(chunk_size)
    accum = check.check_grad_accum_dtype(grad_accum_dtype, weight.dtype)
    check.check_tile_policy(tile_policy, TilePolicy)
    policy = tile_policy or TilePolicy.for_device(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    if chunk_size is None:  # the tile budget, in rows of V
        chunk_size = policy.chunk_size(flat.shape[0], weight.shape[0])
    return flat, dict(chunk_size=chunk_size, policy=policy, grad_accum_dtype=accum)
