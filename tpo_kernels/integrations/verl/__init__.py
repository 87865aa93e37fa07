"""verl integration: the TPO loss as a verl policy loss, with an advantage estimator to feed it.

Importing this module registers, when verl is importable, the policy loss ``"tpo"``
(``actor_rollout_ref.actor.policy_loss.loss_mode=tpo``) and the advantage estimator ``"tpo"``
(``algorithm.adv_estimator=tpo``) in verl's registries (``verl.trainer.ppo.core_algos``). verl
imports it by itself in every process: tpo_kernels declares it as a ``verl.plugins`` entry point,
which ``import verl`` loads. Without verl the functions below work alone (verl-shaped tensors in,
``(loss, metrics)`` out); nothing is registered. Tested with verl 0.9.1::

    python -m verl.trainer.main_ppo algorithm.adv_estimator=tpo \\
        actor_rollout_ref.actor.policy_loss.loss_mode=tpo actor_rollout_ref.rollout.n=8 \\
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.use_dynamic_bsz=False ...

How scores and groups reach the loss. verl hands a policy loss ``old_log_prob``, ``log_prob``,
``advantages`` and ``response_mask`` (``[B, T]``) and the actor config, but no uids. So:

* **Scores ride in the advantages.** The ``tpo`` estimator sums each response's token-level
  rewards into its score, standardizes it within its group (``u``, population std, exactly 0
  when the group's scores tie) and writes it on every counted token. The loss reads one score per
  response back (and refuses advantages that vary along a response). TPO standardizes scores
  itself, so any group-relative outcome estimator whose advantages are a positive affine map of
  the score within each group (verl's ``grpo``, ``rloo``) gives the same loss up to rounding.
* **Groups are positions.** The loss takes rows ``[jK, (j+1)K)`` of its micro-batch as one group,
  ``K = rollout.n`` (``config.rollout_n``). verl's rollout writes the n responses of a prompt
  consecutively; the batch must keep that order down to every micro-batch.

The batching contract, and where it is enforced:

* The ``tpo`` estimator receives the uids in the order the actor will receive the rows, and
  raises ``ValueError`` unless each group is one run of K consecutive rows.
* The loss raises ``ValueError`` when ``use_dynamic_bsz`` (micro-batches regrouped by token count)
  or ``shuffle`` is on, when ``ppo_micro_batch_size_per_gpu`` or the micro-batch is not a multiple
  of K, when a data-parallel rank's share of the mini-batch is not, and when a block of K rows
  has advantages that do not sum to zero (not one group, or an estimator that is not
  group-relative; a check that catches most reorderings, not all).
* verl 0.9.1 does not promise that order. Its (v1) trainer balances sequence lengths over
  data-parallel ranks before the advantage step, which splits groups when the actor has more
  than one data-parallel rank (with one, the order is kept), and its replay buffer lists the
  responses in the order its transfer queue holds them. The estimator refuses such a batch.
  Groups split over ranks (``process_group``, see :mod:`tpo_kernels.distributed`) are not wired
  into verl. Tested against verl's registries, config classes and call signatures, not in an
  end-to-end verl run.

The loss is anchored on ``old_log_prob`` (verl's proximal policy: ``p_old``); tied groups then
get ``p - q`` from the difference between ``log_prob`` and ``old_log_prob`` only. Scaling: with
verl's ``global_batch_info`` the micro-batch loss is its share of the mean over every group of
the mini-batch (micro-batch gradients add up, data-parallel ranks average); without it, the mean
over the micro-batch's groups. ``loss_agg_mode`` does not change TPO's term; verl's KL
(``use_kl_loss``) and entropy terms are added by verl as for any policy loss. Per-token importance
weights (``rollout_is_weights``) are refused. Metrics: ``actor/tpo_kl_q_p``, ``actor/tpo_entropy_p``,
``actor/tpo_entropy_q`` (means over groups), ``actor/tpo_frac_zero_signal_groups``, ``actor/ppo_kl``.

Other TPO settings: :func:`register` adds a policy loss under another name, e.g.
``register("tpo_eta05", eta=0.5)`` in a module verl imports (``VERL_USE_EXTERNAL_MODULES`` or
``actor_rollout_ref.model.external_lib``).
"""

from __future__ import annotations

import functools

from ..._validate import check_flag, check_positive
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
