"""TargetPOTrainer: GRPOTrainer with whole-group micro-batches and the TPO loss.

The class reads in the order of a step: batching (generation, scores, whole-group micro-batches),
the loss call's request, the entropy bonus, the rows a group's other micro-steps hold, and the
loss. The plain functions of TRL's batch it calls are in :mod:`.generation_batch`, its metrics in
:mod:`.metrics`.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from accelerate.utils import is_peft_model
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

from ... import kit
from .config import (SAMPLER_MASK_MODES, SAMPLER_WEIGHT_MODES, TargetPOConfig, check_tpo_args, group_window,
                     groups_split_over_processes, sampler_mode_refusal)
from .generation_batch import padded_to_width, sampler_kept, shuffle_groups, take_rows, tpo_scores_from_rewards
from .head import add_tpo_head, serve_trl_fused_head, trl_fused_head_missing
from .kept_sets import KEPT_IDS
from .metrics import log_tpo_metrics
from .replay import KeptSetReplay
from .request import TPORequest


class TargetPOTrainer(KeptSetReplay, GRPOTrainer):
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
            args = TargetPOConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'model'}-TargetPO")
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
        policy = self.model.get_base_model() if is_peft_model(self.model) else self.model
        if trl_fused_head_missing():  # TRL 1.15 without its Triton kernels: its fused head would fail
            for model_ in (policy, self.ref_model):
                if model_ is not None:
                    serve_trl_fused_head(self.accelerator.unwrap_model(model_), temperature=float(self.temperature),
                                         cast_lm_head_to_fp32=bool(self.args.cast_lm_head_to_fp32),
                                         backend=self.args.tpo_backend)
        add_tpo_head(policy)
        self._tpo_recorder_slot = self._kept_set_recording(policy)
        # The token log-probs of the current window's micro-batches, by place (see _detached_rows).
        self._tpo_window_key: Optional[int] = None
        self._tpo_window_rows: Dict[int, Any] = {}

    # -- batching ----------------------------------------------------------------------------

    def _sampler_correction_on(self) -> bool:
        """GRPOTrainer's condition for computing the sampler's log-probs and the importance-sampling
        ratio (vLLM generation with ``vllm_importance_sampling_correction``)."""
        return bool(self.use_vllm and self.vllm_importance_sampling_correction)

    def _generation_reused(self) -> bool:
        """True when a generation serves more than one optimizer step, so that its completions were
        sampled by an older policy than the one being trained (TRL then stores old log-probs)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0

    def _group_size(self, mode: str) -> int:
        return self.num_generations if mode == "train" else self.num_generations_eval

    def _per_device(self, mode: str) -> int:
        return self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size

    def _window(self, mode: str) -> int:
        """The number of consecutive micro-steps a group spans (1 when a step's micro-batch over all
        processes holds whole groups; always 1 in evaluation, whose steps GRPOConfig makes whole)."""
        return group_window(self._per_device(mode), self._group_size(mode), self.accelerator.num_processes)

    def _groups_split(self, mode: str) -> bool:
        """True when a group's completions lie on several processes (a process's rows of a window
        are not whole groups): the loss then gathers them."""
        return groups_split_over_processes(self._per_device(mode), self._group_size(mode),
                                           self.accelerator.num_processes)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards (gathered over processes), kept for :meth:`_generate_and_score_completions`."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._tpo_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        """TRL's generation, plus ``tpo_scores``: this process's completions' scores from the raw
        rewards (:func:`tpo_scores_from_rewards`), which the loss standardizes itself with
        ``tpo_score_eps`` (TRL's advantages are not used), and ``tpo_group_ids``: each completion's
        group, numbered over the generation batch of all processes (TRL lays it out process after
        process, each prompt's completions consecutive), so that rows can move between micro-batches
        and processes."""
        batch = super()._generate_and_score_completions(inputs)  # with the kept sets (KeptSetReplay)
        rows = batch["completion_ids"].shape[0]
        first = self.accelerator.process_index * rows
        group_size = self._group_size("train" if self.model.training else "eval")
        device = batch["completion_ids"].device
        scores = tpo_scores_from_rewards(self._tpo_rewards_per_func, self.reward_weights, group_size,
                                         self.multi_objective_aggregation, self.args.tpo_score_eps)
        batch["tpo_scores"] = scores[first : first + rows].to(device)
        batch["tpo_group_ids"] = torch.arange(first, first + rows, device=device) // group_size
        if self._sampler_correction_on():
            # TRL has computed (and logged) the sampler / trainer ratio; the completions it masks are
            # left out of their group by their token mask (see _token_mask); with sequence_truncate
            # each completion counts with its truncated ratio as a weight (a ratio of 0: left out).
            mode = self.vllm_importance_sampling_mode
            if mode not in SAMPLER_MASK_MODES + SAMPLER_WEIGHT_MODES:  # the config refuses it too
                raise ValueError("TargetPOTrainer does not support " + sampler_mode_refusal(mode))
            ratio = batch["importance_sampling_ratio"]
            if mode in SAMPLER_WEIGHT_MODES:  # [rows, 1]: min(max(rho, clip_min), clip_max), rho TRL's ratio
                batch["tpo_seq_log_weights"] = ratio[:, 0].to(torch.float64).log()
                kept = batch["tpo_seq_log_weights"] > float("-inf")
            else:
                kept = sampler_kept(ratio, self._token_mask(batch))
                batch["tpo_sampler_kept"] = kept
            counts = torch.stack([(~kept).sum(), torch.tensor(rows, device=kept.device)]).float()
            masked, total = kit.sum_over_ranks(counts, self._world_group(), "sampler_masked").tolist()
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["tpo/frac_masked_by_sampler"].append(masked / total if total > 0 else float("nan"))
        return batch

    def _prepare_inputs(self, generation_batch):
        """TRL's generation buffering, with micro-batches whose windows (:meth:`_window` consecutive
        micro-steps, over all processes) hold whole groups, instead of TRL's row shuffle."""
        if not self.model.training:  # eval: one batch, generated and used as is
            return super()._prepare_inputs(generation_batch)
        steps = self.args.steps_per_generation
        if self._step % (steps * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            if self._groups_split("train"):
                self._buffered_inputs = self._split_micro_batches(batch)
            else:
                batch = split_pixel_values_by_grid(batch)
                batch = shuffle_groups(batch, self.num_generations)
                self._buffered_inputs = [unsplit_pixel_values_by_grid(part) for part in split_tensor_dict(batch, steps)]
        return self._buffered_inputs[self._step % steps]

    def _split_micro_batches(self, batch: Dict[str, Any]) -> List[Dict[str, Any]]:
        """This process's ``steps_per_generation`` micro-batches when groups span processes: the
        groups of the whole generation batch, shuffled by group in the same order on every process,
        fill the windows one after the other; each window's micro-batches over all processes are
        whole groups, of which this process takes ``window * per_device_train_batch_size`` rows, its
        micro-batch of each step in turn. Rows move between processes only when a step needs rows
        another process generated."""
        steps, group_size, window = self.args.steps_per_generation, self.num_generations, self._window("train")
        processes, rank = self.accelerator.num_processes, self.accelerator.process_index
        local_rows = batch["completion_ids"].shape[0]
        num_groups = processes * local_rows // group_size
        if steps > 1:  # the same permutation on every process: seeded by the step, not by the global RNG
            generator = torch.Generator().manual_seed(self.args.seed + self._step)
            groups = torch.randperm(num_groups, generator=generator)
        else:
            groups = torch.arange(num_groups)
        order = groups.unsqueeze(1) * group_size + torch.arange(group_size)
        # [window, process, step of the window, row] -> [step, process, row]
        order = order.view(steps // window, processes, window, -1).transpose(1, 2).reshape(steps, processes, -1)
        holder = order // local_rows  # the process that generated each row
        if bool((holder == torch.arange(processes).view(1, -1, 1)).all()):
            rows, first = batch, rank * local_rows
        else:
            rows, first = self._gather_generation_batch(batch), 0
        return [take_rows(rows, order[step, rank] - first) for step in range(steps)]

    def _world_group(self):
        """The process group over all processes (None for one process): the kit's collectives run
        over it, as accelerate's do."""
        return dist.group.WORLD if self.accelerator.num_processes > 1 else None

    def _gather_generation_batch(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        """The generation batch of every process, in process order: ``[rows, ...]`` tensors are
        padded to a common width (prompts on the left, completions on the right, as TRL pads them;
        kept ids with -1, kept counts with 0: no token) and gathered; 0-dim tensors and None are
        kept. Every process must hold the same keys (one gather each, in the dict's order)."""
        pad_ids = {"prompt_ids": self._tokenizer.pad_token_id, "completion_ids": self._tokenizer.pad_token_id,
                   KEPT_IDS: -1}
        group = self._world_group()
        out = {}
        for key, value in batch.items():
            if value is None or (isinstance(value, Tensor) and value.ndim == 0):
                out[key] = value
                continue
            if not isinstance(value, Tensor):
                raise NotImplementedError(f"cannot move the generation batch's {key!r} ({type(value).__name__}) "
                                          "between processes")
            if value.ndim > 1:
                widths = kit.gather_rows(torch.tensor([value.shape[1]], device=value.device), group, "batch_widths")
                value = padded_to_width(value, int(widths.rows.max()), pad_ids.get(key, 0),
                                        left=key.startswith("prompt"))
            out[key] = kit.gather_rows(value, group, "generation_batch").rows
        return out

    # -- loss --------------------------------------------------------------------------------

    def _token_mask(self, inputs: Dict[str, Any]) -> Tensor:
        """The counted tokens: TRL's completion (and tool) mask; none of a completion the sampler
        check left out (``tpo_sampler_kept``), which leaves it out of its group."""
        mask = inputs["completion_mask"]
        mask = (mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]).bool()
        kept = inputs.get("tpo_sampler_kept")
        return mask if kept is None else mask & kept.to(mask.device).unsqueeze(1)

    def _old_logprobs(self, inputs: Dict[str, Any], mode: str) -> Optional[Tensor]:
        """TRL's stored rollout log-probs when a generation is reused (TPO's anchor), else None
        (``p_old = p``, detached). ``old_per_token_logps`` is the trainer's own no-grad forward at
        generation time, also under vLLM; the sampler's log-probs (``sampling_per_token_logps``)
        are never the anchor."""
        if mode != "train" or not self._generation_reused():
            return None
        old = inputs.get("old_per_token_logps")
        if old is None:
            raise RuntimeError("TRL reused a generation but stored no old_per_token_logps")
        return old

    def _head_settings(self) -> Dict[str, Any]:
        """The request fields the vocabulary pass reads (the loss's and the detached rows' alike)."""
        return {
            "temperature": float(self.temperature),
            "backend": self.args.tpo_backend,
            "cast_lm_head_to_fp32": bool(getattr(self.args, "cast_lm_head_to_fp32", False)),
            # The entropy bonus reads it too (the adaptive controller's statistics; the detached rows' H).
            "token_entropy": bool(self.args.tpo_log_token_entropy) or self._entropy_bonus_on(),
        }

    def _tpo_request(self, inputs: Dict[str, Any], mode: str, detached: Optional[kit.LossRows] = None
                     ) -> TPORequest:
        group_size = self._group_size(mode)
        split = self._groups_split(mode)
        num_rows = inputs["completion_ids"].shape[0] + (0 if detached is None else detached.num_rows)
        if not split and num_rows % group_size != 0:
            raise RuntimeError(
                f"a loss call of {num_rows} completions is not a whole number of groups of {group_size}: "
                "TPO would normalize over split groups"
            )
        scores = inputs["tpo_scores"]
        if scores.dim() != 1:
            raise ValueError(f"TPO needs one score per completion, got tpo_scores of shape {tuple(scores.shape)}")
        group_ids = inputs["tpo_group_ids"]
        # Groups spanning processes or micro-steps: global ids (gathered over the world group
        # when they span processes); whole groups in the micro-batch: consecutive blocks of K.
        by_ids = split or detached is not None
        return TPORequest(
            labels=inputs["completion_ids"],
            mask=self._token_mask(inputs),
            sampling_mask=self._kept_sets(inputs),
            scores=scores,
            group_size=None if by_ids else group_size,
            group_ids=group_ids if by_ids else None,
            process_group=dist.group.WORLD if split else None,
            metric_group_ids=group_ids if detached is None else torch.cat([group_ids, detached.group_ids]),
            old_logprobs=self._old_logprobs(inputs, mode),
            ref_logprobs=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            seq_log_weights=inputs.get("tpo_seq_log_weights"),
            detached=detached,
            beta=float(self.beta),
            eta=float(self.args.tpo_eta),
            anchor=self.args.tpo_anchor,
            score_eps=float(self.args.tpo_score_eps),
            length_normalize=self.args.tpo_length_normalize,
            router_aux_loss=self.aux_loss_enabled,
            entropy_coef=self._applied_entropy_coef(),
            **self._head_settings(),
        )

    # -- entropy bonus ------------------------------------------------------------------------

    def _entropy_bonus_on(self) -> bool:
        """GRPOTrainer's condition: a non-zero ``entropy_coef``, or the adaptive controller (which
        stays on when it has brought the coefficient to ``entropy_coef_min``)."""
        return bool(self.entropy_coef != 0.0 or self.use_adaptive_entropy)

    def _applied_entropy_coef(self) -> float:
        """The coefficient of this micro-step's bonus ``- c * H``, as GRPOTrainer applies it: the
        static ``entropy_coef``, or, adaptive, the coefficient set at the end of the previous
        optimizer step, applied only while the last window's entropy was at most ``entropy_target``."""
        if not self._entropy_bonus_on():
            return 0.0
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            return 0.0
        return float(self.entropy_coef)

    def _update_adaptive_entropy(self, out: Dict[str, Any], num_rows: int, mode: str) -> None:
        """GRPOTrainer's adaptive controller on the loss's own token entropy: add this micro-step's
        rows' entropy sum and token count to the window's; at the optimizer step's end, reduce them
        over processes and move ``entropy_coef`` by ``entropy_coef_delta`` toward more entropy when
        the window's mean is at most ``entropy_target`` (within ``[entropy_coef_min, entropy_coef_max]``);
        then log ``entropy_coef`` on optimizer-step boundaries, as TRL does."""
        if self.use_adaptive_entropy and mode == "train":
            mask = out["mask"][:num_rows]
            if out["aux"] is None:
                entropy_sum = torch.zeros((), device=mask.device)
            else:
                entropy_sum = (out["aux"]["token_entropy"][:num_rows].float() * mask).sum()
            stats = torch.stack([entropy_sum.detach().float(), mask.sum().float()])
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:
                totals = kit.sum_over_ranks(self._entropy_window_stats, self._world_group(), "entropy_window")
                world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + self.args.entropy_coef_delta,
                                            self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - self.args.entropy_coef_delta,
                                            self.args.entropy_coef_min)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    def _window_place(self):
        """(micro-batches of this step's window in the generation buffer, this step's place in it,
        the window's key: its first micro-step, unique over the run)."""
        window = self._window("train")
        index = self._step % self.args.steps_per_generation
        place = index % window
        first = index - place
        return self._buffered_inputs[first : first + window], place, self._step - place

    def _detached_rows(self, model) -> kit.LossRows:
        """The rows of this step's groups that the window's other micro-steps hold, as the loss call
        takes them (see ``detached`` in :func:`head._tpo_head`). Their token log-probs are computed
        once per window under the current parameters (the window lies in one optimizer step), in the
        same train mode and autocast as the loss: by one no-grad forward of each other micro-batch
        when the window starts, or from an earlier micro-step's own loss call (kept by
        :meth:`_keep_rows`)."""
        batches, place, key = self._window_place()
        if self._tpo_window_key != key:
            self._tpo_window_key, self._tpo_window_rows = key, {}
        kept = self._tpo_window_rows
        parts = []
        for other, batch in enumerate(batches):
            if other == place:
                continue
            if other not in kept:
                kept[other] = self._token_logprobs_no_grad(model, batch)
            token_logprobs, entropy = kept[other]
            parts.append(kit.LossRows(
                logprobs=token_logprobs, token_entropy=entropy, mask=self._token_mask(batch),
                scores=batch["tpo_scores"], group_ids=batch["tpo_group_ids"],
                old_logprobs=self._old_logprobs(batch, "train"),
                ref_logprobs=batch.get("ref_per_token_logps") if self.beta != 0.0 else None,
                seq_log_weights=batch.get("tpo_seq_log_weights")))
        return functools.reduce(kit.add_constant_members, parts)

    def _token_logprobs_no_grad(self, model, batch: Dict[str, Any], entropy: Optional[bool] = None):
        """A micro-batch's token log-probs and entropy (None when the head computes none; ``entropy``
        overrides whether it does), on the rows' kept sets when they carry them."""
        settings = self._head_settings()
        if entropy is not None:
            settings["token_entropy"] = entropy
        request = TPORequest(logprobs_only=True, labels=batch["completion_ids"], mask=self._token_mask(batch),
                             sampling_mask=self._kept_sets(batch), **settings)
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            with self.accelerator.autocast():
                out = model(input_ids=input_ids, attention_mask=attention_mask, tpo_request=request)
        return out["token_logprobs"], out["token_entropy"]

    def _keep_rows(self, out: Dict[str, Any], num_rows: int) -> None:
        """Keep this micro-step's own token log-probs (and entropy) for the window's later steps."""
        _, place, _ = self._window_place()
        if place in self._tpo_window_rows:
            return
        aux = out["aux"]
        if aux is None:  # no counted token in the call: the log-probs are 0 under the mask
            zeros = torch.zeros(out["mask"][:num_rows].shape, device=out["mask"].device)
            self._tpo_window_rows[place] = (zeros, zeros if self._head_settings()["token_entropy"] else None)
            return
        entropy = aux["token_entropy"][:num_rows] if self._head_settings()["token_entropy"] else None
        self._tpo_window_rows[place] = (aux["token_logprobs"][:num_rows], entropy)

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        window = self._window(mode)
        detached = self._detached_rows(model) if window > 1 else None
        request = self._tpo_request(inputs, mode, detached)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with self.accelerator.autocast():
            out = model(input_ids=input_ids, attention_mask=attention_mask, tpo_request=request)
        loss = out["loss"]
        if window > 1:
            self._keep_rows(out, inputs["completion_ids"].shape[0])
            # The call's value is the mean over the window's groups, its gradient that of this step's
            # rows only: the window's W calls add up to W times that mean's value but to its
            # gradient once. Divided by the accumulation steps below, the values average to the
            # optimizer step's mean and the gradients to 1/W of its gradient; W times the gradient,
            # straight through (value unchanged), makes it whole.
            loss = window * loss - (window - 1) * loss.detach()
        group = self._world_group()
        log_tpo_metrics(self._metrics[mode], lambda rows: kit.gather_rows(rows, group, "metrics").rows, out, request,
                        entropy_bonus=self._entropy_bonus_on())
        if self._entropy_bonus_on():
            self._update_adaptive_entropy(out, inputs["completion_ids"].shape[0], mode)
        # Mean over the groups of the accumulation window; the MoE load-balancing loss is added
        # as GRPOTrainer adds it (its coefficient and router logits from the model config).
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1
        loss = loss / normalizer
        if self.aux_loss_enabled:
            aux_loss = out["router_aux_loss"]
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
            every = kit.gather_rows(aux_loss.detach().reshape(1), group, "router_aux_loss").rows
            self._metrics[mode]["aux_loss"].append(every.mean().item())
        return loss
