"""TargetPOConfig: GRPOConfig plus the TPO settings, and the checks TPO needs of a config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from trl import GRPOConfig

from .kept_sets import truncating_settings


_BACKENDS = ("auto", "triton", "cuda", "cpu", "torch")


@dataclass
class TargetPOConfig(GRPOConfig):
    """:class:`trl.GRPOConfig` plus the TPO hyper-parameters.

    Args:
        tpo_eta: target temperature ``eta`` (> 0) of ``q ∝ p_old · exp(u / eta)``; smaller is a
            sharper target. Unrelated to the sampling ``temperature``, which divides the logits.
        tpo_anchor: anchor the target on the rollout policy (``q ∝ p_old · exp(u / eta)``);
            False uses ``q = softmax(u / eta)``.
        tpo_backend: tpo_kernels backend: ``"auto"``, ``"triton"``, ``"cuda"``, ``"cpu"`` or
            ``"torch"``.
        tpo_log_token_entropy: log ``tpo/token_entropy`` (computed in the loss's own vocabulary
            pass, not a second one).
        tpo_length_normalize: sequence log-probs (and the anchor's old ones) as the mean over a
            completion's counted tokens instead of the sum (the default of the author's TRL port).
        tpo_score_eps: the near-tie tolerance (the paper authors' rule) on the raw combined rewards
            of a group: a population std of at most ``tpo_score_eps`` gives the centered scores
            ``u = s - mean`` (not divided by the std), so reward noise carries a signal as small as
            itself; 0 standardizes every group that does not tie exactly. 0 or a number in
            float32's normal range.

    A batch layout GRPOConfig accepts is accepted when each group fits in one optimizer step: a
    group lies in a window of ``W = num_generations / gcd(num_generations, per_device_train_batch_size
    * processes)`` consecutive micro-steps (W = 1 when a step's micro-batch over all processes holds
    whole groups), and ``gradient_accumulation_steps`` must be a multiple of W (else a group would be
    trained under two sets of parameters). ``beta``, ``temperature``, ``cast_lm_head_to_fp32`` and the
    batching fields keep their GRPO meaning. GRPO's loss-shaping fields (``loss_type``,
    ``epsilon``...) and ``scale_rewards`` are ignored (TPO standardizes each group's raw rewards
    itself).
    """

    tpo_eta: float = field(
        default=1.0,
        metadata={"help": "TPO target temperature eta (> 0): q ∝ p_old * exp(u / eta). Smaller is sharper."},
    )
    tpo_anchor: bool = field(
        default=True,
        metadata={"help": "Anchor the TPO target on the rollout policy p_old (False: q = softmax(u / eta))."},
    )
    tpo_backend: str = field(
        default="auto",
        metadata={"help": "tpo_kernels backend: auto, triton, cuda, cpu or torch."},
    )
    tpo_log_token_entropy: bool = field(
        default=True,
        metadata={"help": "Log tpo/token_entropy (computed in the loss's vocabulary pass)."},
    )
    tpo_length_normalize: bool = field(
        default=False,
        metadata={"help": "Sequence log-probs as the mean over counted tokens instead of the sum."},
    )
    tpo_score_eps: float = field(
        default=1e-6,
        metadata={"help": "Near-tie tolerance on a group's raw rewards: population std <= tpo_score_eps gives u = "
                          "s - mean (not divided by the std). 0 or a number in float32's normal range."},
    )
    # GRPO's default multiplies its KL term by a differentiable importance ratio; TPO's KL term is the
    # plain k3 estimator of tpo_kernels, so the default here is False (True is refused when beta != 0).
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={"help": "Not supported by TPO (its KL term is the plain k3 estimator); must stay False."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_tpo_args(self)


# vLLM's importance-sampling modes whose meaning TPO takes over: a completion whose sampler /
# trainer ratio is out of TRL's bounds is left out of its group (see generation_batch.sampler_kept);
# with sequence_truncate each completion counts in its group with its truncated sequence ratio as a
# weight (the loss's seq_log_weights; a ratio of 0 leaves it out).
SAMPLER_MASK_MODES = ("sequence_mask", "token_mask")
SAMPLER_WEIGHT_MODES = ("sequence_truncate",)


def sampler_correction_on(args: GRPOConfig) -> bool:
    """True when TRL computes the sampler's log-probs and its importance-sampling ratio: vLLM
    generation with ``vllm_importance_sampling_correction`` (GRPOTrainer's own condition)."""
    return bool(args.use_vllm and args.vllm_importance_sampling_correction)


def sampler_mode_refusal(mode: str) -> str:
    """Why ``vllm_importance_sampling_mode=mode`` (``token_truncate``) is refused with vLLM's correction on."""
    accepted = SAMPLER_MASK_MODES + SAMPLER_WEIGHT_MODES
    return (
        f"vllm_importance_sampling_mode={mode!r} with vLLM's importance-sampling correction (TPO weighs whole "
        "completions in their group: use "
        f"{', '.join(repr(m) for m in accepted[:-1])} or {accepted[-1]!r}, or vllm_importance_sampling_correction="
        "False. Per-token weights would change each token's share of a completion's sequence log-prob ell_i, not "
        "the completion's weight in its group's p and q, and TPO's group softmax has no per-token reading of them)"
    )


def group_window(per_device_batch_size: int, group_size: int, processes: int) -> int:
    """The number ``W`` of consecutive micro-steps whose micro-batches over all processes hold whole
    groups: the fewest steps of ``per_device_batch_size * processes`` completions that add up to a
    multiple of ``group_size``."""
    return group_size // math.gcd(group_size, per_device_batch_size * processes)


def groups_split_over_processes(per_device_batch_size: int, group_size: int, processes: int) -> bool:
    """True when a process's rows of a window (:func:`group_window` micro-steps) do not hold whole
    groups, so that the loss must gather the groups over the processes (``process_group``)."""
    window = group_window(per_device_batch_size, group_size, processes)
    return (window * per_device_batch_size) % group_size != 0


def _check_train_layout(args: GRPOConfig, processes: int) -> None:
    """A group must lie in one optimizer step (one set of parameters) and one generation: its
    window of :func:`group_window` micro-steps must divide ``gradient_accumulation_steps`` and
    ``steps_per_generation`` (TRL's own check, that the generation batch is a multiple of
    ``num_generations``, is the second)."""
    per_device, group_size = args.per_device_train_batch_size, args.num_generations
    window = group_window(per_device, group_size, processes)
    rows = per_device * processes
    for name in ("gradient_accumulation_steps", "steps_per_generation"):
        value = getattr(args, name)
        if value % window == 0:
            continue
        raise ValueError(
            f"{name} ({value}) must be a multiple of {window}: a micro-step holds {rows} completions "
            f"(per_device_train_batch_size {per_device} x {processes} processes), so a group of {group_size} spans "
            f"{window} consecutive micro-steps, and TPO normalizes over a group within one optimizer step and one "
            f"generation (the group's loss is not a sum over its completions). Use a multiple of {window}, or a "
            f"per_device_train_batch_size x processes that is a multiple of {group_size}."
        )


def _check_eval_layout(per_device: int, group_size: int, processes: int) -> None:
    """An evaluation step (one generation, no accumulation) must hold whole groups over all
    processes, as GRPOConfig itself requires."""
    if (per_device * processes) % group_size == 0:
        return
    raise ValueError(
        f"per_device_eval_batch_size ({per_device}) times the number of processes ({processes}) must be a multiple "
        f"of the evaluation group size ({group_size}): TPO normalizes over the completions of a prompt, and an "
        "evaluation step is one micro-batch."
    )


def _check_vllm_truncation(args: GRPOConfig) -> None:
    """vLLM samples a truncating config from each token's kept set, which TRL does not return: the
    loss could not replay the sets, and full-vocabulary log-probs are not the sampler's."""
    truncation = truncating_settings(args)
    if not args.use_vllm or not truncation:
        return
    raise ValueError(
        f"TargetPOTrainer does not support {', '.join(truncation)} with use_vllm=True: vLLM then samples each token "
        "from the softmax renormalized over a kept set, which TRL does not pass back, so the loss would train on "
        "full-vocabulary log-probs, not the sampler's distribution. Sample without truncation (top_p=1.0, "
        "top_k=0, min_p=None), or generate with transformers (use_vllm=False), whose kept sets the trainer records "
        "and replays."
    )


def check_tpo_args(args: GRPOConfig) -> None:
    """Raise ``ValueError`` for a configuration TPO cannot train exactly (see the module docstring)."""
    eta = args.tpo_eta
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not math.isfinite(eta) or eta <= 0:
        raise ValueError(f"tpo_eta must be a finite number > 0, got {eta!r}")
    for name in ("tpo_anchor", "tpo_length_normalize"):
        if not isinstance(getattr(args, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(args, name)!r}")
    if args.tpo_backend not in _BACKENDS:
        raise ValueError(f"tpo_backend must be one of {', '.join(_BACKENDS)}, got {args.tpo_backend!r}")
    score_eps = args.tpo_score_eps
    fp32 = torch.finfo(torch.float32)
    if (isinstance(score_eps, bool) or not isinstance(score_eps, (int, float))
            or not (score_eps == 0 or fp32.tiny <= score_eps <= fp32.max)):
        raise ValueError(f"tpo_score_eps must be 0 or a number in [{fp32.tiny:.4g}, {fp32.max:.4g}] (a tolerance on "
                         f"the population std of a group's raw rewards), got {score_eps!r}")
    coefs = [("entropy_coef", args.entropy_coef)]
    if args.use_adaptive_entropy:
        coefs += [("entropy_coef_min", args.entropy_coef_min), ("entropy_coef_max", args.entropy_coef_max)]
    for name, value in coefs:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0 (the weight of the entropy bonus "
                             f"loss - {name} * H), got {value!r}")
    processes = args.world_size
    _check_train_layout(args, processes)
    if args.do_eval and args.eval_strategy != "no":
        _check_eval_layout(args.per_device_eval_batch_size, args.num_generations_eval or args.num_generations,
                           processes)
    _check_vllm_truncation(args)
    refused = []
    accepted_modes = SAMPLER_MASK_MODES + SAMPLER_WEIGHT_MODES
    if sampler_correction_on(args) and args.vllm_importance_sampling_mode not in accepted_modes:
        refused.append(sampler_mode_refusal(args.vllm_importance_sampling_mode))
    if args.top_entropy_quantile < 1.0:
        refused.append(f"top_entropy_quantile={args.top_entropy_quantile} (TPO trains every counted token)")
    if args.off_policy_mask_threshold is not None:
        refused.append("off_policy_mask_threshold (TPO's anchor p_old already handles reused generations)")
    if args.use_bias_correction_kl and args.beta != 0.0:
        refused.append("use_bias_correction_kl (TPO's KL term is the plain k3 estimator)")
    if refused:
        raise ValueError("TargetPOTrainer does not support " + "; ".join(refused) + ". Unset them.")
