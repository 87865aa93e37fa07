"""The offline TRL test setup shared by the single- and multi-process TRL tests: the package's tiny
OLMo-2 and word-level tokenizer (``tpo_kernels.integrations.trl.tiny_model_and_tokenizer``, the
model the TRL guide's offline recipe trains) saved to a folder, prompts and a reward that varies
within a group; the kept sets of a top-k-then-top-p sampler, computed independently of the trainer.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from tpo_kernels.integrations.trl.tiny import TINY_VOCAB_SIZE as VOCAB  # noqa: E402
from tpo_kernels.integrations.trl.tiny import tiny_model_and_tokenizer, word_tokenizer  # noqa: E402, F401


def build_tiny_olmo2(path: str):
    """Save the tiny OLMo-2 (seed 0) and its word-level tokenizer under ``path``; returns the tokenizer."""
    model, tokenizer = tiny_model_and_tokenizer()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


def dataset(num_prompts: int = 16) -> Dataset:
    """Prompts of three words each (the same token length: no prompt padding)."""
    return Dataset.from_dict(
        {"prompt": [" ".join(f"w{(3 * i + j) % (VOCAB - 3)}" for j in range(3)) for i in range(num_prompts)]}
    )


def even_words(completions, **kwargs):
    """Fraction of even-numbered words plus a length term: varies within a group."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(1, len(words)) + 0.01 * len(words))
    return out


def sampler_kept_sets(logits: torch.Tensor, top_k: int, top_p: float, temperature: float) -> torch.Tensor:
    """[..., V] bool: the ids a top-k-then-top-p sampler keeps (transformers' order and rule: the k
    largest tempered logits; of those, the smallest set of the most probable whose renormalized
    mass reaches top_p, i.e. an id is dropped when the mass of the ids less probable than it,
    itself included, is at most 1 - top_p)."""
    z = logits.double() / temperature
    kth = z.topk(top_k, dim=-1).values[..., -1:]
    z = z.masked_fill(z < kth, float("-inf"))
    probs, order = z.softmax(dim=-1).sort(dim=-1)  # ascending
    dropped = probs.cumsum(dim=-1) <= 1 - top_p
    dropped[..., -1] = False  # at least one id
    keep = torch.zeros_like(dropped).scatter(-1, order, ~dropped)
    return keep & (z > float("-inf"))
