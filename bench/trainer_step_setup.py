"""The model, the batch and the trainers of the trainer step benchmark (``trainer_step``).

A Qwen2-shaped causal LM built from a config (random weights, no download), one fixed batch of
whole groups, and one ``GRPOTrainer`` subclass per variant whose generation is stubbed out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .experiment import offline_hub

offline_hub()

VARIANTS = {
    "trl": "(a) TRL GRPOTrainer, stock loss",
    "eager": "(b) logits + TPO in eager PyTorch",
    "tpo_loss": "(c) logits + tpo_kernels.tpo_loss",
    "fused": "(d) TargetPOTrainer (fused-linear TPO)",
}


@dataclass
class StepSpec:
    """The model, the batch and the measurement of one run (every variant shares it)."""

    vocab: int = 151936
    hidden: int = 256
    layers: int = 2
    intermediate: int = 1024
    heads: int = 4
    kv_heads: int = 2
    groups: int = 4  # G prompts ...
    group_size: int = 8  # ... x K completions
    prompt_len: int = 16
    completion_len: int = 64
    warmup: int = 1
    reps: int = 3
    seed: int = 0
    device: str = "cpu"
    backend: str = "auto"  # tpo_kernels backend of (c) and (d)
    threads: int = 0  # torch threads in each worker (0: torch's default)

    @property
    def loss_tokens(self) -> int:
        return self.groups * self.group_size * self.completion_len


# --------------------------------------------------------------------------- the model and the batch


def build_model(spec: StepSpec):
    """A randomly initialized Qwen2 causal LM with tied embeddings (as the small Qwen models)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.prompt_len + spec.completion_len, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=1, pad_token_id=0,
    )
    torch.manual_seed(spec.seed)
    return Qwen2ForCausalLM(config)


def build_tokenizer():
    """A three-token word-level tokenizer: the trainers need one (pad/eos ids), nothing is decoded."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                   padding_side="left")


def build_batch(spec: StepSpec, device: torch.device) -> dict:
    """The dict ``_generate_and_score_completions`` would return: whole groups, full masks."""
    from tpo_kernels.bench.baselines import standardize_rows

    g = torch.Generator().manual_seed(spec.seed + 1)
    rows = spec.groups * spec.group_size
    prompts = torch.randint(3, spec.vocab, (spec.groups, 1, spec.prompt_len), generator=g)
    rewards = torch.rand(spec.groups, spec.group_size, generator=g, dtype=torch.float64)
    completion_mask = torch.ones(rows, spec.completion_len, dtype=torch.long)
    batch = {
        "prompt_ids": prompts.expand(-1, spec.group_size, -1).reshape(rows, spec.prompt_len),
        "prompt_mask": torch.ones(rows, spec.prompt_len, dtype=torch.long),
        "completion_ids": torch.randint(3, spec.vocab, (rows, spec.completion_len), generator=g),
        "completion_mask": completion_mask,
        "advantages": standardize_rows(rewards).reshape(rows).float(),
        "num_items_in_batch": completion_mask.sum().float(),
        # TargetPOTrainer's additions to a generated batch (stock TRL ignores them): each completion's
        # raw reward, which the TPO loss standardizes itself, and its group
        "tpo_scores": rewards.reshape(rows),
        "tpo_group_ids": torch.arange(rows) // spec.group_size,
    }
    return {k: v.to(device) for k, v in batch.items()}


# --------------------------------------------------------------------------- the trainers


def build_trainer(variant: str, model, spec: StepSpec, out_dir: str):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tpo_kernels.integrations.trl import TargetPOConfig, TargetPOTrainer

    class FixedBatch:
        """Generation stubbed out: the batch handed to ``training_step`` is used as generated."""

        def _prepare_inputs(self, batch):
            return batch

    class LogitsTPO(FixedBatch, GRPOTrainer):
        """TPO on the model's logits of the completion positions, eager or through tpo_loss."""

        def _compute_loss(self, model, inputs):
            completion_ids = inputs["completion_ids"]
            length = completion_ids.shape[1]
            input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            # Position t predicts token t + 1: project exactly the positions that predict completion
            # tokens, so the logits are one contiguous [N, C, V] tensor (slicing C + 1 positions
            # afterwards would add a copy in tpo_loss and a full-size zero-fill in the slice's backward).
            positions = torch.arange(input_ids.shape[1] - length - 1, input_ids.shape[1] - 1, device=input_ids.device)
            with self.accelerator.autocast():
                logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=positions).logits
            return logits_loss(variant, logits, completion_ids, inputs["advantages"], self.num_generations,
                               self.args.tpo_backend)

    common = dict(output_dir=out_dir, per_device_train_batch_size=spec.groups * spec.group_size,
                  num_generations=spec.group_size, max_completion_length=spec.completion_len,
                  use_cpu=spec.device == "cpu", bf16=False, report_to="none", save_strategy="no",
                  disable_tqdm=True, seed=spec.seed)
    if variant == "trl":
        cls, args = type("StockGRPOStep", (FixedBatch, GRPOTrainer), {}), GRPOConfig(**common)
    else:  # TargetPOConfig: GRPOConfig plus tpo_backend (and eta, anchor at their defaults)
        args = TargetPOConfig(**common, tpo_backend=spec.backend)
        cls = type("FusedTPOStep", (FixedBatch, TargetPOTrainer), {}) if variant == "fused" else LogitsTPO
    dataset = Dataset.from_dict({"prompt": ["<unk>"] * spec.groups})
    return cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
               train_dataset=dataset, processing_class=build_tokenizer())


def logits_loss(variant, logits, labels, scores, group_size, backend):
    """(b) or (c): TPO of [N, C, V] logits, on-policy, eta = temperature = 1, mean over groups."""
    if variant == "eager":
        from tpo_kernels.bench.baselines import naive_tpo_logits

        return naive_tpo_logits(logits, labels, scores, group_size)
    import tpo_kernels

    return tpo_kernels.tpo_loss(logits, labels, scores, group_size=group_size, backend=backend)
