"""Triton group op (layer 2): one program per group computes what tpo_kernels.group_math does.

For group ``g`` with members ``i`` (``layout.group_members[group_offsets[g]:group_offsets[g+1]]``)::

    ell[i] = sum of token log-probs over rows [seq_start[i], seq_start[i] + seq_len[i])
    u[i]   = (s[i] - mean(s)) / std(s)   population std; u = 0 for all when max(s) == min(s);
                                         u = s[i] - mean(s) when std(s) <= score_eps
    p      = softmax(ell + lw)
    q      = softmax(ell_old + lw + u / eta)  (anchor; on-policy ell_old = ell), softmax(lw + u / eta)
    loss_g = -sum_i q[i] log p[i]

with ``lw`` the optional log-weights (``HAS_WEIGHTS``; 0 without): a member with ``lw = -inf``
leaves the lanes of u, p and q (p = q = 0, no loss term), and ``ell + lw`` and ``base + lw`` are one
same add, so the tied on-policy group below still gets ``p == q``.

Everything after the token loads runs in float64 (the sums over long completions and the
``[N]``-sized math lose digits in fp32; see :mod:`tpo_kernels.group_math`), written to float64
outputs that the wrapper casts to the token dtype. Scores are standardized from
``(s/2 - min/2) / (max/2 - min/2)`` as in :func:`tpo_kernels.group_math.standardize_dense`
(the near-tie test and the undivided centered scores too); loss
terms with ``q == 0`` count 0. Members sit in the lanes of a ``BLOCK_K`` vector. The token sums
walk a ``[BLOCK_K, BLOCK_T]`` tile along the sequences in a fixed order and reduce it once at
the end: deterministic, no atomics. Padded and packed layouts both carry ``seq_start``/``seq_len``, so one code path
serves both. p and q come out of the same softmax routine, so a tied on-policy group (u = 0,
q's input equal to p's bit for bit) gets ``p == q`` exactly.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...group_math import BatchLayout, GroupResult
from .kernel_support import device_guard, scalar_from_parts, split_scalar


@triton.jit
def _masked_softmax(x, valid, MAY_BE_EMPTY: tl.constexpr):
    """softmax and log-softmax of ``x`` over the ``valid`` lanes (invalid lanes: p = 0).
    ``MAY_BE_EMPTY`` (with weights only: a group whose every weight is 0 has no valid lane): then
    p = 0 everywhere and log p = -inf, as the portable group math gives."""
    x = tl.where(valid, x, float("-inf"))
    top = tl.max(x, axis=0)
    if MAY_BE_EMPTY:
        top = tl.where(top == float("-inf"), 0.0, top)
    shifted = x - top
    e = tl.exp(shifted)
    total = tl.sum(e, axis=0)
    if MAY_BE_EMPTY:
        total = tl.where(total == 0.0, 1.0, total)
    return e / total, shifted - tl.log(total)


@triton.jit
def _group_targets_kernel(
    token_logprobs_ptr,
    seq_start_ptr,
    seq_len_ptr,
    group_offsets_ptr,
    group_members_ptr,
    scores_ptr,
    old_ptr,
    log_weights_ptr,
    ell_ptr,
    u_ptr,
    p_ptr,
    q_ptr,
    group_loss_ptr,
    inv_eta_hi,
    inv_eta_mid,
    inv_eta_lo,
    half_eps_hi,
    half_eps_mid,
    half_eps_lo,
    HAS_OLD: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    ANCHOR: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    first = tl.load(group_offsets_ptr + group)
    size = tl.load(group_offsets_ptr + group + 1) - first
    lane = tl.arange(0, BLOCK_K)
    valid = lane < size
    member = tl.load(group_members_ptr + first + lane, mask=valid, other=0)

    # ell: per-member token sums over a [BLOCK_K, BLOCK_T] tile, fixed order.
    start = tl.load(seq_start_ptr + member, mask=valid, other=0)
    length = tl.load(seq_len_ptr + member, mask=valid, other=0)
    longest = tl.max(length, axis=0)
    steps = tl.arange(0, BLOCK_T)
    partial = tl.zeros([BLOCK_K, BLOCK_T], dtype=tl.float64)
    for offset in range(0, longest, BLOCK_T):
        t = offset + steps
        in_seq = valid[:, None] & (t[None, :] < length[:, None])
        rows = start[:, None] + t[None, :]
        partial += tl.load(token_logprobs_ptr + rows, mask=in_seq, other=0.0).to(tl.float64)
    ell = tl.sum(partial, axis=1)
    in_group = valid  # the lanes of ell; valid below: those of u, p and q (w > 0)
    if HAS_WEIGHTS:
        lw = tl.load(log_weights_ptr + member, mask=valid, other=0.0).to(tl.float64)
        valid = valid & (lw > float("-inf"))

    # u: standardized scores, population std; an all-tied group gets u = 0. From x = (s/2 -
    # min/2) / spread in [0, 1]: exact differences of nearby scores, no overflow or underflow.
    # A near tie, std(s) = 2 spread std(x) <= score_eps, keeps s - mean = 2 spread (x - mean(x)).
    scores = tl.load(scores_ptr + member, mask=valid, other=0.0).to(tl.float64)
    if HAS_WEIGHTS:  # the members with w > 0; none when every w is 0
        count = tl.maximum(tl.sum(valid.to(tl.float64), axis=0), 1.0)
    else:
        count = size.to(tl.float64)
    s_max = tl.max(tl.where(valid, scores, float("-inf")), axis=0)
    s_min = tl.min(tl.where(valid, scores, float("inf")), axis=0)
    tied = s_max == s_min
    shifted = tl.where(valid, scores * 0.5 - tl.where(tied, 0.0, s_min) * 0.5, 0.0)
    spread = tl.max(shifted, axis=0)
    flat = tied | (spread == 0)
    safe_spread = tl.where(flat, 1.0, spread)
    x = shifted / safe_spread
    mean = tl.sum(x, axis=0) / count
    centered = tl.where(valid, x - mean, 0.0)
    std = tl.sqrt(tl.sum(centered * centered, axis=0) / count)
    half_eps = scalar_from_parts(half_eps_hi, half_eps_mid, half_eps_lo, tl.float64)
    near_tie = std <= half_eps / safe_spread
    u = tl.where(near_tie, centered * (safe_spread * 2.0), centered / tl.where(flat, 1.0, std))
    u = tl.where(valid, u, 0.0)
    u = tl.where(flat, 0.0, u)

    inv_eta = scalar_from_parts(inv_eta_hi, inv_eta_mid, inv_eta_lo, tl.float64)
    if ANCHOR:
        if HAS_OLD:
            base = tl.load(old_ptr + member, mask=valid, other=0.0).to(tl.float64)
        else:
            base = ell  # on-policy: p_old = p
    else:
        base = tl.zeros([BLOCK_K], dtype=tl.float64)
    policy = ell
    if HAS_WEIGHTS:  # one same add into both softmax inputs
        policy = ell + lw
        base = base + lw
    p, log_p = _masked_softmax(policy, valid, HAS_WEIGHTS)
    q, _ = _masked_softmax(base + u * inv_eta, valid, HAS_WEIGHTS)
    # Invalid lanes and q == 0 count 0 (the limit, not 0 * -inf where log p = -inf).
    group_loss = -tl.sum(q * tl.where(q > 0, log_p, 0.0), axis=0)

    tl.store(ell_ptr + member, ell, mask=in_group)
    tl.store(u_ptr + member, u, mask=in_group)
    tl.store(p_ptr + member, p, mask=in_group)
    tl.store(q_ptr + member, q, mask=in_group)
    tl.store(group_loss_ptr + group, group_loss)


def _tile_sizes(layout: BatchLayout, block_t: Optional[int]):
    block_k = triton.next_power_of_2(max(int(layout.max_group_size), 1))
    if block_t is None:
        # Keep the [BLOCK_K, BLOCK_T] partial-sum tile at <= 2048 elements.
        longest = triton.next_power_of_2(max(int(layout.max_seq_len), 1))
        block_t = max(1, min(longest, 2048 // block_k))
    return block_k, int(block_t)


def fused_group_targets(
    token_logprobs: Tensor,
    layout: BatchLayout,
    scores: Tensor,
    *,
    old_seq_logprobs: Optional[Tensor] = None,
    eta: float,
    anchor: bool,
    score_eps: float = 0.0,
    seq_log_weights: Optional[Tensor] = None,
    block_t: Optional[int] = None,
) -> GroupResult:
    """Same contract as :func:`tpo_kernels.group_math.portable_group_targets`.

    ``block_t`` overrides the token tile width (tests use it to force several tiles)."""
    device = token_logprobs.device
    out_dtype = token_logprobs.dtype
    n, g = layout.num_seqs, layout.num_groups

    def zeros(size):  # completions outside every group keep 0
        return torch.zeros(size, dtype=torch.float64, device=device)

    ell, u, p, q, group_loss = zeros(n), zeros(n), zeros(n), zeros(n), zeros(g)
    if g > 0:
        token_logprobs = token_logprobs.contiguous()
        scores = scores.to(torch.float64).contiguous()
        has_old = old_seq_logprobs is not None
        old = old_seq_logprobs.to(torch.float64).contiguous() if has_old else scores  # placeholder when unused
        has_weights = seq_log_weights is not None
        log_weights = seq_log_weights.to(torch.float64).contiguous() if has_weights else scores
        block_k, block_t = _tile_sizes(layout, block_t)
        with device_guard(token_logprobs):
            _group_targets_kernel[(g,)](
                token_logprobs,
                layout.seq_start.contiguous(),
                layout.seq_len.contiguous(),
                layout.group_offsets.contiguous(),
                layout.group_members.contiguous(),
                scores,
                old,
                log_weights,
                ell,
                u,
                p,
                q,
                group_loss,
                *split_scalar(1.0 / eta),
                *split_scalar(0.5 * score_eps),  # in float32's range (checked with the settings)
                HAS_OLD=has_old,
                HAS_WEIGHTS=has_weights,
                ANCHOR=bool(anchor),
                BLOCK_K=block_k,
                BLOCK_T=block_t,
                num_warps=4,
            )
    return GroupResult(seq_logprobs=ell, u=u, p=p, q=q, group_loss=group_loss, coef=p - q).to(out_dtype)
