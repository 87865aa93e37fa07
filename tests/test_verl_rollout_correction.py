"""verl 0.9's rollout correction (``algorithm.rollout_correction``) through the tpo estimator and
policy loss, the encoded advantages at their edges (parts of tied groups, non-finite rewards, the
band around score_eps), and verl's entropy bonus with the tpo loss.

Rollout correction in verl's decoupled mode runs on the driver before the advantage step: from the
sampler's ``rollout_log_probs`` and the trainer's recomputed ``old_log_probs`` it computes
rejection masks (``rollout_rs``, written into ``response_mask``) and importance weights
(``rollout_is``, the batch field ``rollout_is_weights`` the policy loss receives). These tests call
verl's own ``compute_rollout_correction_and_rejection_mask`` on verl-shaped batches whose sampler
log-probs differ from the trainer's, then the estimator and the loss, and compare with float64
replays: TPO on the kept responses only (``tpo_kernels.reference.tpo_loss``) for rejection, and the
weighted group of ``policy_loss._log_weights``' docstring, written out here, for weights.
"""

import math

import pytest
import torch
from _verl_batches import PROMPT, K, T, TinyEngine, actor_config, policy_inputs, reorder, rollout, verl_mini_batch

from tpo_kernels import reference, tpo_loss_from_logprobs
from tpo_kernels.integrations.verl import compute_tpo_outcome_advantage, tpo_policy_loss
from tpo_kernels.integrations.verl.advantage import decode_advantages, decode_members
from tpo_kernels.integrations.verl.mini_batch import gather_record, recorded_rows, train_batch_for_tpo

verl_helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
from verl.trainer.config.algorithm import AlgoConfig, RolloutCorrectionConfig  # noqa: E402

GROUPS = 3
B = K * GROUPS
TOLERANCE = dict(rtol=1e-7, atol=1e-9)  # float64; the estimator carries u to 2**-24
FAR = (1, 6, 9)  # responses whose sampler log-probs are far from the trainer's (groups 0, 1 tied, 2)


def sampler_log_probs(batch, far=FAR, near_noise=0.01, far_noise=1.0, seed=3):
    """The sampler's per-token log-probs: the trainer's old ones plus per-token noise, large on
    the responses ``far``."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.full((B, 1), near_noise, dtype=torch.float64)
    scale[list(far)] = far_noise
    noise = scale * torch.randn(B, T, generator=gen, dtype=torch.float64)
    return (batch["old_log_prob"] + noise).masked_fill(~batch["mask"], 0.0)


def correct(batch, rollout_log_prob, **correction):
    """verl's decoupled-mode rollout correction, then the tpo estimator, as verl's trainers order
    them: ``(policy loss kwargs, logits leaf, per-response weights or None, kept mask)``."""
    config = AlgoConfig(rollout_correction=RolloutCorrectionConfig(**correction))
    weights_proto, new_mask, _ = verl_helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=batch["old_log_prob"], rollout_log_prob=rollout_log_prob, response_mask=batch["mask"].long(),
        rollout_is=correction.get("rollout_is"), rollout_is_threshold=correction.get("rollout_is_threshold", 2.0),
        rollout_rs=correction.get("rollout_rs"), rollout_rs_threshold=correction.get("rollout_rs_threshold"))
    new_mask = new_mask.bool()
    advantages, _ = compute_tpo_outcome_advantage(batch["token_rewards"], new_mask.long(), batch["uids"],
                                                  config=config)
    corrected = dict(batch, mask=new_mask)
    logits, _, kwargs = policy_inputs(corrected, advantages=advantages)
    weights = None
    if weights_proto is not None:
        kwargs["rollout_is_weights"] = weights_proto.batch["rollout_is_weights"]
        weights = kwargs["rollout_is_weights"][torch.arange(B), 0].double()  # constant over each response
    return kwargs, logits, weights, new_mask.any(dim=1)


def kept_reference(batch, keep, **settings):
    """reference.tpo_loss on the kept responses only, with their raw rewards (mean over groups)."""
    logits = batch["logits"].clone().requires_grad_()
    labels = batch["responses"].masked_fill(~batch["mask"], -100)
    loss = reference.tpo_loss(logits[keep], labels[keep], batch["rewards"][keep],
                              group_ids=(torch.arange(B) // K)[keep], old_logprobs=batch["old_log_prob"][keep],
                              **settings)
    return loss, torch.autograd.grad(loss, logits)[0]


def weighted_reference(batch, weights, eta=1.0, anchor=True, score_eps=1e-6, over_every_group=False):
    """TPO with response i counted w_i times in its group, in float64 by the formula:
    p_i = w_i e^{ell_i} / sum_j w_j e^{ell_j}, q_i = w_i p_old_i e^{u_i/eta} / Z (u from the raw
    rewards of the responses with w_i > 0), loss = mean over the groups that keep a response of
    -sum_i q_i log p_i (``over_every_group``: over every group, an emptied one counting 0)."""
    logits = batch["logits"].clone().requires_grad_()
    mask = batch["mask"]
    ell = (reference.token_logprobs(logits, batch["responses"]) * mask).sum(1)
    ell_old = (batch["old_log_prob"] * mask).sum(1)
    losses = []
    for g in range(GROUPS):
        rows = torch.arange(g * K, (g + 1) * K)
        rows = rows[weights[rows] > 0]
        if len(rows) == 0:
            continue
        log_w = weights[rows].log()
        u = reference.standardize(batch["rewards"][rows], score_eps)
        log_p = torch.log_softmax(ell[rows] + log_w, 0)
        base = ell_old[rows] + log_w if anchor else log_w
        q = torch.softmax(base + u / eta, 0)
        losses.append(-(q * log_p).sum())
    loss = torch.stack(losses).sum() / (GROUPS if over_every_group else len(losses))
    return loss, torch.autograd.grad(loss, logits)[0]


# -- rejection (rollout_rs): masked responses leave their group ---------------------------------


@pytest.mark.parametrize("rollout_rs,threshold", [("seq_max_k2", 0.02), ("seq_mean_k3", 0.005),
                                                  ("seq_sum_k1", "0.5_2.0")])
def test_rejected_responses_get_zero_gradient_and_the_rest_is_tpo_on_the_kept(rollout_rs, threshold):
    batch = rollout()
    kwargs, logits, _, kept = correct(batch, sampler_log_probs(batch), rollout_is=None, rollout_rs=rollout_rs,
                                      rollout_rs_threshold=threshold)
    assert set((~kept).nonzero().squeeze(1).tolist()) == set(FAR)  # verl rejected exactly the far responses
    loss, _ = tpo_policy_loss(**kwargs, config=actor_config())
    grad = torch.autograd.grad(loss, logits)[0]
    want, want_grad = kept_reference(batch, kept)
    torch.testing.assert_close(loss, want, **TOLERANCE)
    torch.testing.assert_close(grad, want_grad, **TOLERANCE)
    assert torch.equal(grad[~kept], torch.zeros_like(grad[~kept]))


def test_a_group_rejected_whole_leaves_the_loss():
    batch = rollout()
    far = tuple(range(2 * K, 3 * K))  # every response of group 2
    kwargs, logits, _, kept = correct(batch, sampler_log_probs(batch, far=far), rollout_is=None,
                                      rollout_rs="seq_max_k2", rollout_rs_threshold=0.02)
    assert not bool(kept[2 * K:].any())
    loss, _ = tpo_policy_loss(**kwargs, config=actor_config())
    grad = torch.autograd.grad(loss, logits)[0]
    want, want_grad = kept_reference(batch, kept)
    torch.testing.assert_close(loss, want, **TOLERANCE)
    torch.testing.assert_close(grad, want_grad, **TOLERANCE)
    assert torch.equal(grad[2 * K:], torch.zeros_like(grad[2 * K:]))


def test_equal_log_probs_give_todays_loss():
    """Sampler log-probs equal to the trainer's: nothing rejected, every weight exp(0) = 1, and
    the loss and gradient are those without rollout correction."""
    batch = rollout()
    kwargs, logits, weights, kept = correct(batch, batch["old_log_prob"].clone(), rollout_is="sequence",
                                            rollout_rs="seq_max_k2", rollout_rs_threshold=0.02)
    assert bool(kept.all()) and torch.equal(weights, torch.ones(B, dtype=torch.float64))
    loss, _ = tpo_policy_loss(**kwargs, config=actor_config())
    grad = torch.autograd.grad(loss, logits)[0]
    plain_logits, _, plain = policy_inputs(batch)
    plain_loss, _ = tpo_policy_loss(**plain, config=actor_config())
    torch.testing.assert_close(loss, plain_loss, rtol=1e-14, atol=0)
    torch.testing.assert_close(grad, torch.autograd.grad(plain_loss, plain_logits)[0], rtol=1e-13, atol=1e-16)


# -- importance weights (rollout_is=sequence): responses counted with their weight ---------------


@pytest.mark.parametrize("eta,anchor", [(1.0, True), (0.5, False)])
@pytest.mark.parametrize("threshold", [2.0, "0.5_2.0"], ids=["truncated", "icepop"])
def test_sequence_weights_give_the_weighted_group(eta, anchor, threshold):
    """Truncated weights (min(w, 2)) and IcePop's (0 outside [0.5, 2]): each response counts with
    its weight in its group; the IcePop zeros leave their group with zero gradient."""
    batch = rollout()
    kwargs, logits, weights, _ = correct(batch, sampler_log_probs(batch, near_noise=0.1, far_noise=0.3),
                                         rollout_is="sequence", rollout_is_threshold=threshold)
    assert len(torch.unique(weights)) > B // 2  # the weights differ from response to response
    if threshold == "0.5_2.0":
        assert 0 < int((weights == 0).sum()) < B
    loss, _ = tpo_policy_loss(**kwargs, config=actor_config(), eta=eta, anchor=anchor)
    grad = torch.autograd.grad(loss, logits)[0]
    want, want_grad = weighted_reference(batch, weights, eta=eta, anchor=anchor)
    torch.testing.assert_close(loss, want, **TOLERANCE)
    torch.testing.assert_close(grad, want_grad, **TOLERANCE)
    out = weights == 0
    assert torch.equal(grad[out], torch.zeros_like(grad[out]))


@pytest.mark.parametrize("anchor", [True, False])
def test_weights_up_to_verls_bound_on_old_log_probs_near_zero(anchor):
    """A weight at verl's largest (e^20, its clamp on the log ratio) on responses whose old
    log-probs are near 0: log p_old + log w is far above 0, yet the weighted group is exact (the
    anchor is shifted by a constant, never a log-probability above 0)."""
    batch = rollout()
    batch["old_log_prob"] = (batch["old_log_prob"] * 1e-4).masked_fill(~batch["mask"], 0.0)
    weights = torch.ones(B, dtype=torch.float64)
    weights[[0, K + 2]] = math.exp(20.0)
    weights[2 * K + 1] = 1e-3
    logits, _, kwargs = policy_inputs(batch)
    loss, _ = tpo_policy_loss(**kwargs, config=actor_config(), anchor=anchor,
                              rollout_is_weights=weights.unsqueeze(1) * batch["mask"])
    grad = torch.autograd.grad(loss, logits)[0]
    want, want_grad = weighted_reference(batch, weights, anchor=anchor)
    torch.testing.assert_close(loss, want, **TOLERANCE)
    torch.testing.assert_close(grad, want_grad, **TOLERANCE)


def _old_anchor_shift_inputs(log_prob, old_log_prob, mask, group_ids, weights, anchor, length_normalize):
    """tpo_loss_from_logprobs' inputs of the weights as the verl integration formed them before the
    loss took ``seq_log_weights``: ``log w - 20`` on one counted token of each response (``n`` times
    with length_normalize) and on its old log-prob, ``log w - 20`` as the anchor without ``anchor``;
    weight-0 responses masked out and given no group."""
    kept = weights > 0
    log_w = torch.where(kept, torch.log(torch.where(kept, weights, 1.0)), 0.0) - 20.0
    per_response = torch.where(kept, log_w * (mask.sum(1) if length_normalize else 1), 0.0)
    first = mask.to(torch.int8).argmax(dim=1, keepdim=True)
    shift = torch.zeros(log_prob.shape, dtype=torch.float64).scatter_(1, first, per_response.unsqueeze(1))
    old = old_log_prob.double() + shift if anchor else torch.where(kept, log_w, 0.0)
    return dict(logprobs=log_prob.double() + shift, mask=mask & kept.unsqueeze(1),
                group_ids=torch.where(kept, group_ids, -1), old_logprobs=old, anchor=True)


@pytest.mark.parametrize("anchor,length_normalize", [(True, False), (False, False), (True, True)])
def test_seq_log_weights_equal_the_old_anchor_shift(anchor, length_normalize):
    """The loss's ``seq_log_weights = log w`` and the shift it replaces give the same loss and
    gradient to 1e-12 (weights up to e^20, the old shift's bound, and zeros)."""
    batch = rollout()
    _, log_prob, kwargs = policy_inputs(batch)
    mask = batch["mask"]
    u, group_ids = decode_advantages(kwargs["advantages"], mask)
    weights = torch.linspace(0.0, 3.0, B, dtype=torch.float64)
    weights[K + 1], weights[2 * K] = math.exp(20.0), 1e-3
    common = dict(scores=u, length_normalize=length_normalize, eta=0.7)
    old = _old_anchor_shift_inputs(log_prob, batch["old_log_prob"], mask, group_ids, weights, anchor, length_normalize)
    leaf_old = log_prob.detach().requires_grad_()
    want = tpo_loss_from_logprobs(**dict(old, logprobs=old["logprobs"] - log_prob + leaf_old), **common)
    leaf = log_prob.detach().requires_grad_()
    got = tpo_loss_from_logprobs(leaf, mask=mask, group_ids=group_ids, seq_log_weights=weights.log(), anchor=anchor,
                                 old_logprobs=batch["old_log_prob"] if anchor else None, **common)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(got, leaf)[0], torch.autograd.grad(want, leaf_old)[0]
    torch.testing.assert_close(*grads, rtol=1e-12, atol=1e-12)


def test_weights_beyond_verls_bound_are_exact():
    """Nothing rides on a token any more: a weight of e^30 (above verl's e^20 clamp) is the
    weighted group still, on old log-probs near 0."""
    batch = rollout()
    batch["old_log_prob"] = (batch["old_log_prob"] * 1e-4).masked_fill(~batch["mask"], 0.0)
    weights = torch.ones(B, dtype=torch.float64)
    weights[[0, K + 2]] = math.exp(30.0)
    logits, _, kwargs = policy_inputs(batch)
    loss, _ = tpo_policy_loss(**kwargs, config=actor_config(), rollout_is_weights=weights.unsqueeze(1) * batch["mask"])
    want, want_grad = weighted_reference(batch, weights)
    torch.testing.assert_close(loss, want, **TOLERANCE)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], want_grad, **TOLERANCE)


def test_weights_of_zero_and_one_are_the_rejection_of_the_zeros():
    """The test's weighted replay agrees with tpo_kernels.reference on the kept responses when
    the weights are 0 or 1, and so does the loss: a zero weight is a rejection."""
    batch = rollout()
    weights = torch.ones(B, dtype=torch.float64)
    weights[list(FAR)] = 0.0
    logits, _, kwargs = policy_inputs(batch)
    loss, _ = tpo_policy_loss(**kwargs, config=actor_config(),
                              rollout_is_weights=weights.unsqueeze(1) * batch["mask"])
    grad = torch.autograd.grad(loss, logits)[0]
    want, want_grad = kept_reference(batch, weights > 0)
    replay, replay_grad = weighted_reference(batch, weights)
    torch.testing.assert_close(replay, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(replay_grad, want_grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(loss, want, **TOLERANCE)
    torch.testing.assert_close(grad, want_grad, **TOLERANCE)


def test_weighted_loss_gradcheck():
    batch = rollout()
    _, log_prob, kwargs = policy_inputs(batch)
    kwargs.pop("log_prob")
    weights = torch.linspace(0.0, 2.0, B, dtype=torch.float64).unsqueeze(1) * batch["mask"]
    leaf = log_prob.detach().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda lp: tpo_policy_loss(log_prob=lp, config=actor_config(), rollout_is_weights=weights, **kwargs)[0],
        (leaf,))


def test_weights_with_length_normalize_give_the_weighted_group_of_token_means():
    batch = rollout()
    weights = torch.linspace(0.25, 2.0, B, dtype=torch.float64)
    logits, _, kwargs = policy_inputs(batch)
    loss, _ = tpo_policy_loss(**kwargs, config=actor_config(), length_normalize=True,
                              rollout_is_weights=weights.unsqueeze(1) * batch["mask"])
    grad = torch.autograd.grad(loss, logits)[0]
    # The same replay on token means: scale each response's log-probs by 1 / (its token count).
    lengths = batch["mask"].sum(1, keepdim=True).double()
    leaf = batch["logits"].clone().requires_grad_()
    ell = (reference.token_logprobs(leaf, batch["responses"]) * batch["mask"]).sum(1) / lengths.squeeze(1)
    ell_old = (batch["old_log_prob"] * batch["mask"]).sum(1) / lengths.squeeze(1)
    losses = []
    for g in range(GROUPS):
        rows = torch.arange(g * K, (g + 1) * K)
        u = reference.standardize(batch["rewards"][rows], 1e-6)
        log_p = torch.log_softmax(ell[rows] + weights[rows].log(), 0)
        q = torch.softmax(ell_old[rows] + weights[rows].log() + u, 0)
        losses.append(-(q * log_p).sum())
    want = torch.stack(losses).mean()
    torch.testing.assert_close(loss, want, **TOLERANCE)
    torch.testing.assert_close(grad, torch.autograd.grad(want, leaf)[0], **TOLERANCE)


@pytest.mark.parametrize("settings", [dict(), dict(eta=0.5, anchor=False), dict(length_normalize=True)],
                         ids=["default", "eta_no_anchor", "length_normalize"])
def test_recorded_micro_batches_with_weights_give_the_unsplit_weighted_loss(settings):
    """The worker's record carries each response's weight: micro-batches of 5 rows of a batch whose
    groups are scattered add up to the weighted loss and gradient of the unsplit batch."""
    batch = reorder(rollout(), torch.randperm(B, generator=torch.Generator().manual_seed(1)))
    weights = torch.linspace(0.5, 2.0, B, dtype=torch.float64)
    weights[[2, 7]] = 0.0
    logits, log_prob, kwargs = policy_inputs(batch)
    kwargs["rollout_is_weights"] = weights.unsqueeze(1) * batch["mask"]
    mask = kwargs["response_mask"]
    u, group_ids = decode_advantages(kwargs["advantages"], mask)
    record, _ = gather_record(group_ids, u, log_prob, kwargs["old_log_prob"], mask,
                              member_ids=decode_members(kwargs["advantages"], mask), weights=weights)
    config = actor_config(global_batch_info=dict(dp_size=1, batch_num_tokens=None, global_batch_size=B))
    total, grad = 0.0, torch.zeros_like(logits)
    for part in torch.arange(B).split(5):
        part_logits = logits.detach()[part].requires_grad_()
        part_kwargs = {name: value[part] for name, value in kwargs.items()}
        part_kwargs["log_prob"] = reference.token_logprobs(part_logits, batch["responses"][part])
        with recorded_rows(record, part):
            loss, _ = tpo_policy_loss(**part_kwargs, config=config, **settings)
        grad[part] += torch.autograd.grad(loss, part_logits)[0]
        total = total + loss.detach()
    want, _ = tpo_policy_loss(**kwargs, config=config, **settings)
    torch.testing.assert_close(total, want.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, torch.autograd.grad(want, logits)[0], rtol=1e-12, atol=1e-14)
    assert torch.equal(grad[[2, 7]], torch.zeros_like(grad[[2, 7]]))


def test_weights_other_than_the_recorded_ones_are_refused():
    batch = rollout()
    _, log_prob, kwargs = policy_inputs(batch)
    u, group_ids = decode_advantages(kwargs["advantages"], batch["mask"])
    weights = torch.ones(B, dtype=torch.float64)
    for recorded, given, match in [(None, weights, "has importance weights but .* record has none"),
                                   (weights, None, "has no importance weights but .* record has them"),
                                   (weights, 2 * weights, "not the recorded ones")]:
        record, _ = gather_record(group_ids, u, log_prob, batch["old_log_prob"], batch["mask"], weights=recorded)
        given_weights = None if given is None else given.unsqueeze(1) * batch["mask"]
        with recorded_rows(record, torch.arange(B)), pytest.raises(ValueError, match=f"rollout_is_weights: .*{match}"):
            tpo_policy_loss(**kwargs, config=actor_config(), rollout_is_weights=given_weights)


@pytest.mark.parametrize("weights,match", [
    (lambda mask: -mask.double(), "must be finite and >= 0"),
    (lambda mask: torch.full(mask.shape, float("nan"), dtype=torch.float64), "must be finite and >= 0"),
    (lambda mask: torch.full(mask.shape, float("inf"), dtype=torch.float64), "must be finite and >= 0"),
    (lambda mask: torch.ones(B, T + 1, dtype=torch.float64), r"\[B, T\]"),
], ids=["negative", "nan", "infinite", "shape"])
def test_bad_weights_are_refused(weights, match):
    batch = rollout()
    _, _, kwargs = policy_inputs(batch)
    with pytest.raises(ValueError, match=f"rollout_is_weights.*{match}|{match}"):
        tpo_policy_loss(**kwargs, config=actor_config(), rollout_is_weights=weights(batch["mask"]))


# -- what the estimator refuses ------------------------------------------------------------------


@pytest.mark.parametrize("correction,match", [
    (dict(bypass_mode=True, rollout_is=None), "bypass_mode: .*set bypass_mode=False"),
    (dict(rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"), "rollout_rs: token_k1.*seq_max_k2"),
    (dict(rollout_is=None, rollout_rs="seq_mean_k1,token_k3", rollout_rs_threshold="0.5_2.0,0.1"),
     "rollout_rs: token_k3 masks single tokens"),
    (dict(rollout_is="token"), "rollout_is: token-level .*rollout_is=sequence"),
])
def test_estimator_refuses_corrections_tpo_cannot_honour(correction, match):
    batch = rollout()
    config = AlgoConfig(rollout_correction=RolloutCorrectionConfig(**correction))
    with pytest.raises(ValueError, match=f"algorithm.rollout_correction.{match}"):
        compute_tpo_outcome_advantage(batch["token_rewards"], batch["mask"].long(), batch["uids"], config=config)


def test_estimator_accepts_sequence_level_corrections():
    batch = rollout()
    config = AlgoConfig(rollout_correction=RolloutCorrectionConfig(rollout_is="sequence", rollout_rs="seq_max_k2",
                                                                   rollout_rs_threshold=0.02))
    advantages, _ = compute_tpo_outcome_advantage(batch["token_rewards"], batch["mask"].long(), batch["uids"],
                                                  config=config)
    plain, _ = compute_tpo_outcome_advantage(batch["token_rewards"], batch["mask"].long(), batch["uids"])
    assert torch.equal(advantages, plain)


# -- the encoded advantages at their edges ---------------------------------------------------------


@pytest.mark.parametrize("missing", [K + 1, 1], ids=["tied_group", "scored_group"])
def test_part_of_a_group_without_the_worker_is_refused(missing):
    """A micro-batch step holding 3 of a group's 4 responses: counted against rollout_n, a part
    of the tied group 1 is found too (its scores, all 0, sum to 0)."""
    _, _, kwargs = policy_inputs(rollout())
    rows = torch.arange(B) != missing
    kwargs = {name: value[rows] for name, value in kwargs.items()}
    with pytest.raises(ValueError, match="holds part of a group.*external_lib=tpo_kernels.integrations.verl.worker"):
        tpo_policy_loss(**kwargs, config=actor_config())


def test_a_rejected_response_still_counts_in_its_group():
    """A response rejection took out of its group carries its group on its row: a step holding it
    is whole; a step without it holds part of the group."""
    batch = rollout()
    kwargs, _, _, kept = correct(batch, sampler_log_probs(batch), rollout_is=None, rollout_rs="seq_max_k2",
                                 rollout_rs_threshold=0.02)
    assert not bool(kept[1])
    tpo_policy_loss(**kwargs, config=actor_config())  # whole: accepted
    rows = torch.arange(B) != 1
    part = {name: value[rows] for name, value in kwargs.items()}
    with pytest.raises(ValueError, match="holds part of a group"):
        tpo_policy_loss(**part, config=actor_config())


def test_record_with_a_rejected_response_and_part_of_a_tied_group_is_refused():
    """The worker's record of a mini-batch that lacks one response of the tied group 1 and holds a
    response rejection took out (row 1, no counted token): the record counts row 1 in group 0 by
    the group it carries, so group 1's 3 of 4 responses are a part, refused (a row without a
    group would make the count unusable and the tied part, its scores all 0, pass)."""
    batch = rollout()
    kwargs, _, _, kept = correct(batch, sampler_log_probs(batch), rollout_is=None, rollout_rs="seq_max_k2",
                                 rollout_rs_threshold=0.02)
    assert not bool(kept[1])
    rows = torch.arange(B) != 2 * K - 1  # group 1's last response is in another mini-batch
    advantages, mask = kwargs["advantages"][rows], kwargs["response_mask"][rows]
    u, group_ids = decode_advantages(advantages, mask)
    record, _ = gather_record(group_ids, u, kwargs["log_prob"][rows], kwargs["old_log_prob"][rows], mask,
                              member_ids=decode_members(advantages, mask))
    part = torch.arange(K, 2 * K - 1)  # group 1's rows here, in the batch and in the record
    with recorded_rows(record, part), pytest.raises(ValueError, match="different mini-batches"):
        tpo_policy_loss(**{name: value[part] for name, value in kwargs.items()}, config=actor_config())


def test_more_members_than_rollout_n_are_refused():
    _, _, kwargs = policy_inputs(rollout())
    with pytest.raises(ValueError, match="config.rollout_n: this step holds a group of 4 responses"):
        tpo_policy_loss(**kwargs, config=actor_config(rollout_n=K - 1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_are_refused_by_the_estimator(bad):
    batch = rollout()
    batch["token_rewards"][5, 0] = bad
    with pytest.raises(ValueError, match=rf"token_level_rewards: the reward of response 5 \(uid 'prompt-1'\) is "
                                         rf"{bad}"):
        compute_tpo_outcome_advantage(batch["token_rewards"], batch["mask"].long(), batch["uids"])


SCORE_EPS = 1e-6
BAND = torch.linspace(0.9, 1.1, 41, dtype=torch.float64)  # the reward std, in units of score_eps


def band_errors(pattern):
    """|verl's loss - tpo_loss_from_logprobs on the raw rewards| (and the largest gradient
    difference) for group 0's rewards ``offset + std * pattern`` (pattern of population std 1)
    at every std of the band around score_eps."""
    errors = []
    for ratio in BAND.tolist():
        batch = rollout()
        batch["rewards"][:K] = 0.25 + ratio * SCORE_EPS * pattern
        lengths = batch["mask"].sum(1)
        batch["token_rewards"][torch.arange(B), lengths - 1] = batch["rewards"]
        logits, log_prob, kwargs = policy_inputs(batch)
        loss, _ = tpo_policy_loss(**kwargs, config=actor_config(), score_eps=SCORE_EPS)
        grad = torch.autograd.grad(loss, logits)[0]
        raw_logits = batch["logits"].clone().requires_grad_()
        raw = tpo_loss_from_logprobs(reference.token_logprobs(raw_logits, batch["responses"]), batch["rewards"],
                                     mask=batch["mask"], group_size=K, old_logprobs=batch["old_log_prob"],
                                     score_eps=SCORE_EPS)
        raw_grad = torch.autograd.grad(raw, raw_logits)[0]
        errors.append((abs(float(loss.detach() - raw.detach())), float((grad - raw_grad).abs().max())))
    return errors


@pytest.mark.parametrize("pattern", [[-1.0, -1.0, 1.0, 1.0], [-1.5, -0.5, 0.5, 1.5]], ids=["two_levels", "spread"])
def test_the_band_around_score_eps_gives_the_loss_of_the_raw_rewards(pattern):
    """Rewards whose std sweeps [0.9, 1.1] x score_eps (41 points): the estimator centers the
    groups under the threshold and standardizes the others, and the loss keeps each decision
    (before: 1.09 against 0.54 just under the threshold). Largest error: printed."""
    z = torch.tensor(pattern, dtype=torch.float64)
    z = (z - z.mean()) / z.std(unbiased=False)
    errors = band_errors(z)
    loss_error, grad_error = max(e[0] for e in errors), max(e[1] for e in errors)
    print(f"band sweep {pattern}: max |loss error| {loss_error:.3g}, max |grad error| {grad_error:.3g}")
    assert loss_error <= 1e-7 and grad_error <= 1e-7


@pytest.mark.parametrize("micro_batch_size,record", [(B, False), (3, True)], ids=["one_micro_batch", "recorded"])
def test_rejection_and_weights_through_verls_ppo_loss(micro_batch_size, record):
    """A mini-batch as verl's engine trains it (verl's own ppo_loss selecting ``rollout_is_weights``
    from the batch; one micro-batch, or micro-batches of 3 with tpo_kernels' record, which reads
    the weights from the mini-batch), with a rejection mask and IcePop weights together:
    the gradient is the weighted group's over the responses neither removes. With verl's
    ``global_batch_size`` the loss is the mean over the mini-batch's groups, a group both remove
    whole counting 0 (here group 2)."""
    import functools

    from verl.workers.config import ActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    batch = rollout()
    kwargs, _, weights, kept = correct(batch, sampler_log_probs(batch, near_noise=0.1, far_noise=2.0),
                                       rollout_is="sequence", rollout_is_threshold="0.8_1.25",
                                       rollout_rs="seq_max_k2", rollout_rs_threshold=0.1)
    assert not bool(kept[list(FAR)].any()) and 0 < int((weights[kept] == 0).sum())
    engine = TinyEngine(batch["logits"].clone().requires_grad_())
    data = verl_mini_batch(batch, kwargs["advantages"], micro_batch_size)  # attention over the whole responses
    data["response_mask"] = kwargs["response_mask"].long()  # verl folds the rejection into response_mask
    data["rollout_is_weights"] = kwargs["rollout_is_weights"]
    config = ActorConfig(strategy="fsdp", rollout_n=K, ppo_micro_batch_size_per_gpu=micro_batch_size,
                         policy_loss=PolicyLossConfig(loss_mode="tpo"))
    train_batch = functools.partial(train_batch_for_tpo, engine, engine.train_batch) if record else engine.train_batch
    output = train_batch(data, loss_function=functools.partial(ppo_loss, config=config))
    assert engine.forward_only_calls == int(record)
    emptied = [g for g in range(GROUPS) if not bool((kept & (weights > 0))[g * K:(g + 1) * K].any())]
    assert emptied == [2]
    want, want_grad = weighted_reference(batch, torch.where(kept, weights, 0.0), over_every_group=True)
    torch.testing.assert_close(sum(output["loss"]), want, **TOLERANCE)
    torch.testing.assert_close(engine.logits.grad, want_grad, **TOLERANCE)


# -- verl's entropy bonus (actor.entropy_coeff) with the tpo loss -----------------------------------


class EntropyEngine(TinyEngine):
    """TinyEngine whose model output also carries the token entropy (verl's ``calculate_entropy``,
    on when ``entropy_coeff != 0``), in the same no-padding layout as the log-probs."""

    def _model_output(self, micro_batch):
        output = super()._model_output(micro_batch)
        entropy = reference.token_entropy(self.logits[micro_batch["row"]])
        lengths = micro_batch["attention_mask"].sum(1).tolist()
        pad = entropy.new_zeros(PROMPT - 1)
        output["entropy"] = torch.cat([torch.cat([pad, entropy[b, : length - PROMPT], pad.new_zeros(1)])
                                       for b, length in enumerate(lengths)])
        return output


@pytest.mark.parametrize("micro_batch_size,record", [(B, False), (3, True)], ids=["one_micro_batch", "recorded"])
def test_verl_entropy_coeff_gives_tpo_minus_c_times_the_token_mean_entropy(micro_batch_size, record):
    """verl adds ``-entropy_coeff * H`` to any policy loss itself (ppo_loss, from the entropy of
    its own forward, the pass that gives the log-probs), so the tpo policy loss adds none: the
    step's loss and gradient are tpo_kernels.reference.tpo_loss(entropy_coef=c) in float64, the
    entropy bonus counted once, in one micro-batch or in recorded micro-batches."""
    import functools

    from verl.workers.config import ActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    coef = 0.05
    batch = rollout()
    advantages, _ = compute_tpo_outcome_advantage(batch["token_rewards"], batch["mask"].long(), batch["uids"])
    engine = EntropyEngine(batch["logits"].clone().requires_grad_())
    data = verl_mini_batch(batch, advantages, micro_batch_size)
    config = ActorConfig(strategy="fsdp", rollout_n=K, ppo_micro_batch_size_per_gpu=micro_batch_size,
                         entropy_coeff=coef, policy_loss=PolicyLossConfig(loss_mode="tpo"))
    train_batch = functools.partial(train_batch_for_tpo, engine, engine.train_batch) if record else engine.train_batch
    output = train_batch(data, loss_function=functools.partial(ppo_loss, config=config))
    assert len(output["loss"]) == B // micro_batch_size
    leaf = batch["logits"].clone().requires_grad_()
    labels = batch["responses"].masked_fill(~batch["mask"], -100)
    want = reference.tpo_loss(leaf, labels, batch["rewards"], group_size=K, old_logprobs=batch["old_log_prob"],
                              entropy_coef=coef)
    torch.testing.assert_close(sum(output["loss"]), want, **TOLERANCE)
    torch.testing.assert_close(engine.logits.grad, torch.autograd.grad(want, leaf)[0], **TOLERANCE)
