"""tpo_kernels.integrations.verl: the "tpo" policy loss and advantage estimator, on one rank.

The functions are checked with verl-shaped tensors ([B, T] log-probs, right-padded response masks,
rewards on the last response token, uids as an object array) against
``tpo_kernels.reference.tpo_loss`` on the logits the log-probs come from. When verl is installed
(CI installs verl 0.9.1), the last tests go through verl's own registries and config classes, and a
mini-batch goes through verl's ``ppo_loss`` and micro-batching (tests/_verl_batches.TinyEngine).
Gradient accumulation: micro-batches of a recorded mini-batch (tpo_kernels' verl worker) must add
up to the unsplit loss and gradient, in float64 to 1e-12, in any row layout. Groups split over
data-parallel ranks: tests/test_verl_split_ranks.py.
"""

import functools
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest
import torch
from _verl_batches import K, T, TinyEngine, actor_config, policy_inputs, reorder, rollout, verl_mini_batch

from tpo_kernels import reference
from tpo_kernels.integrations.verl import compute_tpo_outcome_advantage, tpo_policy_loss
from tpo_kernels.integrations.verl.advantage import SCORE_BITS, decode_advantages, decode_scores
from tpo_kernels.integrations.verl.mini_batch import gather_record, recorded_rows, train_batch_for_tpo

ROOT = pathlib.Path(__file__).resolve().parents[1]
GROUPS = 3
B = K * GROUPS


def expected_loss(batch, keep=None, **settings):
    """reference.tpo_loss on the policy logits with the raw rewards as scores (mean over groups),
    leaving out the rows not in ``keep``."""
    keep = torch.ones(B, dtype=torch.bool) if keep is None else keep
    logits = batch["logits"].clone().requires_grad_()
    labels = batch["responses"].masked_fill(~batch["mask"], -100)
    anchor = settings.get("anchor", True)
    loss = reference.tpo_loss(logits[keep], labels[keep], batch["rewards"][keep],
                              group_ids=(torch.arange(B) // K)[keep],
                              old_logprobs=batch["old_log_prob"].double()[keep] if anchor else None, **settings)
    return loss, torch.autograd.grad(loss, logits)[0]


# fp64: the estimator carries u to 2**-24 (6e-8); fp32 log-probs.
TOLERANCES = {torch.float64: dict(rtol=1e-7, atol=1e-9), torch.float32: dict(rtol=1e-5, atol=1e-6)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("eta,anchor", [(1.0, True), (0.5, False)])
def test_policy_loss_matches_reference(dtype, eta, anchor):
    batch = rollout(dtype=dtype)
    logits, _, kwargs = policy_inputs(batch, dtype)
    loss, metrics = tpo_policy_loss(**kwargs, loss_agg_mode="token-mean", config=actor_config(), eta=eta, anchor=anchor)
    want, want_grad = expected_loss(batch, eta=eta, anchor=anchor)
    torch.testing.assert_close(loss.double(), want, **TOLERANCES[dtype])
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], want_grad, **TOLERANCES[dtype])
    assert metrics["actor/tpo_frac_zero_signal_groups"] == pytest.approx(1 / GROUPS)


@pytest.mark.parametrize("global_batch_size", [B, 4 * B])
def test_global_batch_info_scales_to_the_mean_over_the_mini_batch(global_batch_size):
    """sum of the micro-batch's group losses / (the mini-batch's groups): micro-batch gradients
    add up, so the mini-batch step averages over every group (dp_size > 1: the split test)."""
    batch = rollout()
    _, _, kwargs = policy_inputs(batch)
    info = dict(dp_size=1, batch_num_tokens=int(batch["mask"].sum()), global_batch_size=global_batch_size)
    loss, _ = tpo_policy_loss(**kwargs, config=actor_config(global_batch_info=info))
    want, _ = expected_loss(batch, reduction="sum")
    torch.testing.assert_close(loss, want * K / global_batch_size, **TOLERANCES[torch.float64])


def test_policy_loss_gradcheck():
    batch = rollout()
    _, log_prob, kwargs = policy_inputs(batch)
    kwargs.pop("log_prob")
    leaf = log_prob.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda lp: tpo_policy_loss(log_prob=lp, config=actor_config(), **kwargs)[0],
                                    (leaf,))


def test_response_without_counted_token_is_left_out_of_its_group():
    batch = rollout()
    batch["mask"][5] = False
    logits, _, kwargs = policy_inputs(batch)
    loss, _ = tpo_policy_loss(**kwargs, config=actor_config())
    keep = torch.arange(B) != 5
    want, want_grad = expected_loss(batch, keep=keep)
    grad = torch.autograd.grad(loss, logits)[0]
    torch.testing.assert_close(loss, want, **TOLERANCES[torch.float64])
    torch.testing.assert_close(grad, want_grad, **TOLERANCES[torch.float64])
    assert torch.equal(grad[5], torch.zeros_like(grad[5]))


def test_estimator_writes_the_group_standardized_score_on_every_counted_token():
    batch = rollout()
    mask = batch["mask"].to(torch.float64)
    advantages, returns = compute_tpo_outcome_advantage(batch["token_rewards"], mask, batch["uids"])
    u = torch.cat([reference.standardize(batch["rewards"][g * K : (g + 1) * K]) for g in range(GROUPS)])
    assert advantages.dtype == torch.float64 and returns is advantages
    # The advantage is u to 2**-24 (what verl's advantage metrics see) ...
    torch.testing.assert_close(advantages, u.unsqueeze(1) * mask, rtol=0, atol=2.0**-SCORE_BITS)
    # ... and carries u and the group, read back exactly on every counted token.
    decoded_u, group_ids, valid = decode_scores(advantages[batch["mask"]])
    rows = torch.arange(B).unsqueeze(1).expand(B, T)[batch["mask"]]
    assert bool(valid.all())
    assert torch.equal(group_ids, rows // K)
    assert torch.equal(decoded_u, torch.round(u[rows] * 2.0**SCORE_BITS) * 2.0**-SCORE_BITS)
    assert torch.equal(decoded_u[(rows >= K) & (rows < 2 * K)], torch.zeros(int(mask[K : 2 * K].sum()),
                                                                             dtype=torch.float64))  # tied group


def test_estimator_and_loss_take_the_rows_in_any_order():
    """verl balances sequence lengths over ranks, which reorders the batch before the estimator:
    groups are found by uid, not by position."""
    batch = rollout()
    order = torch.randperm(B, generator=torch.Generator().manual_seed(5))
    logits, _, kwargs = policy_inputs(reorder(batch, order))
    loss, _ = tpo_policy_loss(**kwargs, config=actor_config())
    want, want_grad = expected_loss(batch)
    torch.testing.assert_close(loss, want, **TOLERANCES[torch.float64])
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], want_grad[order], rtol=1e-6, atol=1e-8)


def test_near_tied_rewards_give_the_loss_of_the_raw_rewards():
    """The near-tie rule acts on the raw rewards: a group whose rewards differ by 1e-7 gets the
    centered 1e-7 advantages from the estimator, and the policy loss on them equals
    reference.tpo_loss on the raw rewards (default score_eps on both)."""
    batch = rollout()
    batch["rewards"][:K] = 0.5 + 1e-7 * torch.tensor([1.0, -1.0, 0.0, 0.5], dtype=torch.float64)
    lengths = batch["mask"].sum(1)
    batch["token_rewards"][torch.arange(B), lengths - 1] = batch["rewards"]
    logits, _, kwargs = policy_inputs(batch)
    assert kwargs["advantages"][:K].abs().max() < 1e-6
    loss, _ = tpo_policy_loss(**kwargs, config=actor_config())
    want, want_grad = expected_loss(batch)
    # The advantages carry u to 2**-24 (with the group id below it): agreement to that resolution.
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], want_grad, rtol=1e-6, atol=1e-8)


# -- the batching contract: refusals -----------------------------------------------------------


@pytest.mark.parametrize("overrides,match", [
    (dict(rollout_n=None), "config.rollout_n"),
    (dict(use_dynamic_bsz=True), "config.use_dynamic_bsz"),
    (dict(shuffle=True), "config.shuffle"),
    (dict(global_batch_info=dict(dp_size=1, global_batch_size=10)), "config.global_batch_info"),
    (dict(global_batch_info=dict(dp_size=2, global_batch_size=None)), "config.global_batch_info"),
    (dict(global_batch_info=dict(dp_size=2, global_batch_size=2 * B)), "torch.distributed is not initialized"),
])
def test_policy_loss_refuses_batching_that_splits_groups(overrides, match):
    _, _, kwargs = policy_inputs(rollout())
    with pytest.raises(ValueError, match=match):
        tpo_policy_loss(**kwargs, config=actor_config(**overrides))


def test_policy_loss_refuses_part_of_a_group_without_a_record():
    _, _, kwargs = policy_inputs(rollout())
    rows = torch.arange(B) != 1  # a micro-batch without one response of group 0
    kwargs = {name: value[rows] for name, value in kwargs.items()}
    with pytest.raises(ValueError, match="holds part of a group.*external_lib=tpo_kernels.integrations.verl.worker"):
        tpo_policy_loss(**kwargs, config=actor_config())


@pytest.mark.parametrize("cast", [torch.float32, torch.bfloat16])
def test_policy_loss_refuses_advantages_it_did_not_write(cast):
    """Advantages of another estimator, or the tpo estimator's cast below float64 (the group
    ids are lost), are refused rather than grouped wrongly."""
    batch = rollout()
    _, _, kwargs = policy_inputs(batch)
    cast_kwargs = dict(kwargs, advantages=kwargs["advantages"].to(cast).to(torch.float64))
    with pytest.raises(ValueError, match="advantages: .*adv_estimator=tpo"):
        tpo_policy_loss(**cast_kwargs, config=actor_config())


def test_policy_loss_refuses_per_token_advantages_and_importance_weights():
    """Per-token advantages, and per-token importance weights (verl's rollout_is=token)."""
    _, _, kwargs = policy_inputs(rollout())
    varying = kwargs["advantages"].clone()
    varying[0, 0] = kwargs["advantages"][1, 0]  # another response's (valid) value on one token
    gae_like = dict(kwargs, advantages=varying)
    with pytest.raises(ValueError, match="advantages: TPO needs one score per response"):
        tpo_policy_loss(**gae_like, config=actor_config())
    token_weights = torch.ones(B, T, dtype=torch.float64)
    token_weights[0, 0] = 2.0  # rollout_is=token: one token of a response weighted otherwise
    with pytest.raises(ValueError, match="rollout_is_weights vary along a response.*rollout_is=sequence"):
        tpo_policy_loss(**kwargs, config=actor_config(), rollout_is_weights=token_weights)
    with pytest.raises(ValueError, match="config"):
        tpo_policy_loss(**kwargs, config=None)


# -- gradient accumulation: micro-batches with the mini-batch recorded ----------------------------

EXACT = dict(rtol=1e-12, atol=1e-14)  # float64: the same arithmetic as the unsplit batch, grouped otherwise


def balanced_order():
    """A row order that scatters every group, as verl's sequence balancing does."""
    return torch.randperm(B, generator=torch.Generator().manual_seed(1))


def micro_batch_layouts():
    """Row partitions of the mini-batch as verl forms micro-batches: consecutive chunks
    (``ppo_micro_batch_size_per_gpu``), one response each, and unequal, reordered parts (dynamic
    batch sizes)."""
    rows = torch.arange(B)
    scattered = rows[torch.randperm(B, generator=torch.Generator().manual_seed(2))]
    return {"chunks_of_5": list(rows.split(5)), "chunks_of_3": list(rows.split(3)), "one_each": list(rows.split(1)),
            "uneven_reordered": list(scattered.split([1, 4, 2, 5]))}


def accumulate(batch, parts, **settings):
    """verl's gradient accumulation on one rank: each part's log-probs from its own forward, the
    loss inside the mini-batch's record (gathered as tpo_kernels' worker does), gradients added."""
    logits, log_prob, kwargs = policy_inputs(batch)
    u, group_ids = decode_advantages(kwargs["advantages"], kwargs["response_mask"])
    mini_batch, _ = gather_record(group_ids, u, log_prob, kwargs["old_log_prob"], kwargs["response_mask"])
    loss, grad = 0.0, torch.zeros_like(logits)
    for part in parts:
        part_logits = logits.detach()[part].requires_grad_()
        part_kwargs = {name: value[part] for name, value in kwargs.items()}
        part_kwargs["log_prob"] = reference.token_logprobs(part_logits, batch["responses"][part])
        with recorded_rows(mini_batch, part):
            part_loss, _ = tpo_policy_loss(**part_kwargs, config=actor_config(), **settings)
        grad[part] += torch.autograd.grad(part_loss, part_logits)[0]
        loss = loss + part_loss.detach()
    return loss, grad


def unsplit(batch, **settings):
    logits, _, kwargs = policy_inputs(batch)
    info = dict(dp_size=1, batch_num_tokens=None, global_batch_size=B)
    loss, _ = tpo_policy_loss(**kwargs, config=actor_config(global_batch_info=info), **settings)
    return loss.detach(), torch.autograd.grad(loss, logits)[0]


@pytest.mark.parametrize("layout", sorted(micro_batch_layouts()))
@pytest.mark.parametrize("settings", [dict(), dict(eta=0.5, anchor=False), dict(length_normalize=True)],
                         ids=["default", "eta_half_no_anchor", "length_normalize"])
def test_recorded_micro_batches_give_the_unsplit_loss_and_gradient(layout, settings):
    batch = reorder(rollout(), balanced_order())
    loss, grad = accumulate(batch, micro_batch_layouts()[layout], **settings)
    want_loss, want_grad = unsplit(batch, **settings)
    torch.testing.assert_close(loss, want_loss, **EXACT)
    torch.testing.assert_close(grad, want_grad, **EXACT)


def test_recorded_metrics_of_one_micro_batch_are_the_unsplit_ones():
    """Each group weighs with the fraction of its responses held: with the whole mini-batch in one
    micro-batch, the means over its groups, as without the record."""
    batch = reorder(rollout(), balanced_order())
    _, log_prob, kwargs = policy_inputs(batch)
    info = dict(dp_size=1, batch_num_tokens=None, global_batch_size=B)
    _, want = tpo_policy_loss(**kwargs, config=actor_config(global_batch_info=info))
    u, group_ids = decode_advantages(kwargs["advantages"], kwargs["response_mask"])
    mini_batch, _ = gather_record(group_ids, u, log_prob, kwargs["old_log_prob"], kwargs["response_mask"])
    with recorded_rows(mini_batch, torch.arange(B)):
        _, metrics = tpo_policy_loss(**kwargs, config=actor_config())
    assert metrics.keys() == want.keys()
    for name, value in want.items():
        assert metrics[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name


def test_recorded_micro_batches_leave_out_a_response_without_counted_token():
    batch = reorder(rollout(), balanced_order())
    batch["mask"][5] = False
    loss, grad = accumulate(batch, micro_batch_layouts()["chunks_of_5"])
    want_loss, want_grad = unsplit(batch)
    torch.testing.assert_close(loss, want_loss, **EXACT)
    torch.testing.assert_close(grad, want_grad, **EXACT)
    assert torch.equal(grad[5], torch.zeros_like(grad[5]))


@pytest.mark.parametrize("group", [2, 1], ids=["scored_group", "tied_group"])
def test_record_of_part_of_a_group_is_refused(group):
    """A group whose responses are in different mini-batches (verl's balancing with several
    mini-batches per step) has no single current policy: refused, naming the settings; a tied
    group's part too (fewer than rollout_n responses)."""
    batch = rollout()
    _, log_prob, kwargs = policy_inputs(batch)
    u, group_ids = decode_advantages(kwargs["advantages"], kwargs["response_mask"])
    kept = torch.arange(B) != group * K + K - 1  # the mini-batch lacks the group's last response
    mini_batch, _ = gather_record(group_ids[kept], u[kept], log_prob[kept], kwargs["old_log_prob"][kept],
                                  kwargs["response_mask"][kept])
    part = torch.arange(group * K, group * K + K - 1)  # its rows in the batch and in the record
    refused = pytest.raises(ValueError, match="different mini-batches.*ppo_mini_batch_size")
    with recorded_rows(mini_batch, part), refused:
        tpo_policy_loss(**{name: value[part] for name, value in kwargs.items()}, config=actor_config())


def test_record_of_other_rows_is_refused():
    batch = rollout()
    _, log_prob, kwargs = policy_inputs(batch)
    u, group_ids = decode_advantages(kwargs["advantages"], kwargs["response_mask"])
    mini_batch, _ = gather_record(group_ids, u, log_prob, kwargs["old_log_prob"], kwargs["response_mask"])
    part, wrong = torch.arange(0, 3), torch.tensor([0, 1, 4])  # row 4 is in group 1
    with recorded_rows(mini_batch, wrong), pytest.raises(ValueError, match="tpo_row: .* not the recorded rows"):
        tpo_policy_loss(**{name: value[part] for name, value in kwargs.items()}, config=actor_config())


# -- through verl's registries (verl installed) ------------------------------------------------


@pytest.fixture(scope="module")
def verl_core():
    return pytest.importorskip("verl.trainer.ppo.core_algos")


def test_registry_loss_called_as_verl_calls_it(verl_core):
    """verl 0.9.1's ppo_loss (verl/workers/utils/losses.py) fills config.global_batch_info and
    calls the registered loss with these keywords."""
    from verl.workers.config import ActorConfig, PolicyLossConfig

    batch = rollout(dtype=torch.float32)
    logits, _, kwargs = policy_inputs(batch, torch.float32)
    config = ActorConfig(strategy="fsdp", rollout_n=K, ppo_micro_batch_size_per_gpu=B,
                         policy_loss=PolicyLossConfig(loss_mode="tpo"))
    config.global_batch_info.update(dp_size=1, batch_num_tokens=int(batch["mask"].sum()), global_batch_size=B,
                                    loss_scale_factor=None)
    policy_loss_fn = verl_core.get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
    loss, metrics = policy_loss_fn(**kwargs, loss_agg_mode=config.loss_agg_mode, config=config,
                                   rollout_is_weights=None)
    want, want_grad = expected_loss(batch)
    torch.testing.assert_close(loss.double(), want, **TOLERANCES[torch.float32])
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], want_grad, **TOLERANCES[torch.float32])
    assert all(name.startswith("actor/") and isinstance(value, float) for name, value in metrics.items())


def test_registry_estimator_called_as_verl_calls_it(verl_core):
    """verl 0.9.1's compute_advantage (trainer/ppo/ray_trainer.py) calls a registered estimator
    with these keywords; verl's own grpo advantages carry no groups and are refused."""
    from verl.trainer.config import AlgoConfig

    batch = rollout(dtype=torch.float32)
    mask = batch["mask"].to(torch.float32)
    estimator = verl_core.get_adv_estimator_fn("tpo")
    advantages, _ = estimator(token_level_rewards=batch["token_rewards"], response_mask=mask,
                              config=AlgoConfig(adv_estimator="tpo"), index=batch["uids"])
    _, _, kwargs = policy_inputs(batch, torch.float32)
    loss, _ = tpo_policy_loss(**dict(kwargs, advantages=advantages), config=actor_config())
    want, _ = expected_loss(batch)
    torch.testing.assert_close(loss.double(), want, **TOLERANCES[torch.float32])
    grpo, _ = verl_core.compute_grpo_outcome_advantage(batch["token_rewards"], mask, batch["uids"])
    with pytest.raises(ValueError, match="adv_estimator=tpo"):
        tpo_policy_loss(**dict(kwargs, advantages=grpo), config=actor_config())


def verl_actor_loss(loss_mode="tpo"):
    """verl 0.9.1's actor loss as its ActorRolloutRefWorker builds it: ``partial(ppo_loss, config=...)``."""
    from verl.workers.config import ActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    config = ActorConfig(strategy="fsdp", rollout_n=K, ppo_micro_batch_size_per_gpu=3,
                         policy_loss=PolicyLossConfig(loss_mode=loss_mode))
    return functools.partial(ppo_loss, config=config)


def verl_engine_step(micro_batch_size, use_dynamic_bsz=False, loss_mode="tpo", record=True):
    """One mini-batch (groups scattered) through TinyEngine (verl's micro-batching and model-output
    layout) and verl's own ppo_loss: (engine, train_batch output, the batch)."""
    batch = reorder(rollout(), balanced_order())
    advantages, _ = compute_tpo_outcome_advantage(batch["token_rewards"], batch["mask"].double(), batch["uids"])
    engine = TinyEngine(batch["logits"].clone().requires_grad_())
    data = verl_mini_batch(batch, advantages, micro_batch_size, use_dynamic_bsz=use_dynamic_bsz)
    train_batch = functools.partial(train_batch_for_tpo, engine, engine.train_batch) if record else engine.train_batch
    return engine, train_batch(data, loss_function=verl_actor_loss(loss_mode)), batch


@pytest.mark.parametrize("micro_batch_size,use_dynamic_bsz", [(3, False), (1, False), (B, True)])
def test_verl_micro_batches_with_the_record_give_the_unsplit_gradient(verl_core, micro_batch_size, use_dynamic_bsz):
    engine, output, batch = verl_engine_step(micro_batch_size, use_dynamic_bsz)
    split = [sorted({batch["uids"][row] for row in rows}) for rows in engine.micro_batch_rows]
    assert len(split) > 1 and len({uid for uids in split for uid in uids}) < sum(map(len, split))  # groups split
    want_loss, want_grad = unsplit(batch)
    torch.testing.assert_close(sum(output["loss"]), want_loss, **EXACT)
    torch.testing.assert_close(engine.logits.grad, want_grad, **EXACT)


def test_verl_micro_batches_without_the_record_are_refused(verl_core):
    with pytest.raises(ValueError, match="holds part of a group"):
        verl_engine_step(micro_batch_size=3, record=False)


@pytest.mark.parametrize("micro_batch_size,loss_mode,recorded", [(3, "tpo", True), (B, "tpo", False),
                                                                  (3, "vanilla", False)])
def test_the_record_runs_only_for_tpo_over_several_micro_batches(verl_core, micro_batch_size, loss_mode, recorded):
    engine, _, _ = verl_engine_step(micro_batch_size, loss_mode=loss_mode)  # vanilla: PPO's loss on TPO's advantages
    assert engine.forward_only_calls == int(recorded)


@pytest.fixture
def one_rank_on_cpu(monkeypatch):
    """A 1-rank gloo process group, with verl's device lookups pointed at the CPU."""
    fsdp = pytest.importorskip("verl.workers.engine.fsdp.transformer_impl", reason="verl's FSDP engine needs "
                               "verl's full dependencies (installed --no-deps here)")
    import torch.distributed as dist
    from _distributed import free_port
    from verl.utils import seqlen_balancing

    monkeypatch.setattr(fsdp, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(seqlen_balancing, "get_device_name", lambda: "cpu")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("micro_batch_size,use_dynamic_bsz", [(3, False), (B, True)])
def test_verl_fsdp_engine_micro_batches_with_the_record(verl_core, one_rank_on_cpu, micro_batch_size,
                                                        use_dynamic_bsz):
    """verl's own FSDPEngine micro-batch loop (tests/_verl_batches.fsdp_engine_class) with the
    record: the accumulated gradient and the summed loss are the unsplit mini-batch's."""
    from _verl_batches import fsdp_engine_class

    batch = reorder(rollout(), balanced_order())
    advantages, _ = compute_tpo_outcome_advantage(batch["token_rewards"], batch["mask"].double(), batch["uids"])
    engine = fsdp_engine_class()(batch["logits"].clone().requires_grad_())
    data = verl_mini_batch(batch, advantages, micro_batch_size, use_dynamic_bsz=use_dynamic_bsz)
    output = train_batch_for_tpo(engine, engine.train_batch, data, verl_actor_loss())
    assert engine.forward_only_calls == 1 and len(output["loss"]) > 1
    want_loss, want_grad = unsplit(batch)
    torch.testing.assert_close(torch.tensor(sum(output["loss"]), dtype=torch.float64), want_loss, **EXACT)
    torch.testing.assert_close(engine.logits.grad, want_grad, **EXACT)


def test_the_worker_module_installs_a_training_worker_whose_engine_records(verl_core, monkeypatch):
    """Importing the worker module (what external_lib does) makes verl build the actor's training
    worker as TPOTrainingWorker, whose engine records TPO mini-batches (TrainingWorker's own setup,
    which builds a model engine on GPUs, replaced by a TinyEngine)."""
    engine_workers = pytest.importorskip("verl.workers.engine_workers", reason="verl's engine workers need verl's "
                                         "full dependencies (installed --no-deps here)")
    from tpo_kernels.integrations.verl.worker import TPOTrainingWorker

    assert engine_workers.ActorRolloutRefWorker.actor_worker_cls is TPOTrainingWorker
    batch = reorder(rollout(), balanced_order())
    advantages, _ = compute_tpo_outcome_advantage(batch["token_rewards"], batch["mask"].double(), batch["uids"])
    engine = TinyEngine(batch["logits"].clone().requires_grad_())
    monkeypatch.setattr(engine_workers.TrainingWorker, "__init__", lambda self, config: setattr(self, "engine", engine))
    worker = TPOTrainingWorker(config=None)
    worker.engine.train_batch(verl_mini_batch(batch, advantages, micro_batch_size=3), loss_function=verl_actor_loss())
    assert engine.forward_only_calls == 1
    torch.testing.assert_close(engine.logits.grad, unsplit(batch)[1], **EXACT)


def test_verl_balancing_with_several_mini_batches_per_step_is_refused(verl_core):
    """verl 0.9.1's trainer balances sequence lengths over the ranks on the whole batch (each rank's
    share in row order), then each rank cuts its share into mini-batches of
    ppo_mini_batch_size * rollout.n / ranks rows: with 2 mini-batches per step over 2 ranks, a
    mini-batch holds parts of groups, and the record of it is refused."""
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    ranks, rows_per_mini_batch = 2, B // 4  # per rank: 2 mini-batches
    batch = rollout()
    partitions = get_seqlen_balanced_partitions(calculate_workload(batch["mask"].sum(1)), k_partitions=ranks,
                                                equal_size=True)
    batch = reorder(batch, torch.tensor([row for part in partitions for row in part]))
    share = B // ranks
    first = torch.cat([torch.arange(rank * share, rank * share + rows_per_mini_batch) for rank in range(ranks)])
    uids = batch["uids"]
    assert any(list(uids[first.numpy()]).count(uid) not in (0, K) for uid in set(uids))  # a group spans both
    _, log_prob, kwargs = policy_inputs(batch)
    u, group_ids = decode_advantages(kwargs["advantages"], kwargs["response_mask"])
    mini_batch, _ = gather_record(group_ids[first], u[first], log_prob[first], kwargs["old_log_prob"][first],
                                  kwargs["response_mask"][first])  # both ranks' rows, as the gather gives them
    part = torch.arange(rows_per_mini_batch)  # rank 0's micro-batch: its whole share of the mini-batch
    refused = pytest.raises(ValueError, match="different mini-batches")
    with recorded_rows(mini_batch, part), refused:
        tpo_policy_loss(**{name: value[first[part]] for name, value in kwargs.items()}, config=actor_config())


def test_register_adds_a_loss_with_other_settings(verl_core):
    from tpo_kernels.integrations.verl import register

    register("tpo_test_eta_half", eta=0.5, anchor=False)
    fn = verl_core.get_policy_loss_fn("tpo_test_eta_half")
    assert isinstance(fn, functools.partial) and fn.keywords == dict(eta=0.5, anchor=False, backend="auto")
    with pytest.raises(ValueError, match="eta"):
        register("tpo_bad", eta=0.0)


def test_verl_loads_the_plugin_entry_point_declared_in_pyproject(verl_core):
    """``import verl`` loads every ``verl.plugins`` entry point (in each process, Ray workers
    included); loading ours in a fresh interpreter registers "tpo" for both registries."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"]["verl.plugins"]
    assert declared == {"tpo_kernels": "tpo_kernels.integrations.verl"}
    script = (
        "from importlib.metadata import EntryPoint\n"
        f"EntryPoint('tpo_kernels', {declared['tpo_kernels']!r}, 'verl.plugins').load()\n"
        "from verl.trainer.ppo import core_algos\n"
        "from tpo_kernels.integrations.verl import compute_tpo_outcome_advantage, tpo_policy_loss\n"
        "assert core_algos.get_policy_loss_fn('tpo').func is tpo_policy_loss\n"
        "assert core_algos.get_adv_estimator_fn('tpo') is compute_tpo_outcome_advantage\n"
    )
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="none")  # only the entry point under test registers
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, check=True, timeout=300)
