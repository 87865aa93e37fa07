"""Smoke test of the reverse-copy learning benchmark (bench/reverse_copy.py): on the easy
setting (H=2, a completion is right with probability 1/4 at initialization) TPO through the
fused-linear path must lower its loss within each rollout batch and raise its reward within a few
episodes; GRPO must run; the CLI must write its JSON, Markdown and PNG. Runs in a few seconds."""

import json

import pytest
import torch

from bench import reverse_copy as rc

EASY = dict(horizon=2, episodes=12, batch=32, group=8, epochs=4, eval_every=6, log_every=0)


def _mean(xs):
    return sum(xs) / len(xs)


def test_task_reward_and_sampling_shapes():
    prompts = torch.tensor([[0, 1, 1], [1, 0, 0]])
    good = torch.tensor([[1, 1, 0], [0, 0, 1]])
    assert rc.exact_match(good, prompts).tolist() == [1.0, 1.0]
    assert rc.exact_match(torch.tensor([[1, 1, 1], [0, 0, 1]]), prompts).tolist() == [0.0, 1.0]
    torch.manual_seed(0)
    policy = rc.Policy(3)
    out = policy.sample(prompts, 5, torch.Generator().manual_seed(0))
    assert out.shape == (10, 3) and set(out.unique().tolist()) <= {0, 1}
    # the cached autoregressive pass and the training forward agree on the log-probs
    hidden = policy.completion_hidden(prompts.repeat_interleave(5, 0), out)
    assert hidden.shape == (10, 3, 64)


def test_sampling_cache_matches_full_forward():
    torch.manual_seed(1)
    policy = rc.Policy(4)
    prompts = torch.randint(0, 2, (6, 4))
    greedy = policy.sample(prompts, 1, torch.Generator(), greedy=True)
    logits = policy.head(policy.completion_hidden(prompts, greedy))
    assert torch.equal(logits.argmax(-1), greedy)


def test_tpo_learns_easy_setting():
    run = rc.train_run(rc.RunSpec(method="tpo", optimizer="adamw", seed=0, lr=3e-3, **EASY), log=lambda _: None)
    c = run["curves"]
    # within each informative batch, the 4 epochs lower the TPO loss (q fixed, p moves toward it)
    informative = [i for i, f in enumerate(c["informative_groups"]) if f > 0]
    assert informative
    assert all(c["loss_last"][i] < c["loss_first"][i] for i in informative)
    # and the reward rises within the episodes
    assert _mean(c["reward"][-3:]) > _mean(c["reward"][:3]) + 0.2, c["reward"]
    assert c["reward"][-1] > 0.6, c["reward"]


def test_no_learning_without_steps():
    # the assertion above is not vacuous: with lr 0 the reward stays at chance (1/4)
    run = rc.train_run(rc.RunSpec(method="tpo", optimizer="adamw", seed=0, lr=0.0, **EASY), log=lambda _: None)
    assert _mean(run["curves"]["reward"][-3:]) < 0.45


def test_cli_writes_outputs(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "rc"
    rc.main(["-H", "2", "--episodes", "2", "--seeds", "2", "-B", "4", "--jobs", "1", "--eval-every", "2",
             "--log-every", "0", "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert len(results["runs"]) == 2 * 2 * 2  # methods x optimizers x seeds
    for run in results["runs"]:
        assert len(run["curves"]["error"]) == 2
    rows = results["summary"]
    assert {(r["method"], r["optimizer"]) for r in rows} == {(m, o) for m in rc.METHODS for o in rc.OPTIMIZERS}
    md = (out / "results.md").read_text()
    assert "| optimizer (lr) | method |" in md and md.count("\n| adamw") == 2 and md.count("\n| muon") == 2
    assert (out / "reverse-copy.png").stat().st_size > 1000
    # --report rebuilds the table from the JSON
    (out / "results.md").unlink()
    rc.main(["--report", str(out), "--no-plot"])
    assert (out / "results.md").read_text() == md


def test_kernel_objective_matches_plain_pytorch_reference():
    # the fused-linear TPO loss and its gradients on this model equal the plain-PyTorch objective,
    # also off-policy (old log-probs from another policy), with a mix of tied and informative groups
    torch.manual_seed(3)
    policy, other = rc.Policy(3), rc.Policy(3)
    prompts = torch.randint(0, 2, (6, 3))
    completions = policy.sample(prompts, 4, torch.Generator().manual_seed(0))
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 1, 1, 0, 1])
    with torch.no_grad():
        h_old = other.completion_hidden(prompts, completions, 4)
        old_lp = -torch.nn.functional.cross_entropy(other.head(h_old).transpose(1, 2), completions, reduction="none")
    losses, grads = [], []
    for objective in (rc.tpo_objective, rc.tpo_reference_objective):
        policy.zero_grad()
        hidden = policy.completion_hidden(prompts, completions, 4)
        loss, _ = objective(hidden, policy.head.weight, completions, rewards, 4, old_lp)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()]))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)
    assert grads[0].abs().max() > 1e-4


def test_tpo_first_epoch_gradient_exactly_zero_when_all_groups_tie():
    torch.manual_seed(0)
    policy = rc.Policy(3)
    prompts = torch.randint(0, 2, (4, 3))
    completions = policy.sample(prompts, 4, torch.Generator().manual_seed(0))
    hidden = policy.completion_hidden(prompts, completions, 4)
    import tpo_kernels

    old_lp = tpo_kernels.fused_linear_logprobs(hidden.detach(), policy.head.weight.detach(), completions)
    rewards = torch.tensor([1.0] * 4 + [0.0] * 12)  # every group ties
    loss, _ = rc.tpo_objective(hidden, policy.head.weight, completions, rewards, 4, old_lp)
    loss.backward()
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in policy.parameters())


DENSE_EASY = dict(EASY, horizon=4, episodes=10, reward="dense")


def test_dense_reward_scores_each_position():
    prompts = torch.tensor([[0, 1, 1], [1, 0, 0]])
    completions = torch.tensor([[1, 0, 0], [0, 0, 1]])  # reversals: [1, 1, 0] and [0, 0, 1]
    assert rc.position_correct(completions, prompts).tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]


@pytest.mark.parametrize("lr", [3e-3, 0.0])
def test_token_level_tpo_raises_dense_reward(lr):
    run = rc.train_run(rc.RunSpec(method="tpo_token", optimizer="adamw", seed=0, lr=lr, **DENSE_EASY),
                       log=lambda _: None)
    reward = run["curves"]["reward"]  # mean fraction of correct positions, 1/2 at chance
    if lr:
        assert _mean(reward[-3:]) > _mean(reward[:3]) + 0.15, reward
    else:  # not vacuous: without steps the dense reward stays at chance
        assert abs(_mean(reward[-3:]) - 0.5) < 0.1, reward


def test_token_level_candidates_are_scored_by_position():
    # every state's K candidates come from the snapshot policy; a candidate scores 1 iff it is the
    # target token of its position, so the token-level loss sees the same signal as position_correct
    torch.manual_seed(0)
    policy = rc.Policy(3)
    hidden = torch.randn(12, 64)
    candidates, old_lp = rc.sample_candidates(hidden, policy.head.weight.detach(), 5, torch.Generator().manual_seed(0))
    assert candidates.shape == old_lp.shape == (12, 5) and set(candidates.unique().tolist()) <= {0, 1}
    full = torch.log_softmax(hidden @ policy.head.weight.detach().t(), -1)
    torch.testing.assert_close(old_lp, full.gather(1, candidates))


def test_cli_refuses_token_level_without_dense_reward():
    with pytest.raises(SystemExit, match="--reward dense"):
        rc.main(["--methods", "tpo_token", "--out", "unused"])
