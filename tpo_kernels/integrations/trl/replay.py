"""Kept-set replay in the trainer: the part of :class:`~.trainer.TargetPOTrainer` that records a
truncating sampler's kept sets during transformers generation (:mod:`.kept_sets`) and makes every
log-prob the loss reads (its own, the old and reference ones, the detached rows') use them.

With vLLM, TRL 1.16 does not return the sampler's kept sets, so a truncating config is refused by
:func:`~.config.check_tpo_args`; here a config that truncates where nothing can be recorded (tools,
``rollout_func``, continuous batching) or replayed exactly (the reference log-probs under PEFT) is
refused at the trainer's construction.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from trl import GRPOTrainer

from ... import SamplingMask, kit
from .generation_batch import take_rows
from .kept_sets import (KEPT_COUNTS, KEPT_IDS, KeptSetRecorder, RecorderSlot, install_kept_set_recorder,
                        kept_set_rows, sampling_mask_of, truncating_settings)


class KeptSetReplay(GRPOTrainer):
    """The kept-set methods of TargetPOTrainer (which inherits them before GRPOTrainer): it calls
    :meth:`_kept_set_recording` once at construction and :meth:`_kept_sets` for each loss call's
    rows; the generation override below adds the kept sets to TRL's batch."""

    _tpo_recorder_slot: Optional[RecorderSlot] = None

    def _kept_set_recording(self, policy) -> Optional[RecorderSlot]:
        """Where the sampler's kept sets are recorded: the policy's ``generate`` when TRL samples with
        transformers' ``generate``, one call per generation batch (None otherwise: nothing recorded).
        Every such generation is recorded, since any logits processor (or the model's own generation
        config) may truncate; a config that truncates where nothing can be recorded, or whose
        reference log-probs could not be replayed, is refused."""
        truncation = ", ".join(truncating_settings(self.args))
        plain = not (self.use_vllm or getattr(self, "use_transformers_continuous_batching", False)
                     or getattr(self, "rollout_func", None) is not None or getattr(self, "tools", None))
        if truncation and not plain:
            raise ValueError(
                f"TargetPOTrainer replays a truncating sampler's kept sets ({truncation}) only when it can record "
                "them: in transformers' generate without tools, rollout_func or continuous batching (training on "
                "full-vocabulary log-probs would fit another distribution than the one the tokens were sampled "
                "from). Sample without truncation, or use plain transformers generation.")
        if truncation and self.beta != 0.0 and self.ref_model is None:
            raise ValueError(
                f"TargetPOTrainer cannot replay the kept sets of {truncation} in the reference log-probs with "
                f"beta={self.beta} under PEFT (TRL computes them over the full vocabulary with the adapter "
                "disabled): the KL term would compare distributions over different supports. Use beta=0.0, or "
                "sample without truncation.")
        if not plain:
            return None
        if self.ref_model is not None:  # the reference log-probs on the kept sets, by the TPO head
            from .head import add_tpo_head

            add_tpo_head(self.accelerator.unwrap_model(self.ref_model))
        return install_kept_set_recorder(policy)

    def _generate_and_score_completions(self, inputs):
        """TRL's generation with the recorder active; then the batch's kept sets (none when the
        sampler truncated nothing: the batch is TRL's as is) and, on them, the old and reference
        log-probs (TRL's are over the full vocabulary)."""
        slot = self._tpo_recorder_slot
        if slot is None:
            return super()._generate_and_score_completions(inputs)
        recorder = slot.recorder = KeptSetRecorder()
        try:
            batch = super()._generate_and_score_completions(inputs)
        finally:
            slot.recorder = None
        kept = kept_set_rows(recorder, self._token_mask(batch), always=self._truncated_anywhere(recorder))
        if kept is None:
            return batch
        batch[KEPT_IDS], batch[KEPT_COUNTS] = kept
        for key, model in (("old_per_token_logps", self.model), ("ref_per_token_logps", self.ref_model)):
            if batch.get(key) is None:
                continue
            if model is None:  # PEFT: refused at construction when the config truncates
                raise RuntimeError("the sampler truncated the vocabulary (a logits processor set scores to -inf) "
                                   "and the reference log-probs cannot be recomputed on its kept sets under PEFT; "
                                   "use beta=0.0")
            batch[key] = self._replayed_logprobs(model, batch).to(batch[key].dtype)
        return batch

    def _truncated_anywhere(self, recorder: KeptSetRecorder) -> bool:
        """Whether the sampler of any process truncated in this generation (one all-reduce of a
        flag with several processes): then every process's rows carry kept sets, the whole
        vocabulary where its own sampler truncated nothing, since the generation batch's rows move
        between processes key by key (``_gather_generation_batch``) and their loss calls gather."""
        truncated = recorder.truncated()
        if self.accelerator.num_processes == 1:
            return truncated
        flag = torch.tensor([float(truncated)], device=self.accelerator.device)
        return bool(kit.sum_over_ranks(flag, dist.group.WORLD, "kept_sets_recorded").item() > 0)

    def _replayed_logprobs(self, model, batch: Dict[str, Any]) -> torch.Tensor:
        """``model``'s token log-probs of the generation batch on its kept sets, in no-grad forwards of
        a micro-batch's rows at a time (as TRL computes its own)."""
        rows = batch["completion_ids"].shape[0]
        step = self._per_device("train" if self.model.training else "eval")
        parts = [self._token_logprobs_no_grad(model, take_rows(batch, torch.arange(start, min(start + step, rows))),
                                              entropy=False)[0]
                 for start in range(0, rows, step)]
        return torch.cat(parts)

    def _kept_sets(self, inputs: Dict[str, Any]) -> Optional[SamplingMask]:
        """The rows' recorded kept sets as the loss takes them (None: the full vocabulary)."""
        if inputs.get(KEPT_IDS) is None:
            return None
        return sampling_mask_of(inputs[KEPT_IDS], inputs[KEPT_COUNTS])
