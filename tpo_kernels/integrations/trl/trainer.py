"""TargetPOTrainer: GRPOTrainer with whole-group micro-batches and the TPO loss."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import Tensor

from accelerate.utils import is_peft_model
from trl import GRPOTrainer
from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

from .config import TargetPOConfig, check_tpo_args
from .head import add_tpo_head


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
            "length_normalize": self.args.tpo_length_normalize,
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
        group_size = request["group_size"]
        num_groups = num_rows // group_size
        zero = torch.zeros((), device=device)
        kept_groups = kl_qp = entropy_p = entropy_q = signal_groups = zero
        token_entropy = num_tokens = k3 = zero
        aux = out["aux"]
        if aux is not None:
            # Per-group metrics of the groups with a counted completion; rows are contiguous groups,
            # and a left-out completion has u = 0.
            kept_groups = torch.tensor(float(aux["group_loss"].numel()), device=device)
            kl_qp = aux["kl_q_p"].float().sum()
            entropy_p = aux["entropy_p"].float().sum()
            entropy_q = aux["entropy_q"].float().sum()
            signal_groups = (aux["u"] != 0).view(num_groups, group_size).any(dim=1).float().sum()
            mask = out["mask"]
            num_tokens = mask.sum().float()
            if request["token_entropy"]:
                token_entropy = (aux["token_entropy"].float() * mask).sum()
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
