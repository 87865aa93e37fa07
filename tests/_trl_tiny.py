"""The offline TRL test setup shared by the single- and multi-process TRL tests: a tiny OLMo-2
built from a config, a word-level tokenizer built with the tokenizers library, prompts and a
reward that varies within a group.

(OLMo-2 rather than Qwen2 so that ``AutoProcessor`` loads the saved tokenizer as is: for a Qwen2
config it builds a Qwen2 BPE tokenizer instead.)
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import Olmo2Config, Olmo2ForCausalLM, PreTrainedTokenizerFast  # noqa: E402

VOCAB = 40  # <pad>, <eos>, <unk> and 37 words


def word_tokenizer() -> PreTrainedTokenizerFast:
    """<pad> = 0, <eos> = 1, <unk> = 2 and the words w0 ... w36, split on whitespace."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )


def build_tiny_olmo2(path: str) -> PreTrainedTokenizerFast:
    """Save a 2-layer OLMo-2 of hidden size 32 and its word-level tokenizer under ``path``;
    returns the tokenizer."""
    tokenizer = word_tokenizer()
    config = Olmo2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Olmo2ForCausalLM(config)
    # Point the <eos> row of the head along the mean final hidden state: about half the completions
    # then end within 8 tokens (with mask_truncated_completions, the others lose every token).
    with torch.no_grad():
        hidden = model.model(torch.randint(2, VOCAB, (64, 12))).last_hidden_state.reshape(-1, config.hidden_size)
        mean = hidden.mean(dim=0)
        model.lm_head.weight[config.eos_token_id] = mean / mean.norm() ** 2
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
