"""What each process of the multi-process TRL test runs (tests/test_trl_split_ranks.py), and the
same in one process: a TargetPOTrainer on the tiny OLMo-2 of tests/_trl_tiny.py, with plain SGD at
a constant learning rate, recording every micro-batch it computed a loss on (its inputs and the
unscaled loss) and the parameters before each optimizer step and after training, for a replay."""

from __future__ import annotations

import os
from typing import Any, Dict

import torch

from _trl_tiny import dataset, even_words

# What the replay needs of a micro-batch (the rest of TRL's dict is not used by the loss); the kept
# sets when the sampler truncated (tpo_kernels.integrations.trl.kept_sets).
RECORDED = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tpo_scores", "tpo_group_ids",
            "old_per_token_logps", "tpo_kept_ids", "tpo_kept_counts")


def trainer_config(output_dir: str, **overrides):
    from tpo_kernels.integrations.trl import TargetPOConfig

    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=2, num_generations=4, max_completion_length=6,
                  max_steps=2, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0,
                  temperature=0.9, bf16=False, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no",
                  disable_tqdm=True, seed=0, tpo_backend="cpu")
    kwargs.update(overrides)
    return TargetPOConfig(**kwargs)


def train_layouts(rank: int, world: int, model_dir: str, output_dir: str,
                  layouts: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Train once per layout (config overrides; ``rank_overrides``: ``{rank: overrides}`` of some
    processes only) in this process of a gloo group; what each run recorded."""
    os.environ["LOCAL_RANK"] = str(rank)  # accelerate reads its place in the (already initialized) gloo group
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = {}
    for name, overrides in layouts.items():
        overrides = dict(overrides)
        overrides.update(overrides.pop("rank_overrides", {}).get(rank, {}))
        runs[name] = train_recorded(model_dir, os.path.join(output_dir, name), overrides)
    return runs


def train_recorded(model_dir: str, output_dir: str, overrides: Dict[str, Any]) -> Dict[str, Any]:
    """One training run (config overrides, plus ``eval_prompts``: the size of an eval dataset);
    its micro-batches, the parameters before each optimizer step and after training, and the logs."""
    from transformers import PreTrainedTokenizerFast

    from tpo_kernels.integrations.trl import TargetPOTrainer

    class Recorder(TargetPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.micro_batches, self.params_before = [], []

        def training_step(self, model, inputs, num_items_in_batch):
            if self._step % self.args.gradient_accumulation_steps == 0:
                self.params_before.append(_params(self.model))
            return super().training_step(model, inputs, num_items_in_batch)

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            training = self.model.training
            record = {key: inputs[key].detach().cpu().clone() for key in RECORDED if inputs.get(key) is not None}
            record.update(mode="train" if training else "eval",
                          loss=loss.item() * (self.current_gradient_accumulation_steps if training else 1))
            self.micro_batches.append(record)
            return loss

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    overrides = dict(overrides)
    eval_prompts = overrides.pop("eval_prompts", 0)
    trainer = Recorder(model=model_dir, reward_funcs=even_words, args=trainer_config(output_dir, **overrides),
                       train_dataset=dataset(), eval_dataset=dataset(eval_prompts) if eval_prompts else None,
                       processing_class=tokenizer)
    trainer.train()
    return dict(micro_batches=trainer.micro_batches, params_before=trainer.params_before,
                params_after=_params(trainer.model),
                logs=[entry for entry in trainer.state.log_history if "tpo/loss" in entry])


def _params(model) -> Dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
