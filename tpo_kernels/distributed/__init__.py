"""TPO across devices: groups split over data-parallel ranks, completions split over context-parallel
ranks, and a vocabulary-parallel lm_head.

This package holds the leaves the one pipeline (:mod:`tpo_kernels.functional`) calls when a call
spans ranks: the collectives, the agreement record every call exchanges before its first
collective that could wait on a peer (:mod:`.agreement`: a local failure or a disagreement
becomes the same error on every rank), the vocabulary shard seam (:class:`VocabShard`), the
group gather (:class:`GroupGather`) and the context sum (:class:`ContextSum`), and the trainers' own exchanges (:mod:`.rows`, through the
integration kit). It runs no group math of its own; what a rank's vocabulary is (a DTensor's
shard, a plain shard of ``vocab_parallel_group``) is resolved by the plan
(:mod:`tpo_kernels.plan.vocabulary`), and the one check left here is the shards tiling ``[0, V)``,
on the agreed sizes (:mod:`tpo_kernels.checks.placement`).

Three independent modes, combinable on a 3-D (data x context x tensor) mesh:

**Data parallel** (``process_group=`` on every loss: :func:`~tpo_kernels.tpo_loss`,
:func:`~tpo_kernels.fused_linear_tpo_loss`, :func:`~tpo_kernels.tpo_loss_from_logprobs` and the
token-level two). The completions of one group may live on different ranks. The row op (the
vocabulary-sized work) stays local; the group stage needs only per-completion numbers, so each
rank sends its ``[N_r, C]`` rows (sequence log-prob, score, kept, old sequence log-prob, KL sums,
in float64) plus an int64 group id per completion, and every rank runs the same group stage on
the gathered ``[N, C]``. Nothing token- or vocabulary-sized crosses ranks. Token-level TPO
gathers its ``[R_r * K]`` candidates the same way, each state a group.

Contract: every rank returns the loss of the *concatenated* batch (same value on every rank, so
the mean of the ranks' losses is the global loss), and its backward sends into this rank's
tokens ``P`` times their gradient of that loss (``P`` the size of ``process_group``). Data
parallelism (DDP's all-reduce, FSDP2's reduce-scatter) averages parameter gradients over the
``P`` ranks, so every parameter receives exactly the gradient of single-process training on the
concatenated batch. The factor ``P`` is not a convention picked for DDP: the gather's true
backward is a reduce-scatter (sum over ranks) of identical gradients, which equals ``P`` times the
local one, so no backward collective is needed.

**Context parallel** (``context_parallel_group=`` on the sequence-level losses). Every rank of the
group holds the same completions (``N``, scores, groups, per-completion old log-probs) and its
own positions of each, in any split (contiguous, the load-balanced head-tail chunks of torch's
``context_parallel``, padded ``[N, T_r]`` or packed with this rank's ``cu_seqlens``); per-token
inputs are split like the logits. Each rank sums its counted tokens per completion into ``[N, C]``
float64 partials (log-prob, count, then old log-prob, k3 and entropy sums when used), one
all-reduce adds them (:class:`ContextSum`), and every rank runs the same group stage on the sums:
a completion with no counted token on any rank is left out, length normalization divides by the
global count, token means run over every rank's tokens. Nothing in the backward. Contract: every
rank returns the loss of the whole batch and gives its tokens ``D * S`` times their gradient of it
(``S`` context ranks, ``D`` data ranks); averaging over data x context (FSDP2 / HSDP over a mesh
dimension that includes the context ranks) gives the one-process gradient (derivation:
:mod:`.context_parallel`). A wrapper that sums over the context ranks instead divides the loss by
``S``. The label shift is the caller's, as in one process: shift the whole sequence, then split
inputs and labels with one index map (``context_parallel(buffers=[inputs, labels])`` does);
shifting each rank's shard (``labels = local_inputs[:, 1:]``) loses a label at every shard
boundary and misaligns the next, which no loss can detect.

**Vocabulary parallel** (``vocab_parallel_group=`` on the fused-linear and logits functions). Each
rank holds a contiguous vocabulary shard of the lm_head (weight ``[V_r, H]``, bias ``[V_r]``) or of
the logits (``[M, V_r]``), and the same tokens (hidden ``[M, H]`` and labels, replicated in the
group). Each rank summarizes its shard per token as a
:class:`~tpo_kernels.backends.rows.RowSummary` (row max, log-sum, the label's log-prob and
whether the shard holds the label, the entropy on request); one all-gather of the ``[C, M]``
partials (``C`` = 4 fields, 5 with the entropy) lets every rank merge them in rank order with
:meth:`~tpo_kernels.backends.rows.RowSummary.merge` (deterministic, identical on every rank). The
backward is local on the shard (``dW``, ``db`` or the logits gradient of the shard) plus, for the
fused path, the one all-reduce of ``dH`` that any tensor-parallel linear layer needs.

Every collective goes through :func:`all_gather_stacked` or :func:`all_reduce_sum`, which
:func:`count_collectives` can log (the byte-counting tests use it), the trainer integrations' own
too (:mod:`.rows`: :func:`gather_rows`, :func:`sum_over_ranks`, :func:`token_mean`, exported by
:mod:`tpo_kernels.kit`).

Whatever a rank's checks raise before the agreement (an argument check, the backend's resolution,
a placement, shard or cache-budget check; any exception type) travels in it: every rank of the
call's groups raises the same error, naming the failing global rank (and its group rank on a 2-D
mesh), instead of waiting for that rank at a collective until the process group's timeout.

The keywords of the public functions (collectives run eagerly, not under ``torch.compile``; traced
with ``fullgraph=True`` a distributed call stops with an error saying so):
    process_group: the data-parallel group over which the batch's completions are split (the
        sequence-level losses). Groups may straddle ranks (``group_ids`` global; ``group_size``
        counts over the concatenation of the ranks' batches in rank order) and ranks may hold
        different N. Only ``[N]``-sized rows are all-gathered. Every rank returns the loss of the
        whole batch and gives its tokens ``P`` times their gradient of it, so that after DDP /
        FSDP2 averaging every parameter has the single-process gradient of the whole batch.
        A rank may hold no completion, or none with a counted token. ``aux`` has every key of the
        single-process aux: per-token and per-completion entries of this rank's completions
        (``seq_offset``: the first one's global index), per-group entries of every group.
    vocab_parallel_group, vocab_start_index: this rank holds a contiguous vocabulary shard of the
        logits ``[..., V_r]`` or of the lm_head (weight ``[V_r, H]``, bias ``[V_r]``), with the same
        tokens on every rank of the group. Shards are in group-rank order unless
        ``vocab_start_index`` gives this shard's first id. A DTensor weight / logits sharded on the
        vocabulary needs neither. Per-token partials are all-gathered (``[4 or 5, M]``); the
        fused path's backward all-reduces ``dH``. Results are the same on every rank of the group.
    context_parallel_group: every rank holds the same completions and its own positions of each
        (see "Context parallel" above). One all-reduce of ``[N, C]`` float64 partials (``C`` = 2
        to 5), nothing in the backward. ``aux``: per-completion and per-group entries of the whole
        completions, per-token ones at this rank's positions.
"""
from .agreement import agree
from .collectives import count_collectives
from .context_parallel import ContextSum
from .data_parallel import GroupGather
from .rows import RowGather, gather_rows, sum_over_ranks, token_mean
from .vocab_parallel import VocabShard

__all__ = ["ContextSum", "GroupGather", "RowGather", "VocabShard", "agree", "count_collectives", "gather_rows",
           "sum_over_ranks", "token_mean"]
