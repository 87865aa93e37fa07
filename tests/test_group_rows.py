"""The group stage's context seam in one process: each completion's positions split over ``S``
stand-in ranks, a :class:`~tpo_kernels.ops.group.RowSum` that adds the other ranks' partials
(computed beforehand from their tokens) to this rank's.

Specification: every rank's loss and aux equal one process on the concatenated tokens; every
rank's tokens get ``S`` times their one-process gradient (the seam's backward, no collective);
length normalization divides by the summed count, and a completion is kept iff a token counts on
some rank; without a seam, the group stage is bitwise the composition it always was
(tests/_group_stage.py). The multi-process runs: tests/test_context_parallel.py.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import pytest
import torch
from torch import Tensor

from tpo_kernels.backends import backend_key, get_backend
from tpo_kernels.group_math import GroupRule, build_layout, length_weights, segment_sum
from tpo_kernels.ops.group import CompletionInputs, GroupObjective, LossWeights, RankSeams, group_targets

from _backends import DEVICE_BACKENDS

N, K, T = 6, 3, 8
TOL = {torch.float64: dict(atol=1e-12, rtol=1e-12), torch.float32: dict(atol=5e-5, rtol=2e-4)}
CPU = torch.device("cpu")


@dataclasses.dataclass
class Tokens:
    """A padded ``[N, T]`` batch of per-token row-op outputs (what the group stage reads)."""

    logprobs: Tensor
    entropy: Tensor
    ref: Tensor
    old: Tensor  # per token
    old_seq: Tensor  # per completion
    valid: Tensor
    scores: Tensor


def _tokens(dtype: torch.dtype, seed: int = 0) -> Tokens:
    gen = torch.Generator().manual_seed(seed)
    valid = torch.rand(N, T, generator=gen) < 0.7
    valid[:, 0] = True
    return Tokens(logprobs=-torch.rand(N, T, generator=gen, dtype=torch.float64).to(dtype) * 3,
                  entropy=torch.rand(N, T, generator=gen, dtype=torch.float64).to(dtype) * 2,
                  ref=-torch.rand(N, T, generator=gen, dtype=torch.float64).to(dtype) * 3,
                  old=-torch.rand(N, T, generator=gen, dtype=torch.float64) * 3,
                  old_seq=-torch.rand(N, generator=gen, dtype=torch.float64) * 10,
                  valid=valid, scores=torch.randn(N, generator=gen, dtype=torch.float64))


def _positions(world: int, kind: str) -> List[Tensor]:
    """Each rank's positions of every completion: contiguous pieces, or the load-balanced
    head-tail chunks (rank r holds chunks r and 2S-1-r), or a random partition."""
    if kind == "contiguous":
        return list(torch.arange(T).tensor_split(world))
    if kind == "head_tail":
        chunks = torch.arange(T).chunk(2 * world)
        return [torch.cat([chunks[r], chunks[2 * world - 1 - r]]) for r in range(world)]
    owner = torch.randperm(T, generator=torch.Generator().manual_seed(1)) % world
    return [torch.nonzero(owner == r).squeeze(1) for r in range(world)]


class OtherRanks:
    """A stand-in for the context group: ``world`` ranks, the others' partials fixed."""

    def __init__(self, others: Tensor, world: int) -> None:
        self.others, self.world, self.calls = others, world, 0

    def sum(self, partials: Tensor) -> Tensor:
        self.calls += 1
        return partials + self.others


@dataclasses.dataclass
class Setting:
    backend: str = "torch"
    reduction: str = "mean"
    beta: float = 0.0
    entropy_coef: float = 0.0
    length_normalize: bool = False
    old: Optional[str] = None  # "token" or "seq"


def _objective(tok: Tokens, positions: Tensor, setting: Setting, seams: RankSeams = RankSeams(),
               members: Optional[Tensor] = None):
    """The group stage over ``positions`` of every completion, with leaf token inputs: returns
    (objective, token log-probs leaf, entropy leaf). Without a context seam it is one process on
    those positions (``members``: the completions kept, as the checks would leave them)."""
    width = positions.numel()
    valid = tok.valid[:, positions].reshape(-1)
    layout = build_layout(N * width, CPU, padded_shape=(N, width), group_size=K, members=members)
    lp_leaf = tok.logprobs[:, positions].clone().requires_grad_(True)
    ent_leaf = tok.entropy[:, positions].clone().requires_grad_(True)
    old_seq = old_token_sums = None
    old_tokens = torch.where(valid, tok.old[:, positions].reshape(-1), 0.0)
    if setting.old == "seq":
        old_seq = tok.old_seq
    elif setting.old == "token" and seams.context is not None:
        old_token_sums = segment_sum(old_tokens, layout)
    elif setting.old == "token":  # one process: summed, or averaged, as the checks prepare it
        weights = length_weights(valid, layout, torch.float64) if setting.length_normalize else 1.0
        old_seq = segment_sum(old_tokens * weights, layout)
    completions = CompletionInputs(scores=tok.scores, old_seq_logprobs=old_seq, old_token_sums=old_token_sums,
                                   kept_after_sum=seams.context is not None)
    objective = GroupObjective(
        layout, completions, rule=GroupRule(length_normalize=setting.length_normalize),
        weights=LossWeights(reduction=setting.reduction, beta=setting.beta, entropy_coef=setting.entropy_coef),
        backend=backend_key(get_backend(setting.backend, CPU)), valid=valid, seams=seams,
        ref_logprobs=torch.where(valid, tok.ref[:, positions].reshape(-1), 0.0) if setting.beta else None)
    return objective, lp_leaf, ent_leaf


def _run(objective: GroupObjective, lp_leaf: Tensor, ent_leaf: Tensor) -> Tensor:
    valid = objective.valid
    loss = objective.forward(torch.where(valid, lp_leaf.reshape(-1), 0.0),
                             torch.where(valid, ent_leaf.reshape(-1), 0.0))
    (loss.sum() if loss.dim() else loss).backward()
    return loss.detach()


def _ranks(tok: Tokens, world: int, kind: str, setting: Setting):
    """Every stand-in rank's loss, aux, token gradients and seam."""
    positions = _positions(world, kind)
    partials = []
    for pos in positions:
        objective, lp, ent = _objective(tok, pos, setting, RankSeams(context=OtherRanks(0.0, world)))
        valid = objective.valid
        partials.append(objective.partials(torch.where(valid, lp.reshape(-1), 0.0),
                                           torch.where(valid, ent.reshape(-1), 0.0)).detach())
    out = []
    for r, pos in enumerate(positions):
        seam = OtherRanks(sum(p for s, p in enumerate(partials) if s != r), world)
        objective, lp, ent = _objective(tok, pos, setting, RankSeams(context=seam))
        loss = _run(objective, lp, ent)
        out.append(dict(positions=pos, loss=loss, aux=objective.aux(), grad_lp=lp.grad, grad_ent=ent.grad,
                        seam=seam))
    return out


def _one_process(tok: Tokens, setting: Setting):
    counted = tok.valid.any(dim=1)
    objective, lp, ent = _objective(tok, torch.arange(T), setting, members=None if counted.all() else counted)
    loss = _run(objective, lp, ent)
    return dict(loss=loss, aux=objective.aux(), grad_lp=lp.grad, grad_ent=ent.grad)


SETTINGS = {
    "plain": Setting(),
    "kl_entropy_length_normalized_token_old": Setting(beta=0.1, entropy_coef=0.01, length_normalize=True,
                                                      old="token"),
    "sum_kl_seq_old": Setting(reduction="sum", beta=0.2, old="seq"),
    "none_entropy_token_old": Setting(reduction="none", entropy_coef=0.05, old="token"),
    "length_normalized_seq_old": Setting(length_normalize=True, old="seq"),
}


def _assert_matches_one_process(ranks, whole, dtype):
    tol = TOL[dtype]
    for r, rank in enumerate(ranks):
        torch.testing.assert_close(rank["loss"], whole["loss"], **tol, msg=lambda m: f"rank {r} loss: {m}")
        for name in ("seq_logprobs", "p", "q", "u", "coef", "group_loss", "kl_q_p", "entropy_p", "entropy_q"):
            torch.testing.assert_close(rank["aux"][name], whole["aux"][name], **tol,
                                       msg=lambda m, n=name: f"rank {r} aux {n}: {m}")
        assert torch.equal(rank["aux"]["zero_signal"], whole["aux"]["zero_signal"])
        whole_tokens = whole["aux"]["token_logprobs"].view(N, T)[:, rank["positions"]]
        assert torch.equal(rank["aux"]["token_logprobs"], whole_tokens.reshape(-1))  # this rank's positions
        assert "seq_offset" not in rank["aux"]  # every completion is this rank's


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("setting", SETTINGS.values(), ids=SETTINGS.keys())
@pytest.mark.parametrize("world,kind", [(2, "head_tail"), (3, "contiguous"), (2, "random")])
def test_loss_and_aux_equal_one_process_on_the_concatenated_tokens(backend, dtype, setting, world, kind):
    tok, setting = _tokens(dtype), dataclasses.replace(setting, backend=backend)
    _assert_matches_one_process(_ranks(tok, world, kind, setting), _one_process(tok, setting), dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("setting", SETTINGS.values(), ids=SETTINGS.keys())
@pytest.mark.parametrize("world,kind", [(2, "head_tail"), (3, "random")])
def test_each_rank_gives_its_tokens_world_times_their_gradient(dtype, setting, world, kind):
    """The seam's backward scales by the number of ranks and calls no collective: the one sum
    is the forward's."""
    tok = _tokens(dtype)
    whole = _one_process(tok, setting)
    for rank in _ranks(tok, world, kind, setting):
        pos = rank["positions"]
        torch.testing.assert_close(rank["grad_lp"] / world, whole["grad_lp"][:, pos], **TOL[dtype])
        if setting.entropy_coef:
            torch.testing.assert_close(rank["grad_ent"] / world, whole["grad_ent"][:, pos], **TOL[dtype])
        assert rank["seam"].calls == 1


def test_length_normalization_divides_by_the_summed_count():
    """Completion 0 has 1 counted token on rank 0 and 3 on rank 1: its sequence log-prob is the
    mean over the 4, on both ranks (a rank-local count would give other values on each)."""
    tok = _tokens(torch.float64)
    tok.valid[0] = torch.tensor([True, False, False, False, True, True, True, False])
    setting = Setting(length_normalize=True)
    ranks = _ranks(tok, 2, "contiguous", setting)
    want = tok.logprobs[0][tok.valid[0]].mean()
    for rank in ranks:
        torch.testing.assert_close(rank["aux"]["seq_logprobs"][0], want, atol=1e-12, rtol=1e-12)
        counted = tok.valid[0][rank["positions"]]
        # d loss / d lp_t = coef / n with n = 4, times the 2 ranks.
        want_grad = (rank["aux"]["coef"][0] / 4).expand(int(counted.sum()))
        torch.testing.assert_close(rank["grad_lp"][0][counted] / 2, want_grad, atol=1e-12, rtol=1e-12)


def test_a_completion_is_kept_iff_a_token_counts_on_some_rank():
    """Completion 1 counts only at rank 1's positions, completion 4 nowhere: on rank 0 (where
    neither counts) completion 1 keeps its place in its group and completion 4 is left out
    (``p = q = 0``, no gradient), as in one process."""
    tok = _tokens(torch.float64)
    tok.valid[1] = torch.arange(T) >= T // 2
    tok.valid[4] = False
    ranks = _ranks(tok, 2, "contiguous", Setting(beta=0.1))
    whole = _one_process(tok, Setting(beta=0.1))
    _assert_matches_one_process(ranks, whole, torch.float64)
    for rank in ranks:
        assert rank["aux"]["p"][1] > 0 and rank["aux"]["p"][4] == 0 and rank["aux"]["q"][4] == 0
        assert (rank["grad_lp"][4] == 0).all()
    assert (ranks[1]["grad_lp"][1] != 0).any()


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("setting", [Setting(), Setting(length_normalize=True, old="token")],
                         ids=["plain", "length_normalized_token_old"])
def test_no_seam_is_bitwise_the_group_op_on_the_token_logprobs(backend, setting):
    """``RankSeams()``: the group op on the (length-weighted) token log-probs and the mean over
    groups, as the losses always composed it, bit for bit: loss and gradient."""
    tok = _tokens(torch.float32)
    setting = dataclasses.replace(setting, backend=backend)
    objective, lp, ent = _objective(tok, torch.arange(T), setting)
    loss = _run(objective, lp, ent)

    leaf = tok.logprobs.clone().requires_grad_(True)
    valid = tok.valid.reshape(-1)
    token_lp = torch.where(valid, leaf.reshape(-1), 0.0)
    if setting.length_normalize:
        token_lp = token_lp * length_weights(valid, objective.layout, token_lp.dtype)
    result = group_targets(token_lp, objective.layout, tok.scores, old_seq_logprobs=objective.old_seq_logprobs,
                           rule=objective.rule, backend=objective.backend)
    want = result.group_loss.mean().to(token_lp.dtype)
    want.backward()
    assert torch.equal(loss, want.detach())
    assert torch.equal(lp.grad, leaf.grad)
