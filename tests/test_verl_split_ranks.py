"""The verl ``tpo`` policy loss with groups split over 2 data-parallel ranks (gloo, CPU), as verl's
default trainer produces them: it balances sequence lengths over the ranks
(``trainer.balance_batch``, verl's ``get_seqlen_balanced_partitions``) before the advantage step,
so each group's responses end up on both ranks and in any order.

The estimator runs once on the reordered batch (verl's driver); each rank takes its contiguous
share (verl's dispatch) and computes the loss on it with ``dp_size = 2``. Compared with the
unsplit result (one rank, the whole reordered batch): every rank's loss equals it, and each rank's
gradient is ``dp_size`` times its rows of the unsplit gradient (so that data parallelism, which
averages, gives the unsplit gradient); the metrics averaged over ranks (as verl aggregates them)
equal the unsplit ones. A rank share split into two micro-batches holds parts of groups in each
micro-batch step: both ranks refuse it, with the same error, unless the mini-batch was recorded
first (tpo_kernels' verl worker): then each micro-batch on each rank takes its groups' other
members from the record and the accumulated gradients equal the unsplit ones. A response without a counted token
carries no group (group -1 on its own, no loss, no gradient): it is left out of its group as in the
unsplit batch. verl's sequence importance weights (some 0) split over the ranks give the unsplit
weighted loss too.
"""

import pytest
import torch
from _distributed import run_ranks
from _verl_batches import actor_config, policy_inputs, reorder, rollout
from _verl_ranks import policy_loss_on_share, recorded_share_in_micro_batches

from tpo_kernels.integrations.verl import compute_tpo_outcome_advantage, tpo_policy_loss

WORLD, GROUPS = 2, 4
TOL = dict(rtol=1e-10, atol=1e-12)  # float64 throughout: the gather changes no arithmetic but the order


def balanced_batch(left_out_row=None):
    """A batch in the order verl 0.9.1's trainer gives the actor: rows balanced over WORLD ranks
    by sequence length, and the estimator's advantages on it (``left_out_row``: a response
    without a counted token)."""
    balance = pytest.importorskip("verl.utils.seqlen_balancing")
    batch = rollout(groups=GROUPS, seed=3)
    lengths = batch["mask"].sum(dim=1)
    partitions = balance.get_seqlen_balanced_partitions(balance.calculate_workload(lengths), k_partitions=WORLD,
                                                        equal_size=True)
    batch = reorder(batch, torch.tensor([row for part in partitions for row in part]))
    if left_out_row is not None:
        batch["mask"][left_out_row] = False
    advantages, _ = compute_tpo_outcome_advantage(batch["token_rewards"], batch["mask"].double(), batch["uids"])
    return batch, advantages


@pytest.fixture(scope="module")
def runs():
    batch, advantages = balanced_batch()
    rows = len(batch["uids"]) // WORLD
    for rank in range(WORLD):  # the balancing did split groups over the ranks
        assert len(set(batch["uids"][rank * rows : (rank + 1) * rows])) > GROUPS // WORLD
    left_out = balanced_batch(left_out_row=1)
    weighted = (dict(batch, rollout_is_weights=sequence_weights(batch)), advantages)
    results = run_ranks(WORLD, policy_loss_on_share, [(batch, advantages, 1), (batch, advantages, 2),
                                                      (*left_out, 1), (*weighted, 1)], deadline_s=120)
    return {name: (inputs, [result[case] for result in results])
            for case, (name, inputs) in enumerate([("one", (batch, advantages)), ("two", (batch, advantages)),
                                                   ("left_out", left_out), ("weighted", weighted)])}


def sequence_weights(batch):
    """verl-shaped sequence importance weights (one value per response on its counted tokens),
    two of them 0 (IcePop's out-of-bounds responses: out of their groups)."""
    weights = torch.linspace(0.5, 2.0, len(batch["uids"]), dtype=torch.float64)
    weights[[2, 9]] = 0.0
    return weights.unsqueeze(1) * batch["mask"]


def unsplit(batch, advantages):
    logits, _, kwargs = policy_inputs(batch, advantages=advantages)
    if "rollout_is_weights" in batch:
        kwargs["rollout_is_weights"] = batch["rollout_is_weights"]
    info = dict(dp_size=1, batch_num_tokens=None, global_batch_size=len(batch["uids"]))
    loss, metrics = tpo_policy_loss(**kwargs, config=actor_config(global_batch_info=info))
    return loss.detach(), metrics, torch.autograd.grad(loss, logits)[0]


@pytest.mark.parametrize("case", ["one", "left_out", "weighted"])
def test_split_groups_give_the_unsplit_loss_and_gradient(runs, case):
    (batch, advantages), results = runs[case]
    loss, _, grad = unsplit(batch, advantages)
    for result in results:
        (micro,) = result["micro_batches"]
        assert "error" not in micro, micro.get("error")
        torch.testing.assert_close(micro["loss"], loss, **TOL)
        torch.testing.assert_close(micro["grad"] / WORLD, grad[result["rows"]], **TOL)


def test_split_groups_give_the_unsplit_metrics(runs):
    (batch, advantages), results = runs["one"]
    _, metrics, _ = unsplit(batch, advantages)
    per_rank = [result["micro_batches"][0]["metrics"] for result in results]
    for name in ("actor/tpo_kl_q_p", "actor/tpo_entropy_p", "actor/tpo_entropy_q"):
        assert sum(m[name] for m in per_rank) / WORLD == pytest.approx(metrics[name], rel=1e-9, abs=1e-12)
    assert metrics["actor/tpo_frac_zero_signal_groups"] == pytest.approx(1 / GROUPS)
    assert all(m["actor/tpo_frac_zero_signal_groups"] == metrics["actor/tpo_frac_zero_signal_groups"]
               for m in per_rank)


def test_micro_batch_steps_holding_parts_of_groups_are_refused_on_every_rank(runs):
    _, results = runs["two"]
    errors = [micro.get("error") for result in results for micro in result["micro_batches"]]
    assert errors[0] is not None and "holds part of a group" in errors[0]
    assert errors[0] == errors[len(errors) // 2]  # the same error on every rank, in the same step


@pytest.mark.parametrize("micro_batch_size", [2])
def test_recorded_micro_batches_on_split_ranks_give_the_unsplit_loss_and_gradient(micro_batch_size):
    batch, advantages = balanced_batch()
    results = run_ranks(WORLD, recorded_share_in_micro_batches, batch, advantages, micro_batch_size, deadline_s=120)
    loss, _, grad = unsplit(batch, advantages)
    # verl averages the ranks' summed micro-batch losses, and data parallelism their gradients.
    torch.testing.assert_close(sum(result["loss"] for result in results) / WORLD, loss, **TOL)
    for result in results:
        torch.testing.assert_close(result["grad"] / WORLD, grad[result["rows"]], **TOL)

