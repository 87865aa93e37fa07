"""TRL integration: train with the TPO loss through TRL's GRPO machinery.

``TargetPOTrainer`` is a :class:`trl.GRPOTrainer` subclass and ``TargetPOConfig`` a
:class:`trl.GRPOConfig` subclass (TRL's own ``trl.experimental.tpo.TPOTrainer`` is an unrelated
method, Triple Preference Optimization, hence the names). Generation, reward functions, the
reference model, vLLM, PEFT and logging are TRL's; only the batching and the loss change::

    from tpo_kernels.integrations.trl import TargetPOConfig, TargetPOTrainer

    args = TargetPOConfig(output_dir="out", num_generations=8, per_device_train_batch_size=16)
    trainer = TargetPOTrainer(model="Qwen/Qwen2.5-0.5B", reward_funcs=my_reward, args=args,
                              train_dataset=dataset)
    trainer.train()

What the trainer does, and why it is exact:

* **Whole groups in every step.** TPO normalizes over the K completions of a prompt, so all K
  must be in one loss call. TRL shuffles the generation batch row by row before splitting it
  into ``steps_per_generation`` micro-batches, which silently splits groups; this trainer shuffles
  whole groups instead. When ``per_device_train_batch_size`` is a multiple of ``num_generations``,
  each process's micro-batch holds whole groups. Otherwise (e.g. 2 per device with 4 generations
  on 2 GPUs, which GRPOTrainer runs) a group spans processes: every completion carries its
  group's id over the generation batch of all processes, each step's micro-batch over all
  processes holds whole groups (rows move between processes when a step needs rows another one
  generated), and the loss gathers the groups through ``process_group`` (the world group): every
  process returns the loss of the whole step and gives its tokens ``P`` times their gradient, so
  that DDP / FSDP averaging gives the single-process gradient. Refused (``ValueError``): a
  ``per_device_train_batch_size`` (``per_device_eval_batch_size``, ``num_generations_eval``) for
  which the step's micro-batch over all processes is not a whole number of groups (stricter than
  GRPO, whose per-token loss only needs whole groups per generation batch).
* **Scores are TRL's advantages.** For every setting of TRL 1.16, the advantage of a completion is
  a positive affine map of its score that is the same for all completions of a group:
  ``(r - mean_group) / (std + 1e-4)`` (``scale_rewards="group"`` or ``"batch"``, the std of the
  group or of the batch), ``r - mean_group`` (``"none"``), where ``r`` is the weighted sum
  ``sum_k w_k r_k`` of the reward functions (``multi_objective_aggregation="sum_then_normalize"``);
  with ``"normalize_then_sum"`` the score is ``sum_k w_k (r_k - mean_k) / (std_k + 1e-4)`` (each
  reward normalized in its group, then weighted, as the user asked TRL to combine them) and the
  advantage a batch-wide affine map of it. TPO standardizes the scores of each group,
  ``u = (s - mean) / std``, which is invariant under any such map, so ``u`` (hence the loss) is the
  same as from the combined rewards, up to float rounding; equal rewards give equal advantages
  bit for bit, so tied groups stay exactly tied. A completion every reward function scored
  ``None`` has advantage 0 in TRL, i.e. counts as scoring the mean of its group.
* **Old log-probs only when a generation is reused.** When TRL reuses a generation across
  optimizer steps (``steps_per_generation * num_iterations`` does not divide
  ``gradient_accumulation_steps``) it stores the rollout policy's per-token log-probs, which become
  TPO's anchor ``p_old``. Otherwise the update is on-policy (``p_old = p``, detached), so a group
  whose scores tie has exactly zero gradient; the per-token log-probs TRL computes for vLLM's
  importance-sampling correction are then not used (TPO applies no importance ratios).
* **Fused head inside the model's forward.** The loss is computed in the model's own ``forward``
  (patched like TRL's fused head, which it wraps) from the final hidden states and the lm_head
  weight with :func:`tpo_kernels.fused_linear_tpo_loss`: no ``[tokens, vocab]`` logits, and DDP /
  FSDP see one ordinary forward; an FSDP2 ``DTensor`` head is gathered there as TRL does. It divides
  the logits by TRL's ``temperature`` after the model's own logit multiplier (Cohere's
  ``logit_scale``, Granite's ``logits_scaling``) and soft-cap (Gemma 2/3's
  ``final_logit_softcapping``), as the model's forward applies them; runs the head in float32 with
  ``cast_lm_head_to_fp32``, and adds TRL's ``beta`` times the k3 KL to the reference log-probs.
* **Gradient accumulation.** The loss is the mean over the micro-batch's groups (plus the KL
  term's token mean), divided by the number of accumulation steps, so an optimizer step averages
  over every group of the accumulation window (``loss_is_scaled_for_ga`` stays True).
* **Mixture-of-experts models** get their router load-balancing loss added as GRPOTrainer adds it:
  ``router_aux_loss_coef`` (from the model config unless set) times the model's own ``aux_loss``
  (router logits requested from the model, its logits kept for one position only), divided by
  the accumulation steps in training; logged as ``aux_loss``.
* **Completions without a counted token** (``mask_truncated_completions`` masks every token of a
  truncated completion) are left out of their group: no probability mass, no gradient; a group
  with no counted completion at all is left out of the mean.

Metrics, logged through TRL's metrics (averaged over processes and logging steps):
``tpo/loss`` (the unscaled loss), ``tpo/kl_q_p`` (mean over groups of KL(q || p)),
``tpo/entropy_p`` and ``tpo/entropy_q`` (mean over groups of the entropy, in nats, of the group
distributions p and q), ``tpo/frac_zero_signal_groups`` (groups whose scores tie or that have at
most one counted completion: no reward signal), ``tpo/frac_excluded_completions``,
``tpo/token_entropy`` (mean over counted tokens of the policy's tempered token entropy, from the
loss's own vocabulary pass; off with ``tpo_log_token_entropy=False``) and, when
``beta > 0``, ``tpo/kl_k3`` (mean over counted tokens of the k3 KL to the reference).

GRPO's own loss settings (``loss_type``, ``epsilon*``, ``delta``, ``importance_sampling_level``,
the SAPO / VESPO parameters) do not apply to TPO and are ignored; the options that would silently
change the objective (``top_entropy_quantile < 1``, an entropy bonus, ``off_policy_mask_threshold``,
``use_bias_correction_kl`` with ``beta > 0``) are refused; this config
defaults ``use_bias_correction_kl`` to False (TPO's KL term is the plain k3 estimator). Not supported yet:
vision-language models, DeepSpeed ZeRO-3.

Tested with TRL 1.16 (the version is checked on import; set ``TPO_KERNELS_ALLOW_UNTESTED_TRL=1``
to try another at your own risk: the trainer overrides private TRL methods).
"""
from __future__ import annotations

import os
import warnings

TESTED_TRL_VERSIONS = ">=1.16,<1.17"
_TESTED_RELEASE = (1, 16)
_ALLOW_UNTESTED_ENV = "TPO_KERNELS_ALLOW_UNTESTED_TRL"


def _check_trl_version() -> None:
    try:
        import trl
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "tpo_kernels.integrations.trl needs TRL: pip install 'tpo_kernels[trl]' "
            f"(trl{TESTED_TRL_VERSIONS})"
        ) from exc
    from packaging.version import Version

    version = Version(trl.__version__)
    if version.release[:2] == _TESTED_RELEASE:
        return
    message = (
        f"tpo_kernels.integrations.trl is tested with trl{TESTED_TRL_VERSIONS}, found trl {trl.__version__}. "
        "TargetPOTrainer overrides private GRPOTrainer methods that change between TRL releases; install "
        f"'trl{TESTED_TRL_VERSIONS}' (pip install 'tpo_kernels[trl]'), or set {_ALLOW_UNTESTED_ENV}=1 to try anyway."
    )
    if os.environ.get(_ALLOW_UNTESTED_ENV, "0") == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return
    raise ImportError(message)


_check_trl_version()
# The modules below import TRL: only after the version check.
from .config import TargetPOConfig, check_tpo_args  # noqa: E402
from .head import add_tpo_head  # noqa: E402
from .trainer import TargetPOTrainer, shuffle_groups  # noqa: E402

__all__ = ["TESTED_TRL_VERSIONS", "TargetPOConfig", "TargetPOTrainer", "add_tpo_head", "check_tpo_args",
           "shuffle_groups"]
