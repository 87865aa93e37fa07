"""Plain-PyTorch TPO: the semantic ground truth every kernel and path is checked against.

Written for clarity, not speed: full-vocab log_softmax, explicit loops over completions and
groups, and ordinary autograd for the gradients. Works in float64. Accepts the same arguments as
:func:`tpo_kernels.tpo_loss` (no validation: pass well-formed inputs).
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def tempered_logits(logits: Tensor, *, temperature: float = 1.0, logit_scale: float = 1.0,
                    logit_softcap: Optional[float] = None) -> Tensor:
    """The logits the softmax sees, in the compute dtype: the model's transform of its lm_head
    output (Cohere / Granite scale it; Gemma 2/3 soft-cap it, ``c * tanh(z / c)``), then the
    sampling temperature: ``softcap(logit_scale * z) / temperature``."""
    z = logits.to(_compute_dtype(logits.dtype)) * logit_scale
    if logit_softcap is not None:
        z = logit_softcap * torch.tanh(z / logit_softcap)
    return z / temperature


def kept_mask(sampling_mask, token_shape, vocab_size: int, device=None) -> Tensor:
    """``[*token_shape, V]`` bool: True at the ids of each token's kept set, from any form
    ``sampling_mask=`` takes (a SamplingMask, a ``(token_ids, offsets)`` CSR over the flat tokens,
    or padded ids ``[*token_shape, S]``, negative: none)."""
    num_tokens = int(torch.Size(token_shape).numel())
    keep = torch.zeros(num_tokens, vocab_size, dtype=torch.bool, device=device)
    if isinstance(sampling_mask, Tensor):
        ids = sampling_mask.reshape(num_tokens, -1).to(device=device, dtype=torch.int64)
        for token in range(num_tokens):
            row = ids[token]
            keep[token, row[row >= 0]] = True
    else:
        token_ids, offsets = (sampling_mask if isinstance(sampling_mask, tuple)
                              else (sampling_mask.token_ids, sampling_mask.offsets))
        offsets = offsets.tolist()
        for token in range(num_tokens):
            keep[token, token_ids[offsets[token]:offsets[token + 1]].to(device=device, dtype=torch.int64)] = True
    return keep.view(*token_shape, vocab_size)


def _restricted(logits: Tensor, keep: Optional[Tensor]) -> Tensor:
    """The tempered logits with the ids off each token's kept set at -inf (vLLM's recipe: the
    softmax renormalized over the set). A token with an empty set keeps every id: it does not
    count, and its row stays finite."""
    if keep is None:
        return logits
    keep = keep | ~keep.any(-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def token_logprobs(
    logits: Tensor, labels: Tensor, *, temperature: float = 1.0, ignore_index: int = -100, logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None, keep: Optional[Tensor] = None,
) -> Tensor:
    """log softmax(tempered_logits)[label] per token; 0 where ``labels == ignore_index``; over
    each token's kept set with ``keep`` (:func:`kept_mask`)."""
    log_probs = torch.log_softmax(_restricted(tempered_logits(logits, temperature=temperature, logit_scale=logit_scale,
                                                              logit_softcap=logit_softcap), keep), dim=-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0)
    picked = log_probs.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked))


def token_entropy(logits: Tensor, *, temperature: float = 1.0, logit_scale: float = 1.0,
                  logit_softcap: Optional[float] = None, keep: Optional[Tensor] = None) -> Tensor:
    """Entropy of softmax(tempered_logits) per token (0 log 0 = 0 at -inf logits); with ``keep``
    that of the softmax renormalized over each token's kept set."""
    log_probs = torch.log_softmax(_restricted(tempered_logits(logits, temperature=temperature, logit_scale=logit_scale,
                                                              logit_softcap=logit_softcap), keep), dim=-1)
    probs = log_probs.exp()
    return -(probs * torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))).sum(-1)


def selective_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    sampling_mask=None,
):
    """``sampling_mask``: each token's kept set (replay): the log-prob and entropy over it; a
    token with an empty set does not count (0)."""
    keep = None if sampling_mask is None else kept_mask(sampling_mask, labels.shape, logits.shape[-1], logits.device)
    if keep is not None:
        labels = torch.where(keep.any(-1), labels, ignore_index)
    transform = dict(temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap, keep=keep)
    lp = token_logprobs(logits, labels, ignore_index=ignore_index, **transform)
    if not return_entropy:
        return lp
    ent = token_entropy(logits, **transform)
    return lp, torch.where(labels != ignore_index, ent, torch.zeros_like(ent))


def standardize(scores: Tensor, score_eps: float = 0.0) -> Tensor:
    """Appendix A with the authors' near-tie rule: all zeros when the scores tie; ``s - mean``
    (not divided) when their population std is at most ``score_eps``; else ``(s - mean) / std``.

    u does not change when a constant is subtracted or the scores are scaled, so it is computed
    from ``(s - min) / (max - min)``: the difference of nearby scores is exact, and nothing
    underflows or overflows when squared (spreads of 1e-30 or 1e30 keep their u)."""
    if bool(scores.max() == scores.min()):
        return torch.zeros_like(scores)
    shifted = scores - scores.min()
    spread = shifted.max()
    x = shifted / spread
    mean = x.sum() / x.numel()
    std = (((x - mean) ** 2).sum() / x.numel()).sqrt()
    if bool(spread * std <= score_eps):  # spread * std is the population std of the scores
        return shifted - shifted.sum() / shifted.numel()  # s - mean(s), from the exact s - min
    return (x - mean) / std


def _sequence_slices(tokens: Tensor, cu_seqlens: Optional[Tensor]) -> List[tuple]:
    """(row index tensor into the flat token axis) for each completion of ``tokens`` ([N, T], or
    [M] packed by ``cu_seqlens``)."""
    if cu_seqlens is None:
        n, t = tokens.shape
        return [torch.arange(i * t, (i + 1) * t) for i in range(n)]
    bounds = cu_seqlens.tolist()
    return [torch.arange(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _groups(num_seqs: int, group_size: Optional[int], group_ids: Optional[Tensor]) -> List[List[int]]:
    if group_ids is None:
        return [list(range(g, g + group_size)) for g in range(0, num_seqs, group_size)]
    ids = group_ids.tolist()
    return [[i for i in range(num_seqs) if ids[i] == gid] for gid in sorted(set(ids))]


def tpo_loss(
    logits: Tensor,
    labels: Tensor,
    scores: Tensor,
    *,
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
    score_eps: float = 1e-6,
    length_normalize: bool = False,
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    reduction: str = "mean",
    return_aux: bool = False,
    seq_log_weights: Optional[Tensor] = None,
    sampling_mask=None,
):
    """TPO loss by the book (DESIGN.md section 1). Same arguments as :func:`tpo_kernels.tpo_loss`.

    ``seq_log_weights``: ``[N]`` log-weights ``lw = log w`` (finite or -inf): ``p ∝ w exp(ell)``,
    ``q ∝ w p_old exp(u / eta)`` (``p_old`` the unweighted softmax of ``ell_old``; ``q ∝ w
    exp(u / eta)`` without the anchor), ``u`` over the members with ``w > 0``; a completion with
    ``w = 0`` is left out of its group, and a group left with no member is dropped.

    ``length_normalize``: a completion's sequence log-prob is the mean of its counted token
    log-probs instead of the sum, and so is ``ell_old`` from per-token ``old_logprobs``; per
    completion ``[N]`` old log-probs are the sequence log-probs as they are (already means).

    ``entropy_coef``: the loss minus ``entropy_coef`` times the full-vocabulary entropy of the
    counted tokens, reduced as the KL term is (token mean for ``"mean"``, token sum for
    ``"sum"``, each group's token mean for ``"none"``), differentiable through ordinary autograd.

    ``sampling_mask``: each token's kept set (replay, :func:`kept_mask`): log-probs and entropies
    over it; a token with an empty set does not count."""
    valid = labels != ignore_index
    if mask is not None:
        valid = valid & mask.bool()
    keep = None if sampling_mask is None else kept_mask(sampling_mask, labels.shape, logits.shape[-1], logits.device)
    if keep is not None:
        valid = valid & keep.any(-1)
        labels = torch.where(valid, labels, ignore_index)
    transform = dict(temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap, keep=keep)
    lp = token_logprobs(logits, labels, ignore_index=ignore_index, **transform)
    entropy = token_entropy(logits, **transform) if entropy_coef != 0.0 else None
    return _group_stage(lp, scores, mask=valid, group_size=group_size, group_ids=group_ids, cu_seqlens=cu_seqlens,
                        old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, beta=beta, eta=eta, anchor=anchor,
                        score_eps=score_eps, length_normalize=length_normalize, reduction=reduction,
                        return_aux=return_aux, token_entropy=entropy, entropy_coef=entropy_coef,
                        seq_log_weights=seq_log_weights)


def tpo_loss_from_logprobs(
    logprobs: Tensor,
    scores: Tensor,
    *,
    mask: Optional[Tensor] = None,
    group_size: Optional[int] = None,
    group_ids: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    old_logprobs: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    beta: float = 0.0,
    eta: float = 1.0,
    anchor: bool = True,
    score_eps: float = 1e-6,
    length_normalize: bool = False,
    reduction: str = "mean",
    return_aux: bool = False,
    seq_log_weights: Optional[Tensor] = None,
):
    """The group stage by the book on per-token log-probs ``[N, T]`` (or ``[M]`` packed with
    ``cu_seqlens``); same arguments as :func:`tpo_kernels.tpo_loss_from_logprobs`."""
    return _group_stage(logprobs, scores, mask=mask, group_size=group_size, group_ids=group_ids,
                        cu_seqlens=cu_seqlens, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, beta=beta,
                        eta=eta, anchor=anchor, score_eps=score_eps, length_normalize=length_normalize,
                        reduction=reduction, return_aux=return_aux, seq_log_weights=seq_log_weights)


def _group_stage(logprobs: Tensor, scores: Tensor, *, mask, group_size, group_ids, cu_seqlens, old_logprobs,
                 ref_logprobs, beta, eta, anchor, score_eps, length_normalize, reduction, return_aux,
                 token_entropy: Optional[Tensor] = None, entropy_coef: float = 0.0,
                 seq_log_weights: Optional[Tensor] = None):
    """The group stage, the KL term and the entropy bonus (``token_entropy`` of the shape of
    ``logprobs``, used when ``entropy_coef != 0``)."""
    valid = torch.ones(logprobs.shape, dtype=torch.bool, device=logprobs.device) if mask is None else mask.bool()
    lp = torch.where(valid, logprobs, torch.zeros_like(logprobs)).reshape(-1)
    valid_flat = valid.reshape(-1)
    dtype = lp.dtype
    slices = _sequence_slices(logprobs, cu_seqlens)
    num_seqs = len(slices)

    def sequence_logprob(token_values: Tensor, rows: Tensor) -> Tensor:
        total = token_values[rows].sum()
        if not length_normalize:
            return total
        return total / valid_flat[rows].sum().clamp(min=1)  # mean over the counted tokens

    ell = torch.stack([sequence_logprob(lp, rows) for rows in slices])
    if old_logprobs is None:  # on-policy: p_old = p, held constant
        ell_old = ell.detach()
    elif old_logprobs.shape == logprobs.shape:  # per-token old log-probs, summed (or averaged) under the mask
        old_flat = torch.where(valid, old_logprobs.to(dtype), torch.zeros((), dtype=dtype)).reshape(-1)
        ell_old = torch.stack([sequence_logprob(old_flat, rows) for rows in slices])
    else:  # per-sequence [N], as given
        ell_old = old_logprobs.to(dtype)

    groups = _groups(num_seqs, group_size, group_ids)
    lw = torch.zeros(num_seqs, dtype=dtype) if seq_log_weights is None else seq_log_weights.to(dtype)
    # w = 0 leaves a completion out of its group (no mass, no gradient); an emptied group is dropped.
    groups = [kept for kept in ([i for i in members if lw[i] > float("-inf")] for members in groups) if kept]
    group_losses, ps, qs, us = [], torch.zeros(num_seqs, dtype=dtype), torch.zeros(num_seqs, dtype=dtype), torch.zeros(num_seqs, dtype=dtype)
    for members in groups:
        idx = torch.tensor(members)
        u = standardize(scores[idx].to(dtype), score_eps)
        log_p = torch.log_softmax(ell[idx] + lw[idx], dim=0)  # Eq. 1, p ∝ w exp(ell)
        if anchor:  # q ∝ w * p_old * exp(u / eta), p_old unweighted
            q = torch.softmax(torch.log_softmax(ell_old[idx], dim=0) + lw[idx] + u / eta, dim=0)
        else:
            q = torch.softmax(lw[idx] + u / eta, dim=0)
        q = q.detach()
        # Eq. 3; a term with q == 0 is 0 (its limit), also where log p = -inf (a -inf label logit).
        group_losses.append(-(q * torch.where(q > 0, log_p, torch.zeros_like(log_p))).sum())
        ps[idx], qs[idx], us[idx] = log_p.detach().exp(), q, u
    group_loss = torch.stack(group_losses)

    # Token terms beside the group term, (weight, per-token values 0 where not counted): the k3
    # KL penalty and the entropy bonus, each reduced the same way.
    token_terms = []
    if beta != 0.0:
        r = ref_logprobs.to(dtype).reshape(-1)
        diff = r - lp
        k3 = torch.exp(diff) - diff - 1.0
        token_terms.append((beta, torch.where(valid_flat, k3, torch.zeros_like(k3))))
    if entropy_coef != 0.0:
        entropy = token_entropy.to(dtype).reshape(-1)
        token_terms.append((-entropy_coef, torch.where(valid_flat, entropy, torch.zeros_like(entropy))))

    if reduction == "mean":
        loss = group_loss.mean()
        for weight, values in token_terms:
            loss = loss + weight * values.sum() / valid_flat.sum()
    elif reduction == "sum":
        loss = group_loss.sum()
        for weight, values in token_terms:
            loss = loss + weight * values.sum()
    else:  # "none": per group, each with its own token means
        loss = group_loss
        for weight, values in token_terms:
            per_group = []
            for members in groups:
                rows = torch.cat([slices[i] for i in members])
                per_group.append(values[rows].sum() / valid_flat[rows].sum())
            loss = loss + weight * torch.stack(per_group)

    if not return_aux:
        return loss
    aux = {
        "token_logprobs": lp.detach().view(logprobs.shape),
        "seq_logprobs": ell.detach(),
        "p": ps,
        "q": qs,
        "u": us,
        "group_loss": group_loss.detach(),
    }
    return loss, aux


def token_tpo_loss(
    logits: Tensor,
    candidates: Tensor,
    scores: Tensor,
    *,
    old_logprobs: Optional[Tensor] = None,
    eta: float = 1.0,
    anchor: bool = True,
    score_eps: float = 1e-6,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    reduction: str = "mean",
    return_aux: bool = False,
):
    """Token-level TPO by the book (DESIGN.md section 1, paper Sec. 3.4). Same arguments as
    :func:`tpo_kernels.token_tpo_loss` (``return_aux``: also ``[R, K]`` ``p``, ``q``, ``u`` and the
    tempered ``candidate_logits``).

    Full-vocab log-probs, gathered at the K candidates of each state (a repeated id is gathered
    twice: two members); then Eq. 1-3 per state with the candidate log-probs as the group logits.
    """
    tempered = tempered_logits(logits, temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap)
    log_probs = torch.log_softmax(tempered, dim=-1)
    cand_logprobs = log_probs.gather(1, candidates)
    dtype = cand_logprobs.dtype
    state_losses, ps, qs, us = [], [], [], []
    for r in range(cand_logprobs.shape[0]):
        u = standardize(scores[r].to(dtype), score_eps)
        log_p = torch.log_softmax(cand_logprobs[r], dim=0)  # Eq. 1 over the K candidates
        if anchor:  # q ∝ p_old * exp(u / eta); on-policy p_old = p, held constant
            old = cand_logprobs[r].detach() if old_logprobs is None else old_logprobs[r].to(dtype)
            q = torch.softmax(torch.log_softmax(old, dim=0) + u / eta, dim=0)
        else:
            q = torch.softmax(u / eta, dim=0)
        q = q.detach()
        state_losses.append(-(q * torch.where(q > 0, log_p, torch.zeros_like(log_p))).sum())  # Eq. 3
        ps.append(log_p.detach().exp())
        qs.append(q)
        us.append(u)
    state_loss = torch.stack(state_losses)
    if reduction == "mean":
        loss = state_loss.mean()
    elif reduction == "sum":
        loss = state_loss.sum()
    else:
        loss = state_loss
    if not return_aux:
        return loss
    aux = {"candidate_logits": tempered.gather(1, candidates).detach(),
           "p": torch.stack(ps), "q": torch.stack(qs), "u": torch.stack(us), "state_loss": state_loss.detach()}
    return loss, aux
