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

``tiny_model_and_tokenizer()`` builds a 2-layer model and a word-level tokenizer in memory, for a
first run without a download or a GPU (the guide's offline recipe, README.md beside this file).

What the trainer does, and why it is exact:

* **Whole groups in every loss call.** TPO normalizes over the K completions of a prompt, so all
  K must be in one loss call. TRL shuffles the generation batch row by row before splitting it
  into ``steps_per_generation`` micro-batches, which silently splits groups; this trainer shuffles
  whole groups instead. When ``per_device_train_batch_size`` is a multiple of ``num_generations``,
  each process's micro-batch holds whole groups. Otherwise a group spans processes, micro-steps,
  or both, and every completion carries its group's id over the generation batch of all
  processes:

  - *Across processes* (e.g. 2 per device with 4 generations on 2 GPUs, which GRPOTrainer runs):
    each step's micro-batch over all processes holds whole groups (rows move between processes
    when a step needs rows another one generated), and the loss gathers the groups through
    ``process_group`` (the world group): every process returns the loss of the whole step and
    gives its tokens ``P`` times their gradient, so that DDP / FSDP averaging gives the
    single-process gradient.
  - *Across micro-steps* (e.g. 2 per device, 4 generations, ``gradient_accumulation_steps=2`` on
    one process): the groups fill windows of ``W = K / gcd(K, per_device_train_batch_size x
    processes)`` consecutive micro-steps. TPO's loss is not a sum over completions, but its
    gradient is, ``sum_i w (p_i - q_i) grad ell_i``, and the parameters do not change within an
    optimizer step; so each micro-step's loss call takes its whole groups: its own rows with
    gradient, and the window's other rows with their token log-probs detached, computed under the
    same parameters in the same train mode and autocast (one no-grad forward of each of the
    window's other micro-batches when the window starts; the first micro-step's rows reuse their
    own forward's values: ``(W - 1) / W`` of the rows get a second, no-grad, forward). The W calls'
    gradients add up to the gradient of the window's mean; each call's loss is multiplied by W
    straight through (value unchanged), so that, after TRL's division by the accumulation steps,
    the optimizer step's gradient and its logged loss are those of the whole step's batch in one
    loss call (with ``beta > 0`` the KL term's token mean is per window). The detached log-probs
    are recomputed for every window, so a generation reused for several optimizer steps
    (``num_iterations > 1``, ``steps_per_generation`` > ``gradient_accumulation_steps``) sees the
    current parameters. Exact when the model runs
    without dropout in training (TRL's ``disable_dropout=True``, or a model without dropout): with
    dropout, a row's log-prob in the other micro-steps' calls is another dropout draw. When a
    process's rows of a window are not whole groups either, the calls also gather over the
    processes, as above.

  Refused (``ValueError``): a ``gradient_accumulation_steps`` (or ``steps_per_generation``) that is
  not a multiple of W (a group would be trained under two sets of parameters: stricter than GRPO,
  whose per-token loss only needs whole groups per generation batch), and an evaluation batch over
  all processes that is not a whole number of groups (GRPOConfig refuses it too).
* **Scores are the raw combined rewards.** The trainer passes the loss ``tpo_scores``, this
  process's slice of the weighted sum ``sum_k w_k r_k`` of the reward functions' raw outputs
  (gathered over processes, as TRL combines them before its advantages), and the loss standardizes
  each group itself with the authors' near-tie rule: a group whose rewards have a population std
  of at most ``tpo_score_eps`` (default 1e-6) gets ``u = s - mean``, not divided by the std, so
  reward noise carries a signal as small as itself; other groups get ``u = (s - mean) / std``; exact
  ties give ``u = 0``. (TRL's advantages ``(r - mean) / (std + 1e-4)`` would turn a 1e-7 spread into
  a 1e-3 one before any tolerance could see it; they are not used.) With
  ``multi_objective_aggregation="normalize_then_sum"`` each reward is first standardized within its
  group by the same rule (population std, ``tpo_score_eps``), then weighted and summed. A
  completion every reward function scored ``None`` (advantage 0 in TRL) gets its group's mean
  score. ``scale_rewards`` only shapes TRL's advantages (still logged by TRL): whatever its value,
  TPO's ``u`` is the per-group standardization above, so ``"batch"`` and ``"none"`` do not change
  the loss, like GRPO's other loss-shaping fields.
* **Old log-probs only when a generation is reused.** When TRL reuses a generation across
  optimizer steps (``steps_per_generation * num_iterations`` does not divide
  ``gradient_accumulation_steps``) it stores the rollout policy's per-token log-probs, which become
  TPO's anchor ``p_old``. Otherwise the update is on-policy (``p_old = p``, detached), so a group
  whose scores tie has exactly zero gradient. The anchor is always the trainer's log-probs, never
  the sampler's (vLLM's).
* **The sampler-trainer mismatch (vLLM).** With ``use_vllm`` and
  ``vllm_importance_sampling_correction`` (TRL's default), TRL compares its recomputed old
  log-probs with the sampler's; in the masking modes (``"sequence_mask"``, the default, and
  ``"token_mask"``) a completion whose ratio (or any of whose counted tokens' ratios) lies outside
  TRL's ``[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max]`` is left out of
  its group (its token mask is zeroed: no probability mass, no gradient, the rest renormalized).
  ``"sequence_truncate"`` counts each completion in its group with TRL's truncated ratio as a
  weight, in both ``p`` and ``q`` (the loss's ``seq_log_weights``); ``"token_truncate"`` is refused
  (per-token weights have no reading in the group softmax; the math: this folder's README.md).
  Without vLLM nothing changes.
* **Top-k / top-p / min-p.** With transformers generation the sampler's kept set of every token
  is recorded (a last logits processor) and every log-prob the loss reads (its own, the detached
  rows', the old and reference ones, recomputed) is over it (``sampling_mask=``); nothing is
  recorded or passed when nothing is truncated. With vLLM, whose kept sets TRL does not return, a
  truncating config is refused (README.md beside this file).
* **Entropy bonus.** ``entropy_coef`` trains ``loss - entropy_coef * H``, ``H`` the mean tempered
  token entropy of the loss call's counted tokens, from the loss's own vocabulary pass;
  ``use_adaptive_entropy`` runs TRL's controller on that entropy (same state, so TRL saves it in
  checkpoints).
* **Fused head inside the model's forward.** The loss is computed in the model's own ``forward``
  (patched like TRL's fused head, which it wraps) from the final hidden states and the lm_head
  weight with :func:`tpo_kernels.fused_linear_tpo_loss`: no ``[tokens, vocab]`` logits, and DDP /
  FSDP see one ordinary forward; an FSDP2 ``DTensor`` head is gathered there as TRL does. It divides
  the logits by TRL's ``temperature`` after the model's own logit multiplier (Cohere's
  ``logit_scale``, Granite's ``logits_scaling``) and soft-cap (Gemma 2/3's
  ``final_logit_softcapping``), as the model's forward applies them; runs the head in float32 with
  ``cast_lm_head_to_fp32``, and adds TRL's ``beta`` times the k3 KL to the reference log-probs.
* **Gradient accumulation.** The loss is the mean over the loss call's groups (plus the KL term's
  token mean over the call's rows), divided by the number of accumulation steps (and multiplied by
  W straight through when groups span W micro-steps), so an optimizer step averages over every
  group of the accumulation window (``loss_is_scaled_for_ga`` stays True).
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
``beta > 0``, ``tpo/kl_k3`` (mean over counted tokens of the k3 KL to the reference), and with
vLLM's correction ``tpo/frac_masked_by_sampler`` (next to TRL's ``sampling/*`` metrics). Under
GRPOTrainer's names, as it computes them (over this micro-step's counted tokens, every process's):
``entropy`` (the token entropy, when computed), ``kl`` (``beta > 0``) and, with the entropy bonus
on, ``policy_loss`` (the loss before the bonus; ``tpo/loss`` and TRL's ``loss`` include it).

GRPO's own loss settings (``loss_type``, ``epsilon*``, ``delta``, ``importance_sampling_level``,
the SAPO / VESPO parameters, ``scale_rewards``) do not apply to TPO and are ignored; the options that would silently
change the objective (``top_entropy_quantile < 1``, ``off_policy_mask_threshold``,
``use_bias_correction_kl`` with ``beta > 0``, ``vllm_importance_sampling_mode="token_truncate"`` with
vLLM's correction on, truncated sampling with vLLM) are refused; this config
defaults ``use_bias_correction_kl`` to False (TPO's KL term is the plain k3 estimator). Not supported yet:
vision-language models, DeepSpeed ZeRO-3.

Tested with TRL 1.15 and 1.16 (the version is checked on import; set
``TPO_KERNELS_ALLOW_UNTESTED_TRL=1`` to try another at your own risk). The trainer overrides
private GRPOTrainer methods: their signatures are checked on import in every case
(:mod:`.private_api`), so a release that changes one fails there, naming it. Under TRL 1.15 without
its Triton kernels (TRL's fused head then has no kernel; 1.16 falls back to torch), the trainer
serves TRL's fused-head calls (old and reference log-probs) with tpo_kernels' own.
"""
from __future__ import annotations

import os
import warnings

TESTED_TRL_VERSIONS = ">=1.15,<1.17"
_TESTED_RELEASES = ((1, 15), (1, 16))
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
    if version.release[:2] in _TESTED_RELEASES:
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
# The modules below import TRL: only after the version check. Any release, tested or not, must
# have the private GRPOTrainer API the trainer overrides (else an ImportError names what changed).
from .private_api import check_private_api  # noqa: E402

check_private_api()
from .config import TargetPOConfig, check_tpo_args  # noqa: E402
from .head import add_tpo_head  # noqa: E402
from .generation_batch import shuffle_groups  # noqa: E402
from .trainer import TargetPOTrainer  # noqa: E402
from .tiny import tiny_model_and_tokenizer  # noqa: E402

__all__ = ["TESTED_TRL_VERSIONS", "TargetPOConfig", "TargetPOTrainer", "add_tpo_head", "check_tpo_args",
           "shuffle_groups", "tiny_model_and_tokenizer"]
