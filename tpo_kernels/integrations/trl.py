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

* **Whole groups in every micro-batch.** TPO normalizes over the K completions of a prompt, so
  all K must be in one loss call. TRL shuffles the generation batch row by row before splitting it
  into ``steps_per_generation`` micro-batches, which silently splits groups; this trainer shuffles
  whole groups instead, and refuses (``ValueError``) a ``per_device_train_batch_size`` (and, when
  evaluating, a ``per_device_eval_batch_size``) that is not a multiple of ``num_generations``
  (``num_generations_eval``). Every loss call also checks that its rows are a whole number of groups.
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
  the logits by TRL's ``temperature`` (a model's logit multiplier, e.g. Cohere's ``logit_scale``
  or Granite's ``logits_scaling``, is folded into it exactly), runs the head in float32 with
  ``cast_lm_head_to_fp32``, and adds TRL's ``beta`` times the k3 KL to the reference log-probs.
* **Gradient accumulation.** The loss is the mean over the micro-batch's groups (plus the KL
  term's token mean), divided by the number of accumulation steps, so an optimizer step averages
  over every group of the accumulation window (``loss_is_scaled_for_ga`` stays True).
* **Completions without a counted token** (``mask_truncated_completions`` masks every token of a
  truncated completion) are left out of their group: no probability mass, no gradient; a group
  with no counted completion at all is left out of the mean.

Metrics, logged through TRL's metrics (averaged over processes and logging steps):
``tpo/loss`` (the unscaled loss), ``tpo/kl_q_p`` (mean over groups of KL(q || p)),
``tpo/entropy_p`` and ``tpo/entropy_q`` (mean over groups of the entropy, in nats, of the group
distributions p and q), ``tpo/frac_zero_signal_groups`` (groups whose scores tie or that have at
most one counted completion: no reward signal), ``tpo/frac_excluded_completions``,
``tpo/token_entropy`` (mean over counted tokens of the policy's tempered token entropy; a second
vocabulary pass under ``no_grad``, off with ``tpo_log_token_entropy=False``) and, when
``beta > 0``, ``tpo/kl_k3`` (mean over counted tokens of the k3 KL to the reference).

GRPO's own loss settings (``loss_type``, ``epsilon*``, ``delta``, ``importance_sampling_level``,
the SAPO / VESPO parameters) do not apply to TPO and are ignored; the options that would silently
change the objective (``top_entropy_quantile < 1``, an entropy bonus, ``off_policy_mask_threshold``,
``use_bias_correction_kl`` with ``beta > 0``, a MoE router auxiliary loss) are refused; this config
defaults ``use_bias_correction_kl`` to False (TPO's KL term is the plain k3 estimator). Not supported yet:
vision-language models, DeepSpeed ZeRO-3, logit soft-capping (Gemma 2/3).

Tested with TRL 1.16 (the version is checked on import; set ``TPO_KERNELS_ALLOW_UNTESTED_TRL=1``
to try another at your own risk: the trainer overrides private TRL methods).
"""

from __future__ import annotations

import functools
import math
import os
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from ..fused_linear import fused_linear_logprobs, fused_linear_tpo_loss

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

from accelerate.utils import is_peft_model  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import (  # noqa: E402
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

__all__ = ["TargetPOConfig", "TargetPOTrainer", "shuffle_groups", "add_tpo_head", "TESTED_TRL_VERSIONS"]

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
        tpo_log_token_entropy: log ``tpo/token_entropy`` (costs a second vocabulary pass without
            gradient over the micro-batch).

    ``per_device_train_batch_size`` must be a multiple of ``num_generations`` (each micro-batch
    holds whole groups); ``beta``, ``temperature``, ``cast_lm_head_to_fp32`` and the batching fields
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
        metadata={"help": "Log tpo/token_entropy (a second vocabulary pass without gradient)."},
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


def check_tpo_args(args: GRPOConfig) -> None:
    """Raise ``ValueError`` for a configuration TPO cannot train exactly (see the module docstring)."""
    eta = args.tpo_eta
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not math.isfinite(eta) or eta <= 0:
        raise ValueError(f"tpo_eta must be a finite number > 0, got {eta!r}")
    if not isinstance(args.tpo_anchor, bool):
        raise ValueError(f"tpo_anchor must be True or False, got {args.tpo_anchor!r}")
    if args.tpo_backend not in _BACKENDS:
        raise ValueError(f"tpo_backend must be one of {', '.join(_BACKENDS)}, got {args.tpo_backend!r}")
    k = args.num_generations
    if args.per_device_train_batch_size % k != 0:
        raise ValueError(
            f"per_device_train_batch_size ({args.per_device_train_batch_size}) must be a multiple of num_generations "
            f"({k}): TPO normalizes over the {k} completions of a prompt, so every micro-batch must hold whole groups. "
            f"Use per_device_train_batch_size={k * max(1, round(args.per_device_train_batch_size / k))} and adjust "
            "gradient_accumulation_steps / steps_per_generation to keep the batch you want."
        )
    if args.do_eval and args.eval_strategy != "no":
        k_eval = args.num_generations_eval or k
        if args.per_device_eval_batch_size % k_eval != 0:
            raise ValueError(
                f"per_device_eval_batch_size ({args.per_device_eval_batch_size}) must be a multiple of the number of "
                f"generations used for evaluation ({k_eval}), so that each process holds whole groups."
            )
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


def shuffle_groups(
    batch: Dict[str, Any], group_size: int, generator: Optional[torch.Generator] = None
) -> Dict[str, Any]:
    """Shuffle the rows of a TRL batch dict by whole groups of ``group_size`` consecutive rows.

    Tensors with a leading row dimension and lists are permuted in unison; 0-dim tensors and None
    are kept. Rows within a group keep their order.
    """
    sized = [v for v in batch.values() if v is not None and not (isinstance(v, Tensor) and v.ndim == 0)]
    if not sized:
        return dict(batch)
    rows = len(sized[0])
    if rows % group_size != 0:
        raise ValueError(f"cannot shuffle {rows} rows by whole groups of {group_size}")
    order = torch.randperm(rows // group_size, generator=generator)
    perm = (order.unsqueeze(1) * group_size + torch.arange(group_size)).reshape(-1)
    index = perm.tolist()

    def permute(value):
        if value is None or (isinstance(value, Tensor) and value.ndim == 0):
            return value
        if isinstance(value, Tensor):
            return value[perm.to(value.device)]
        return [value[i] for i in index]

    return {key: permute(value) for key, value in batch.items()}


def _logit_multiplier(text_config) -> float:
    """The constant a model multiplies its logits by (1.0 for most models); TPO folds it into the
    temperature, since ``log_softmax(s * z / tau) == log_softmax(z / (tau / s))`` exactly."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text_config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(text_config, "logits_scaling", None)
    if scaling is not None:  # Granite / MiniCPM3 divide by it, HyperCLOVA X multiplies
        return float(scaling) if text_config.model_type == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


def add_tpo_head(model) -> None:
    """Patch ``model.forward`` so that ``model(input_ids, attention_mask, tpo_request=request)``
    returns the TPO loss computed from the final hidden states (see :func:`_tpo_head`); calls
    without ``tpo_request`` go to the previous forward unchanged (TRL's fused head, generation).

    ``model`` is the transformers causal LM (the base model under PEFT). Idempotent.
    """
    if getattr(model.forward, "_tpo_head", False):
        return
    previous = model.forward
    text_config = model.config.get_text_config()
    multiplier = _logit_multiplier(text_config)

    @functools.wraps(type(model).forward)  # keep the signature: generate() validates its kwargs against it
    def forward(self, *args, tpo_request=None, **kwargs):
        if tpo_request is None:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        # Looked up on each call: FSDP and PEFT replace the backbone and the head after patching.
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        return _tpo_head(hidden, self.get_output_embeddings(), tpo_request, multiplier)

    forward._tpo_head = True
    model.forward = types.MethodType(forward, model)


def _head_tensors(hidden: Tensor, head, cast_fp32: bool):
    """hidden, weight and bias of the lm_head in one dtype, as the model would compute its logits."""
    weight, bias = head.weight, head.bias
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        DTensor = ()
    if DTensor and isinstance(weight, DTensor):  # FSDP2: gather the head once, as TRL's fused head does
        weight = weight.full_tensor()
        if bias is not None:
            bias = bias.full_tensor()
    hidden = hidden.to(weight.device)
    device_type = hidden.device.type
    if cast_fp32:
        dtype = torch.float32
    elif torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)  # what autocast would run the head's matmul in
    else:
        dtype = weight.dtype
    # API gap: fused_linear_tpo_loss needs hidden and weight of one dtype. Casting hidden costs
    # [tokens, H]; casting the weight (autocast) is what F.linear under autocast does too.
    hidden = hidden.to(dtype)
    weight = weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    return hidden, weight, bias


def _tpo_head(hidden_all: Tensor, head, request: Dict[str, Any], multiplier: float) -> Dict[str, Any]:
    """The TPO loss of a micro-batch from the backbone's last hidden states ``[N, P + C, H]``.

    ``request`` holds ``labels`` ([N, C] completion ids), ``mask`` ([N, C] bool), ``scores`` ([N]),
    ``group_size``, ``old_logprobs`` / ``ref_logprobs`` ([N, C] or None), ``beta``, ``eta``,
    ``anchor``, ``temperature``, ``backend``, ``cast_lm_head_to_fp32`` and ``token_entropy``.
    Returns ``loss``, ``aux`` (tpo_kernels' aux of the counted rows, or None), ``kept`` ([N] bool),
    ``group_index`` (original group of each kept row), ``labels``, ``mask``, ``ref_logprobs`` of the
    kept rows, and ``token_entropy`` (or None).
    """
    labels, mask, scores = request["labels"], request["mask"], request["scores"]
    num_rows, length = labels.shape
    group_size = request["group_size"]
    hidden = hidden_all[:, -length - 1 : -1]  # position t predicts completion token t
    hidden, weight, bias = _head_tensors(hidden, head, request["cast_lm_head_to_fp32"])
    if multiplier <= 0:
        raise ValueError(f"the model's logit multiplier must be > 0 to fold it into the temperature, got {multiplier}")
    temperature = request["temperature"] / multiplier
    device = hidden.device
    labels, mask, scores = labels.to(device), mask.to(device), scores.to(device)
    old, ref = request["old_logprobs"], request["ref_logprobs"]
    group_index = torch.arange(num_rows, device=device) // group_size
    # API gap: tpo_kernels raises on a completion with no counted token (TRL's
    # mask_truncated_completions makes them routinely). Leave such rows out of the call and name
    # the groups of the others with group_ids: no mass, no gradient, for those completions.
    kept = mask.any(dim=1)
    out: Dict[str, Any] = {"kept": kept, "aux": None, "token_entropy": None}
    with torch.autocast(device.type, enabled=False):
        if not bool(kept.any()):
            # Still a differentiable zero connected to every parameter the loss would touch.
            zero = hidden.sum() * 0.0 + weight.sum() * 0.0
            out.update(loss=zero if bias is None else zero + bias.sum() * 0.0, group_index=group_index[:0])
            out.update(labels=labels[:0], mask=mask[:0], ref_logprobs=None)
            return out
        grouping: Dict[str, Any] = {"group_size": group_size}
        if not bool(kept.all()):
            rows = kept.nonzero().squeeze(1)
            hidden, labels, mask, scores = hidden[rows], labels[rows], mask[rows], scores[rows]
            old = None if old is None else old[rows]
            ref = None if ref is None else ref[rows]
            group_index = group_index[rows]
            grouping = {"group_ids": group_index}
        loss, aux = fused_linear_tpo_loss(
            hidden,
            weight,
            labels,
            scores,
            bias=bias,
            mask=mask,
            old_logprobs=None if old is None else old.to(device),
            ref_logprobs=None if ref is None else ref.to(device),
            beta=request["beta"],
            eta=request["eta"],
            anchor=request["anchor"],
            temperature=temperature,
            reduction="mean",
            backend=request["backend"],
            return_aux=True,
            **grouping,
        )
        if request["token_entropy"]:
            # Second vocabulary pass, without gradient: the TPO forward does not return token entropy yet.
            with torch.no_grad():
                _, entropy = fused_linear_logprobs(
                    hidden.detach(),
                    weight.detach(),
                    labels.masked_fill(~mask, -100),
                    bias=None if bias is None else bias.detach(),
                    temperature=temperature,
                    return_entropy=True,
                    backend=request["backend"],
                )
            out["token_entropy"] = entropy
    out.update(loss=loss, aux=aux, group_index=group_index, labels=labels, mask=mask, ref_logprobs=ref)
    return out


class TargetPOTrainer(GRPOTrainer):
    """:class:`trl.GRPOTrainer` that trains with the Target Policy Optimization loss.

    Same constructor as ``GRPOTrainer``; ``args`` must be a :class:`TargetPOConfig` (default: one
    named after the model). See the module docstring for what changes and why it is exact.
    """

    _tag_names = ["trl", "tpo", "tpo_kernels"]
    _name = "TargetPO"
    _paper = {"title": "Target Policy Optimization", "id": "2604.06159"}

    def __init__(self, model, reward_funcs=None, args: Optional[TargetPOConfig] = None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = TargetPOConfig(f"{str(name).rstrip('/').split('/')[-1] or 'model'}-TargetPO")
        if not isinstance(args, TargetPOConfig):
            raise TypeError(
                f"args must be a TargetPOConfig (a GRPOConfig with the TPO fields), got {type(args).__name__}"
            )
        check_tpo_args(args)  # again: fields may have changed since the config was built
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            raise NotImplementedError(
                "TargetPOTrainer does not support DeepSpeed ZeRO-3 yet: the fused TPO backward recomputes the logits "
                "from the lm_head weight, which ZeRO-3 has re-partitioned by then. Use ZeRO-2 or FSDP2."
            )
        super().__init__(model, reward_funcs, args, **kwargs)
        if self._is_vlm:
            raise NotImplementedError("TargetPOTrainer supports text-only causal LMs for now (no processors / VLMs).")
        if self.aux_loss_enabled:
            raise ValueError(
                "TargetPOTrainer does not add a MoE router auxiliary loss yet; set router_aux_loss_coef=0.0."
            )
        text_config = self.model.config.get_text_config()
        if getattr(text_config, "final_logit_softcapping", None) is not None:
            raise NotImplementedError(
                "TargetPOTrainer does not support logit soft-capping (final_logit_softcapping, Gemma 2/3) yet: "
                "the fused TPO kernels would compute wrong log-probs."
            )
        add_tpo_head(self.model.get_base_model() if is_peft_model(self.model) else self.model)

    # -- batching ----------------------------------------------------------------------------

    def _generation_reused(self) -> bool:
        """True when a generation serves more than one optimizer step, so that its completions were
        sampled by an older policy than the one being trained (TRL then stores old log-probs)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0

    def _prepare_inputs(self, generation_batch):
        """TRL's generation buffering, with a whole-group shuffle instead of the row shuffle."""
        if not self.model.training:  # eval: one batch, generated and used as is
            return super()._prepare_inputs(generation_batch)
        steps = self.args.steps_per_generation
        if self._step % (steps * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            batch = split_pixel_values_by_grid(batch)
            batch = shuffle_groups(batch, self.num_generations)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(part) for part in split_tensor_dict(batch, steps)]
        return self._buffered_inputs[self._step % steps]

    # -- loss --------------------------------------------------------------------------------

    def _tpo_request(self, inputs: Dict[str, Any], mode: str) -> Dict[str, Any]:
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        num_rows = completion_ids.shape[0]
        if num_rows % group_size != 0:
            raise RuntimeError(
                f"a micro-batch of {num_rows} completions is not a whole number of groups of {group_size}: "
                "TPO would normalize over split groups. Use a per-device batch size that is a multiple of "
                "num_generations."
            )
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        if advantages.dim() != 1:
            raise ValueError(f"TPO needs one score per completion, got advantages of shape {tuple(advantages.shape)}")
        old = None
        if mode == "train" and self._generation_reused():
            old = inputs.get("old_per_token_logps")
            if old is None:
                raise RuntimeError("TRL reused a generation but stored no old_per_token_logps")
        return {
            "labels": completion_ids,
            "mask": mask.bool(),
            "scores": advantages,
            "group_size": group_size,
            "old_logprobs": old,
            "ref_logprobs": inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            "beta": float(self.beta),
            "eta": float(self.args.tpo_eta),
            "anchor": self.args.tpo_anchor,
            "temperature": float(self.temperature),
            "backend": self.args.tpo_backend,
            "cast_lm_head_to_fp32": bool(getattr(self.args, "cast_lm_head_to_fp32", False)),
            "token_entropy": bool(self.args.tpo_log_token_entropy),
        }

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        request = self._tpo_request(inputs, mode)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with self.accelerator.autocast():
            out = model(input_ids=input_ids, attention_mask=attention_mask, tpo_request=request)
        loss = out["loss"]
        self._log_tpo_metrics(out, request, mode)
        if mode == "train":  # mean over the groups of the accumulation window
            loss = loss / self.current_gradient_accumulation_steps
        return loss

    # -- metrics -----------------------------------------------------------------------------

    def _log_tpo_metrics(self, out: Dict[str, Any], request: Dict[str, Any], mode: str) -> None:
        loss = out["loss"].detach().float()
        device = loss.device
        num_rows = request["labels"].shape[0]
        num_groups = num_rows // request["group_size"]
        zero = torch.zeros((), device=device)
        kept_groups = kl_qp = entropy_p = entropy_q = signal_groups = zero
        token_entropy = num_tokens = k3 = zero
        aux = out["aux"]
        if aux is not None:
            _, groups = torch.unique(out["group_index"], return_inverse=True)
            count = int(groups.max()) + 1
            p, q, u = aux["p"].float(), aux["q"].float(), aux["u"].float()
            log_p = torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))

            def per_group(values: Tensor) -> Tensor:
                return torch.zeros(count, device=device).index_add_(0, groups, values)

            kept_groups = torch.tensor(float(count), device=device)
            kl_qp = per_group(torch.xlogy(q, q) - q * log_p).sum()
            entropy_p = -per_group(torch.xlogy(p, p)).sum()
            entropy_q = -per_group(torch.xlogy(q, q)).sum()
            signal_groups = (per_group((u != 0).float()) > 0).float().sum()
            mask = out["mask"]
            num_tokens = mask.sum().float()
            if out["token_entropy"] is not None:
                token_entropy = (out["token_entropy"].float() * mask).sum()
            if request["beta"] != 0.0:
                diff = out["ref_logprobs"].float() - aux["token_logprobs"].float()
                k3 = ((torch.exp(diff) - diff - 1.0) * mask).sum()
        stats = torch.stack(
            [
                loss,
                torch.ones((), device=device),
                torch.tensor(float(num_groups), device=device),
                kept_groups,
                kl_qp,
                entropy_p,
                entropy_q,
                signal_groups,
                torch.tensor(float(num_rows), device=device),
                (~out["kept"]).sum().float(),
                token_entropy,
                num_tokens,
                k3,
            ]
        )
        (loss_sum, ranks, groups_total, kept_total, kl_sum, hp_sum, hq_sum, signal_total, rows_total, excluded,
         ent_sum, tokens_total, k3_sum) = self.accelerator.reduce(stats, reduction="sum").tolist()

        def ratio(num: float, den: float) -> float:
            return num / den if den > 0 else float("nan")

        metrics = self._metrics[mode]
        metrics["tpo/loss"].append(loss_sum / ranks)
        metrics["tpo/kl_q_p"].append(ratio(kl_sum, kept_total))
        metrics["tpo/entropy_p"].append(ratio(hp_sum, kept_total))
        metrics["tpo/entropy_q"].append(ratio(hq_sum, kept_total))
        metrics["tpo/frac_zero_signal_groups"].append(ratio(groups_total - signal_total, groups_total))
        metrics["tpo/frac_excluded_completions"].append(ratio(excluded, rows_total))
        if request["token_entropy"]:
            metrics["tpo/token_entropy"].append(ratio(ent_sum, tokens_total))
        if request["beta"] != 0.0:
            metrics["tpo/kl_k3"].append(ratio(k3_sum, tokens_total))
