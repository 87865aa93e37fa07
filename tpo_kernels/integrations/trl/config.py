"""TargetPOConfig: GRPOConfig plus the TPO settings, and the checks TPO needs of a config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


from trl import GRPOConfig


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

    ``per_device_train_batch_size`` times the number of processes must be a multiple of
    ``num_generations`` (each step's micro-batch over all processes holds whole groups; a group may
    span processes); ``beta``, ``temperature``, ``cast_lm_head_to_fp32`` and the batching fields
    keep their GRPO meaning. GRPO's loss-shaping fields (``loss_type``, ``epsilon``...) are ignored.
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
    # GRPO's default multiplies its KL term by a differentiable importance ratio; TPO's KL term is the
    # plain k3 estimator of tpo_kernels, so the default here is False (True is refused when beta != 0).
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={"help": "Not supported by TPO (its KL term is the plain k3 estimator); must stay False."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_tpo_args(self)


def groups_split_over_processes(per_device_batch_size: int, group_size: int, processes: int) -> bool:
    """True when a per-device micro-batch does not hold whole groups, so that the loss must gather
    the groups over the processes (``process_group``); each step's global micro-batch still does."""
    return processes > 1 and per_device_batch_size % group_size != 0


def _check_layout(name: str, per_device: int, group_size: int, processes: int) -> None:
    """The micro-batch of one step over all processes (``per_device * processes`` completions)
    must hold whole groups: one loss call sees every completion of a group, under one set of
    parameters. GRPO's per-token loss needs only whole groups per generation batch."""
    if (per_device * processes) % group_size == 0:
        return
    raise ValueError(
        f"{name} ({per_device}) times the number of processes ({processes}) must be a multiple of the group size "
        f"({group_size}): TPO normalizes over the {group_size} completions of a prompt, so the micro-batch of one "
        f"step, over all processes, must hold whole groups. Use a multiple of {group_size // math.gcd(group_size, processes)} "
        "and adjust gradient_accumulation_steps / steps_per_generation to keep the batch you want."
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
    processes = args.world_size
    _check_layout("per_device_train_batch_size", args.per_device_train_batch_size, args.num_generations, processes)
    if args.do_eval and args.eval_strategy != "no":
        k_eval = args.num_generations_eval or args.num_generations
        _check_layout("per_device_eval_batch_size", args.per_device_eval_batch_size, k_eval, processes)
    refused = []
    if args.top_entropy_quantile < 1.0:
        refused.append(f"top_entropy_quantile={args.top_entropy_quantile} (TPO trains every counted token)")
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        refused.append("an entropy bonus (entropy_coef / use_adaptive_entropy)")
    if args.off_policy_mask_threshold is not None:
        refused.append("off_policy_mask_threshold (TPO's anchor p_old already handles reused generations)")
    if args.use_bias_correction_kl and args.beta != 0.0:
        refused.append("use_bias_correction_kl (TPO's KL term is the plain k3 estimator)")
    if refused:
        raise ValueError("TargetPOTrainer does not support " + "; ".join(refused) + ". Unset them.")
