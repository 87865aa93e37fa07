"""Fused hidden x lm_head path: TPO loss and per-token log-probs from the last hidden states and
the lm_head weight, without ever materializing the ``[tokens, vocab]`` logits.

Logits ``z = h @ W.T (+ b)`` exist one tile at a time: a block of tokens times a block of the
vocabulary, at most ``chunk_size * V`` entries. The forward keeps, per token, the tempered
logsumexp and target logit (and entropy on request), merged exactly across vocabulary blocks; the
group stage is :class:`~tpo_kernels.autograd.TPOObjective`, shared with the logits path. Every
path's backward is a per-token scalar ``g`` times ``(onehot - softmax) / tau`` (plus an entropy
term), so the backward recomputes the logits of the tokens with a nonzero ``g`` only, tile by
tile, turns them in place into ``dz`` with the backend's row backward (the forward's logsumexp
covers the whole vocabulary, so a block's softmax is exact), and applies the chain rule of the
linear layer::

    dH[rows] += dz @ W[block]          dW[block] += dz.T @ h[rows]          db[block] += dz.sum(0)

Tokens of tied on-policy groups (``g == 0`` exactly) cost no backward matmul at all. Tiles span
many tokens so that the matmuls run at full speed and the ``dW`` accumulation stays compute-bound;
a ``dW`` accumulator wider than the weight dtype (fp32 for a bf16 head) is kept per vocabulary
block, so it stays small.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._validate import (
    FLOAT_DTYPES,
    _check_integer,
    check_flag,
    check_float_tensor,
    check_labels,
    check_positive,
    check_reduction,
    check_same_device,
    prepare_batch,
)
from .autograd import TPOObjective
from .backends import Backend, compute_dtype, get_backend

# Memory budget of one tile of logits, in fp32 bytes (the default chunk_size is this budget in
# rows of V). Tiles take their shape from LinearRows._tile, so the budget only bounds memory: a
# small one on the CPU keeps the peak below that of chunked cross-entropy implementations (the
# torch fallback's row ops also make a few fp32 temporaries of a tile).
_CHUNK_BYTES = {"cuda": 512 << 20}
_CHUNK_BYTES_DEFAULT = 6 << 20
_CHUNK_ALIGN = 16  # rows
# Vocabulary blocks are multiples of 128 entries, so that a tile's rows (its matmul leading
# dimension) stay aligned for vector loads and tensor-core matmuls.
_VOCAB_ALIGN = 128
# Largest weight-gradient accumulator kept in a dtype wider than the weight's (e.g. fp32 for a
# bf16 lm_head); larger heads accumulate one vocabulary block at a time.
_ACCUM_BYTES = 256 << 20
# Rows a tile should span (see LinearRows._tile): enough for full-speed matmuls and for the
# weight-gradient matmul not to be bound by re-reading its accumulator.
_TILE_TOKENS = {"cuda": 4096}
_TILE_TOKENS_DEFAULT = 512


def default_chunk_size(num_rows: int, vocab_size: int, device: torch.device) -> int:
    """``chunk_size`` (tile budget in rows of V) when none is given: as many rows as fit the
    device's budget in fp32 (the row ops compute in fp32 whatever the input dtype), rounded down to
    a multiple of 16, at most ``num_rows``."""
    budget = _CHUNK_BYTES.get(device.type, _CHUNK_BYTES_DEFAULT)
    rows = budget // (4 * max(vocab_size, 1))
    if rows > _CHUNK_ALIGN:
        rows -= rows % _CHUNK_ALIGN
    return max(1, min(rows, num_rows))


def _add_product(out: Tensor, rows: Union[slice, Tensor], a: Tensor, b: Tensor) -> None:
    """``out[rows] += a @ b``: in place without a temporary when ``rows`` is a slice and the dtypes
    match; otherwise the product is formed in the inputs' dtype and summed in ``out``'s."""
    if isinstance(rows, slice) and out.dtype == a.dtype:
        out[rows].addmm_(a, b)
        return
    product = (a @ b).to(out.dtype)
    if isinstance(rows, slice):
        out[rows] += product
    else:  # distinct rows: every entry gets exactly one addition, so the result is deterministic
        out.index_add_(0, rows, product)


class LinearRows:
    """One linear head applied to a flat token matrix, one tile of logits at a time.

    ``hidden`` is ``[M, H]`` contiguous, ``weight`` ``[V, H]``, ``bias`` ``[V]`` or None, all of
    one dtype; ``labels`` is ``[M]`` int64 with negatives marking rows that do not count. A tile
    never holds more than ``chunk_size * V`` logits.
    """

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        labels: Tensor,
        backend: Backend,
        inv_temperature: float,
        chunk_size: int,
    ) -> None:
        self.hidden, self.weight, self.bias, self.labels = hidden, weight, bias, labels
        self.backend, self.inv_temperature, self.chunk_size = backend, inv_temperature, chunk_size

    @staticmethod
    def _row_chunks(selected: Tensor, chunk_size: int) -> List[Union[slice, Tensor]]:
        """Row indices of the ``selected`` ([M] bool) rows in ascending order, ``chunk_size`` at a
        time: slices when every row is selected (no gather), index tensors otherwise."""
        num_rows = selected.numel()
        rows = torch.nonzero(selected).squeeze(1)
        if rows.numel() == num_rows:
            return [slice(start, min(start + chunk_size, num_rows)) for start in range(0, num_rows, chunk_size)]
        return list(rows.split(chunk_size)) if rows.numel() > 0 else []

    def _logits(self, h_rows: Tensor, vocab: slice, buffer: Tensor) -> Tensor:
        """``h_rows @ W[vocab].T (+ b[vocab])`` written into a contiguous view of the buffer."""
        weight = self.weight[vocab]
        out = buffer[: h_rows.shape[0] * weight.shape[0]].view(h_rows.shape[0], weight.shape[0])
        if self.bias is None:
            return torch.mm(h_rows, weight.t(), out=out)
        return torch.addmm(self.bias[vocab], h_rows, weight.t(), out=out)

    def _buffer(self, rows: int, vocab: int) -> Tensor:
        return self.hidden.new_empty(max(rows, 1) * vocab)

    def forward(self, with_entropy: bool) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """Per-row ``(lse, target, entropy | None)`` of the tempered logits, in the compute dtype;
        0 on rows that do not count (their logits are never computed).

        Tiles are token chunks (outer loop) times vocabulary blocks (inner); the blocks' partial
        results merge exactly: ``lse = logaddexp`` over blocks, the target logit comes from the
        block holding the label, and the entropy from ``S = sum_v p_v z_v`` (``H = lse - S``),
        where block ``b`` contributes ``exp(lse_b - lse) * (lse_b - H_b)``."""
        num_rows, vocab_size = self.hidden.shape[0], self.weight.shape[0]
        acc = compute_dtype(self.hidden.dtype)
        lse = self.hidden.new_zeros(num_rows, dtype=acc)
        target = torch.zeros_like(lse)
        entropy = torch.zeros_like(lse) if with_entropy else None
        counted = self.labels >= 0
        num_counted = int(counted.sum())
        token_block, vocab_block = self._tile(num_counted, self.weight.dtype)
        buffer = self._buffer(min(token_block, num_counted), vocab_block)
        for rows in self._row_chunks(counted, token_block):
            h_rows, labels = self.hidden[rows], self.labels[rows]
            for start in range(0, vocab_size, vocab_block):
                logits = self._logits(h_rows, slice(start, start + vocab_block), buffer)
                local = labels - start
                inside = (local >= 0) & (local < logits.shape[1])
                # Every row is read: a label outside the block stands in as 0, its target unused.
                block_lse, block_target, block_entropy = self.backend.row_forward(
                    logits, torch.where(inside, local, 0), self.inv_temperature, with_entropy
                )
                block_target = torch.where(inside, block_target, 0.0)
                block_sum = block_lse - block_entropy if with_entropy else None  # S_b
                if start == 0:
                    row_lse, row_target, row_sum = block_lse, block_target, block_sum
                    continue
                merged = torch.logaddexp(row_lse, block_lse)
                if with_entropy:
                    row_sum = row_sum * torch.exp(row_lse - merged) + block_sum * torch.exp(block_lse - merged)
                row_lse, row_target = merged, row_target + block_target
            lse[rows], target[rows] = row_lse, row_target
            if with_entropy:
                entropy[rows] = row_lse - row_sum
        return lse, target, entropy

    def backward(
        self,
        lse: Tensor,
        grad_logprob: Tensor,
        grad_entropy: Optional[Tensor],
        entropy: Optional[Tensor],
        needs_grad: Tuple[bool, bool, bool],
        grad_accum_dtype: torch.dtype,
    ) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """Gradients of hidden, weight and bias (None where ``needs_grad`` is False) given the
        per-row gradients of the log-probs and entropies (both 0 on rows that do not count).

        Rows where both are exactly 0 are skipped: no recompute, no matmul. Tiles (see
        :meth:`_tile`) are vocabulary blocks (outer loop) times token chunks (inner);
        ``dW`` and ``db`` are summed over token chunks in ``grad_accum_dtype``, ``dH`` over
        vocabulary blocks (in that dtype too when there is more than one block).
        """
        need_hidden, need_weight, need_bias = needs_grad
        hidden, weight = self.hidden, self.weight
        vocab_size, hidden_size = weight.shape
        active = grad_logprob != 0
        if grad_entropy is not None:
            active = active | (grad_entropy != 0)
        num_active = int(active.sum())
        token_block, vocab_block = self._tile(num_active, grad_accum_dtype)
        if vocab_block == vocab_size:
            hidden_accum = hidden.dtype
        else:
            hidden_accum = torch.promote_types(grad_accum_dtype, hidden.dtype)

        chunks = self._row_chunks(active, token_block)
        # The tile buffer first: the size of the forward's, it can take that freed memory.
        buffer = self._buffer(min(token_block, num_active), vocab_block) if chunks else None
        grad_hidden = hidden.new_zeros(hidden.shape, dtype=hidden_accum) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = weight.new_zeros(vocab_size, dtype=grad_accum_dtype) if need_bias else None
        if chunks:  # else every row has zero signal: zero gradients, no matmul
            block_accum = None
            if need_weight and grad_accum_dtype != weight.dtype:
                block_accum = weight.new_empty(vocab_block, hidden_size, dtype=grad_accum_dtype)
            for start in range(0, vocab_size, vocab_block):
                vocab = slice(start, min(start + vocab_block, vocab_size))
                if need_weight:
                    dw = grad_weight[vocab] if block_accum is None else block_accum[: vocab.stop - start].zero_()
                for rows in chunks:
                    h_rows = hidden[rows]
                    dlogits = self._block_grad(h_rows, rows, vocab, buffer, lse, grad_logprob, grad_entropy, entropy)
                    if need_hidden:
                        _add_product(grad_hidden, rows, dlogits, weight[vocab])
                    if need_weight:
                        _add_product(dw, slice(None), dlogits.t(), h_rows)
                    if need_bias:
                        grad_bias[vocab] += dlogits.sum(dim=0, dtype=grad_accum_dtype)
                if block_accum is not None:
                    grad_weight[vocab] = dw
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            grad_weight,
            None if grad_bias is None else grad_bias.to(weight.dtype),
        )

    def _tile(self, num_rows: int, grad_accum_dtype: torch.dtype) -> Tuple[int, int]:
        """(tokens, vocabulary entries) of one tile of logits over ``num_rows`` rows. A tile holds
        at most ``chunk_size * V`` logits and is cut along the vocabulary so that it spans at
        least ``_TILE_TOKENS`` rows: matmuls of few rows run far below the machine's peak, and
        in the backward each tile's ``dW[block] += dz.T @ h`` reads and writes the ``[block, H]``
        accumulator (8 bytes per entry against ``2 * tokens`` flops). A ``dW`` accumulator wider
        than the weight dtype is also capped at ``_ACCUM_BYTES``."""
        vocab_size, hidden_size = self.weight.shape
        logits_budget = self.chunk_size * vocab_size
        vocab_block = vocab_size
        if grad_accum_dtype != self.weight.dtype:
            itemsize = torch.finfo(grad_accum_dtype).bits // 8
            vocab_block = _ACCUM_BYTES // (itemsize * max(hidden_size, 1))
        min_tokens = _TILE_TOKENS.get(self.hidden.device.type, _TILE_TOKENS_DEFAULT)
        tokens = max(self.chunk_size, min(min_tokens, num_rows))
        vocab_block = max(1, min(vocab_block, logits_budget // tokens))
        if _VOCAB_ALIGN < vocab_block < vocab_size:
            vocab_block -= vocab_block % _VOCAB_ALIGN
        return max(1, logits_budget // vocab_block), vocab_block

    def _block_grad(self, h_rows, rows, vocab: slice, buffer, lse, grad_logprob, grad_entropy, entropy) -> Tensor:
        """dz for one tile (token rows x vocabulary block), written in place over the recomputed
        logits in the buffer. ``lse`` covers the whole vocabulary, so a block's softmax is exact."""
        dlogits = self._logits(h_rows, vocab, buffer)
        labels = self.labels[rows] - vocab.start  # label ids local to the block, -1 outside it
        labels = torch.where((labels >= 0) & (labels < dlogits.shape[1]), labels, -1)
        self.backend.row_backward(
            dlogits,
            labels,
            lse[rows],
            grad_logprob[rows],
            None if grad_entropy is None else grad_entropy[rows],
            None if entropy is None else entropy[rows],
            self.inv_temperature,
            dlogits,
        )
        return dlogits


class FusedLinearTPOFunction(torch.autograd.Function):
    """Fused-linear TPO: tiled row forward -> group op -> (backward) tiled recompute and row
    backward of the tokens with a nonzero coefficient only."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        objective: TPOObjective,
        backend: Backend,
        inv_temperature: float,
        chunk_size: int,
        grad_accum_dtype: torch.dtype,
    ):
        head = LinearRows(hidden, weight, bias, objective.batch.labels, backend, inv_temperature, chunk_size)
        lse, target, _ = head.forward(with_entropy=False)
        loss = objective.forward(target - lse, backend)  # both 0 on rows that do not count
        ctx.save_for_backward(hidden, weight, bias, lse)
        ctx.objective, ctx.backend = objective, backend
        ctx.inv_temperature, ctx.chunk_size, ctx.grad_accum_dtype = inv_temperature, chunk_size, grad_accum_dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: Tensor):
        hidden, weight, bias, lse = ctx.saved_tensors
        needs_grad = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        objective = ctx.objective
        head = LinearRows(
            hidden, weight, bias, objective.batch.labels, ctx.backend, ctx.inv_temperature, ctx.chunk_size
        )
        grads = head.backward(lse, objective.token_grad(grad_loss), None, None, needs_grad, ctx.grad_accum_dtype)
        return (*grads, None, None, None, None, None)


class FusedLinearLogprobsFunction(torch.autograd.Function):
    """Per-token log-probs (and entropies) of ``h @ W.T (+ b)``; the backward is the tiled
    recompute with the generic row backward."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        labels: Tensor,
        backend: Backend,
        inv_temperature: float,
        with_entropy: bool,
        chunk_size: int,
        grad_accum_dtype: torch.dtype,
    ):
        head = LinearRows(hidden, weight, bias, labels, backend, inv_temperature, chunk_size)
        lse, target, entropy = head.forward(with_entropy)
        token_logprobs = target - lse
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.backend, ctx.inv_temperature, ctx.chunk_size = backend, inv_temperature, chunk_size
        ctx.grad_accum_dtype = grad_accum_dtype
        if with_entropy:
            return token_logprobs, entropy
        return token_logprobs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprob: Tensor, grad_entropy: Optional[Tensor] = None):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        needs_grad = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        skipped = labels < 0  # rows that do not count have no gradient
        grad_logprob = torch.where(skipped, 0.0, grad_logprob.to(lse.dtype))
        if grad_entropy is not None:
            grad_entropy = torch.where(skipped, 0.0, grad_entropy.to(lse.dtype))
        head = LinearRows(hidden, weight, bias, labels, ctx.backend, ctx.inv_temperature, ctx.chunk_size)
        grads = head.backward(lse, grad_logprob, grad_entropy, entropy, needs_grad, ctx.grad_accum_dtype)
        return (*grads, None, None, None, None, None, None)


def _check_head(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    """hidden ``[..., H]``, weight ``[V, H]``, bias ``[V]``: one dtype, one device."""
    check_float_tensor("hidden", hidden, (2, 3))
    check_float_tensor("weight", weight, (2,))
    if weight.shape[0] == 0:
        raise ValueError("weight must have a non-empty vocabulary dimension (shape [V, H] with V > 0)")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape [V, H] with H={hidden.shape[-1]} (the last dim of hidden), "
            f"got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have the dtype of hidden ({hidden.dtype}), got {weight.dtype}")
    check_same_device("weight", weight, hidden.device, "hidden")
    if bias is None:
        return
    check_float_tensor("bias", bias, (1,))
    if bias.shape[0] != weight.shape[0]:
        raise ValueError(f"bias must have shape [V]=({weight.shape[0]},), got {tuple(bias.shape)}")
    if bias.dtype != hidden.dtype:
        raise TypeError(f"bias must have the dtype of hidden ({hidden.dtype}), got {bias.dtype}")
    check_same_device("bias", bias, hidden.device, "hidden")


def _check_chunk_size(chunk_size, num_rows: int, vocab_size: int, device: torch.device) -> int:
    if chunk_size is None:
        return default_chunk_size(num_rows, vocab_size, device)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (tokens per logits chunk), got {chunk_size}")
    return chunk_size


def _check_grad_accum_dtype(grad_accum_dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of dW and db, never narrower than the weight's own dtype."""
    if grad_accum_dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"grad_accum_dtype must be torch.float32, float64 or the weight dtype, got {grad_accum_dtype!r}"
        )
    return torch.promote_types(grad_accum_dtype, weight_dtype)


def _flat_hidden(hidden: Tensor) -> Tensor:
    return hidden.reshape(-1, hidden.shape[-1]).contiguous()


def fused_linear_tpo_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    scores: Tensor,
    *,
    bias: Optional[Tensor] = None,
    group_size: Optional[int] = None,
    group_ids: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    ignore_index: int = -100,
    old_logprobs: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    beta: float = 0.0,
    eta: float = 1.0,
    anchor: bool = True,
    temperature: float = 1.0,
    reduction: str = "mean",
    backend: str = "auto",
    return_aux: bool = False,
    chunk_size: Optional[int] = None,
    grad_accum_dtype: torch.dtype = torch.float32,
) -> Union[Tensor, Tuple[Tensor, dict]]:
    """Sequence-level TPO loss on ``logits = hidden @ weight.T (+ bias)``, computed tile by tile
    so that at most ``chunk_size * V`` logits exist at once.

    Same semantics and keywords as :func:`tpo_kernels.tpo_loss` (see there for ``labels``,
    ``scores``, groups, ``mask``, old / reference log-probs, ``beta``, ``eta``, ``anchor``,
    ``temperature``, ``reduction``, ``backend`` and ``return_aux``). Gradients flow to
    ``hidden``, ``weight`` and ``bias``.

    Args:
        hidden: ``[N, T, H]`` padded or ``[M, H]`` packed (with ``cu_seqlens``) last hidden states;
            ``hidden[n, t]`` predicts ``labels[n, t]`` (already shifted).
        weight: ``[V, H]`` lm_head weight, dtype and device of ``hidden``.
        bias: optional ``[V]`` lm_head bias.
        chunk_size: at most ``chunk_size * V`` logits exist at once (one tile: a block of tokens
            times a block of the vocabulary); default from a memory budget (512 MiB of fp32
            logits on CUDA, 6 MiB on CPU).
        grad_accum_dtype: dtype in which ``dW`` and ``db`` are summed over tiles (float32 by
            default; pass the weight dtype to save memory); never narrower than the weight's.
            When wider than the weight dtype (a bf16 head), ``dW`` is accumulated one vocabulary
            block of at most 256 MiB at a time.

    The backward recomputes the logits of the tokens whose loss gradient is nonzero; tokens of
    groups whose scores tie (on-policy, ``beta == 0``) cost no matmul. Double backward is not
    supported.
    """
    _check_head(hidden, weight, bias)
    eta = check_positive("eta", eta)
    temperature = check_positive("temperature", temperature)
    reduction = check_reduction(reduction)
    anchor = check_flag("anchor", anchor)
    return_aux = check_flag("return_aux", return_aux)
    chosen = get_backend(backend, hidden.device)
    vocab_size = weight.shape[0]
    batch = prepare_batch(
        hidden.shape[:-1],
        vocab_size,
        hidden.device,
        compute_dtype(hidden.dtype),
        labels,
        scores,
        group_size=group_size,
        group_ids=group_ids,
        cu_seqlens=cu_seqlens,
        mask=mask,
        ignore_index=ignore_index,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        beta=beta,
        input_name="hidden",
    )
    flat = _flat_hidden(hidden)
    chunk_size = _check_chunk_size(chunk_size, flat.shape[0], vocab_size, hidden.device)
    accum = _check_grad_accum_dtype(grad_accum_dtype, weight.dtype)
    objective = TPOObjective(batch, eta=eta, anchor=anchor, reduction=reduction, beta=float(beta))
    loss = FusedLinearTPOFunction.apply(flat, weight, bias, objective, chosen, 1.0 / temperature, chunk_size, accum)
    if return_aux:
        return loss, objective.aux()
    return loss


def fused_linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    chunk_size: Optional[int] = None,
    backend: str = "auto",
    grad_accum_dtype: torch.dtype = torch.float32,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Per-token ``log softmax((hidden @ weight.T + bias) / temperature)[labels]`` without
    materializing the logits; differentiable with respect to hidden, weight and bias.

    ``hidden`` is ``[N, T, H]`` or ``[M, H]`` and ``labels`` its leading shape. Returns float32 log-probs of the
    labels' shape (float64 for float64 inputs), 0 where ``labels == ignore_index``; with
    ``return_entropy`` also the per-token entropy of the tempered distribution (0 at ignored
    positions), whose gradient flows too. Under ``torch.no_grad()`` this is the memory-light
    way to get old / reference log-probs from a model's hidden states. ``chunk_size`` and
    ``grad_accum_dtype`` as in :func:`fused_linear_tpo_loss`.
    """
    _check_head(hidden, weight, bias)
    temperature = check_positive("temperature", temperature)
    return_entropy = check_flag("return_entropy", return_entropy)
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    check_same_device("labels", labels, hidden.device, "hidden")
    _check_integer("labels", labels)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels must have shape {tuple(hidden.shape[:-1])} (the leading dims of hidden), got {tuple(labels.shape)}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    chosen = get_backend(backend, hidden.device)
    vocab_size = weight.shape[0]
    flat_labels = labels.reshape(-1)
    counted = flat_labels != ignore_index
    check_labels("labels", flat_labels, counted, vocab_size)
    flat_labels = torch.where(counted, flat_labels.to(torch.int64), -1).contiguous()
    flat = _flat_hidden(hidden)
    chunk_size = _check_chunk_size(chunk_size, flat.shape[0], vocab_size, hidden.device)
    accum = _check_grad_accum_dtype(grad_accum_dtype, weight.dtype)
    out = FusedLinearLogprobsFunction.apply(
        flat, weight, bias, flat_labels, chosen, 1.0 / temperature, return_entropy, chunk_size, accum
    )
    if return_entropy:
        token_logprobs, entropy = out
        return token_logprobs.view(labels.shape), entropy.view(labels.shape)
    return out.view(labels.shape)
