"""verl integration: the TPO loss as a verl policy loss, with an advantage estimator to feed it.

Importing this module registers, when verl is importable, the policy loss ``"tpo"``
(``actor_rollout_ref.actor.policy_loss.loss_mode=tpo``) and the advantage estimator ``"tpo"``
(``algorithm.adv_estimator=tpo``) in verl's registries (``verl.trainer.ppo.core_algos``). verl
imports it by itself in every process: tpo_kernels declares it as a ``verl.plugins`` entry point,
which ``import verl`` loads. Without verl the functions below work alone (verl-shaped tensors in,
``(loss, metrics)`` out); nothing is registered. Tested with verl 0.9.1::

    python -m verl.trainer.main_ppo algorithm.adv_estimator=tpo \\
        actor_rollout_ref.actor.policy_loss.loss_mode=tpo actor_rollout_ref.rollout.n=8 \\
        data.train_batch_size=64 actor_rollout_ref.actor.ppo_mini_batch_size=64 \\
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \\
        actor_rollout_ref.model.external_lib=tpo_kernels.integrations.verl.worker ...

(on 8 GPUs: 64 prompts x 8 responses / 8 ranks = 64 responses per rank, in 4 micro-batches).

How scores and groups reach the loss. verl hands a policy loss ``old_log_prob``, ``log_prob``,
``advantages`` and ``response_mask`` (``[B, T]``) and the actor config, but no uids, and its
trainer reorders the batch before the advantage step. So:

* **Scores and groups ride in the advantages.** The ``tpo`` estimator (on verl's driver, on the
  whole batch in the order the actor will receive it) groups the responses by uid, wherever they
  are, sums each response's token-level rewards into its score and standardizes it within its
  group (``u``, population std, exactly 0 when the group's scores tie). It numbers the groups and
  writes, on every counted token, one float64 value carrying ``u`` (to 2**-24) and the group's id
  (in the bits below; see :mod:`.advantage`): the value differs from ``u`` by less than 2**-24,
  so verl's advantage statistics are unchanged. The loss reads both back and refuses advantages
  that do not carry them (another estimator, or a cast below float64) or that vary along a
  response.
* **Groups are gathered over the data-parallel ranks.** When ``global_batch_info["dp_size"] > 1``
  the loss passes ``process_group`` (the world group, which is the actor's data-parallel group
  under pure data parallelism) with the global group ids to :func:`tpo_loss_from_logprobs`: only
  ``[N]``-sized rows cross ranks, every rank returns the loss of the step's groups, and data
  parallelism's averaging gives every parameter the gradient of the unsplit batch.

Gradient accumulation. When a rank trains its mini-batch in several micro-batches (more rows than
``ppo_micro_batch_size_per_gpu``, or ``use_dynamic_bsz``), a micro-batch holds parts of groups.
Add ``actor_rollout_ref.model.external_lib=tpo_kernels.integrations.verl.worker``: verl then builds
the actor with :class:`.worker.TPOTrainingWorker`, which records each such mini-batch first (one
no-grad forward, every response's current sequence log-prob gathered over the ranks; see
:mod:`.mini_batch`), and each micro-batch's loss takes its groups' other members from the record.
The parameters are fixed over a mini-batch, so the accumulated gradient is the unsplit one, in any
micro-batch layout. Without the worker, a micro-batch step over the ranks that holds part of a
group raises a ``ValueError`` (on every rank) naming the worker and the one-micro-batch setting
(``ppo_micro_batch_size_per_gpu`` = the rank's share, ``use_dynamic_bsz=False``, ``shuffle=False``).

What verl must still guarantee, and where it is checked:

* **Each mini-batch holds whole groups** (over the ranks): a group trained under two parameter
  versions has no single current policy. Checked on the record (and, without it, on the
  micro-batch step over the ranks): a group with fewer than ``rollout_n`` responses there is a
  part, a tied group's too. A response without a counted token still counts: the estimator
  writes its group on its whole row. Only when a response carries no group at all (advantages
  without that row marker) the check falls back to the standardized scores summing to 0 and
  their squares to the group's size, which misses a part of a tied group. verl 0.9.1's
  trainers balance sequence lengths over the whole batch, which spreads groups over the ranks'
  mini-batches: use one mini-batch per step (``ppo_mini_batch_size`` = ``data.train_batch_size``;
  ``ppo_epochs`` may be > 1), one rank, or the legacy trainer (``trainer.use_v1=False``) with
  ``trainer.balance_batch=False``, ``shuffle=False`` and per-rank mini-batches
  (``ppo_mini_batch_size * rollout.n / ranks``) that are whole groups.
* **Pure data parallelism**: the loss cannot see the actor's data-parallel group, so it refuses
  a ``dp_size`` other than the world size (sequence / tensor / pipeline parallelism).
* **float64 advantages** from the estimator to the loss (verl keeps the estimator's dtype).
* Every response of a group that has a counted token; a response without one is left out of
  its group (it carries no advantage, hence no group).

Tested against verl's registries, config classes, call signatures, ``ppo_loss``, micro-batching
functions, balancing function and FSDP engine micro-batch loop (with a stand-in model; that test
needs verl's full dependencies), with groups split over micro-batches and over 2 gloo ranks; not in
an end-to-end verl run (Ray workers, model engines, rollouts).

The loss is anchored on ``old_log_prob`` (verl's proximal policy: ``p_old``); tied groups then
get ``p - q`` from the difference between ``log_prob`` and ``old_log_prob`` only. Scaling: with
verl's ``global_batch_info`` the micro-batch loss is its share of the mean over every group of
the mini-batch (micro-batch gradients add up, data-parallel ranks average); without it, the mean
over the micro-batch's groups. ``loss_agg_mode`` does not change TPO's term; verl's KL
(``use_kl_loss``) and entropy terms are added by verl as for any policy loss: verl's
``entropy_coeff`` is applied by verl's ``ppo_loss`` from the entropy of its own forward (the pass
that gives ``log_prob``), so this loss adds none (it would count twice). Metrics:
``actor/tpo_kl_q_p``, ``actor/tpo_entropy_p``, ``actor/tpo_entropy_q`` (means over the step's
groups once verl averages the ranks' values), ``actor/tpo_frac_zero_signal_groups`` (the same on
every rank), ``actor/ppo_kl`` (this rank's).

Rollout correction (``algorithm.rollout_correction``; decoupled mode, where verl compares the
sampler's ``rollout_log_probs`` with the recomputed ``old_log_prob`` before the advantage step):
a response a sequence-level rejection (``rollout_rs``) masks out has no counted token, so the
estimator standardizes its group without it and the loss leaves it out (no mass, no gradient); it
still carries its group id on its row, so that the loss counts it as a member. Sequence-level
importance weights (``rollout_is=sequence``) count each response ``w`` times in its group
(the loss's ``seq_log_weights=log w``, :func:`.policy_loss._log_weights`); ``w = 0`` is a
rejection. Refused, by the estimator: ``bypass_mode`` (the sampler's log-probs would be TPO's anchor), token-level rejection options and
``rollout_is=token`` (TPO's unit is the whole response); by the loss: per-token weights. The
worker's record carries the weights, so recorded micro-batches add up to the weighted mini-batch.

Other TPO settings: :func:`register` adds a policy loss under another name, e.g.
``register("tpo_eta05", eta=0.5)`` in a module verl imports (``VERL_USE_EXTERNAL_MODULES`` or
``actor_rollout_ref.model.external_lib``).
"""

from __future__ import annotations

import functools

from ...kit import check_flag, check_positive
from .advantage import compute_tpo_outcome_advantage
from .policy_loss import tpo_policy_loss

__all__ = ["compute_tpo_outcome_advantage", "register", "tpo_policy_loss"]


def register(name: str = "tpo", *, eta: float = 1.0, anchor: bool = True, backend: str = "auto") -> None:
    """Register :func:`tpo_policy_loss` with these settings as verl policy loss ``name`` (and the
    ``"tpo"`` advantage estimator, once). Raises ``ImportError`` without verl. ``eta`` and
    ``anchor`` are checked here, ``backend`` at the first call."""
    settings = dict(eta=check_positive("eta", eta), anchor=check_flag("anchor", anchor), backend=backend)
    from verl.trainer.ppo import core_algos

    core_algos.register_policy_loss(name)(functools.partial(tpo_policy_loss, **settings))
    if core_algos.ADV_ESTIMATOR_REGISTRY.get("tpo") is not compute_tpo_outcome_advantage:
        core_algos.register_adv_est("tpo")(compute_tpo_outcome_advantage)


try:
    import verl.trainer.ppo.core_algos  # noqa: F401
except ImportError:  # verl not installed: the functions above work alone
    pass
else:
    register()
