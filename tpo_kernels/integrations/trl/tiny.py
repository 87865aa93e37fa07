"""A tiny causal LM and its tokenizer, built here from a config: a first run of
:class:`~.trainer.TargetPOTrainer` that needs no download and no GPU (the guide's offline recipe),
and the model the TRL tests train.

The model is a 2-layer OLMo-2 of hidden size 32 over a 40-token vocabulary; the tokenizer a
word-level one built with the ``tokenizers`` library (``<pad>`` = 0, ``<eos>`` = 1, ``<unk>`` = 2,
then the words ``w0`` ... ``w36``, split on whitespace). OLMo-2 rather than Qwen2 so that
``AutoProcessor`` loads the saved tokenizer as it is (for a Qwen2 config it builds a Qwen2 BPE
tokenizer instead).
"""

from __future__ import annotations

from typing import Tuple

import torch

TINY_VOCAB_SIZE = 40  # <pad>, <eos>, <unk> and 37 words
_SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")


def word_tokenizer():
    """The word-level tokenizer of :func:`tiny_model_and_tokenizer` (a ``PreTrainedTokenizerFast``,
    padding on the left, as TRL pads prompts)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(_SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i + len(_SPECIAL_TOKENS) for i in range(TINY_VOCAB_SIZE - len(_SPECIAL_TOKENS))})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                   padding_side="left")


def tiny_model_and_tokenizer(seed: int = 0) -> Tuple["torch.nn.Module", object]:
    """``(model, tokenizer)``: a 2-layer OLMo-2 (hidden size 32, 40 tokens; 21k parameters)
    and its word-level tokenizer, built in memory from ``seed`` (the same weights for the same
    seed; the caller's random state is left as it was). Pass both to ``TargetPOTrainer(model=model,
    processing_class=tokenizer, ...)``, or save them (``save_pretrained(path)``) and pass the path.

    The ``<eos>`` row of the head points along the mean final hidden state, so that about half of
    the sampled completions end within 8 tokens and the rest run on: completions of different
    lengths, some truncated, from the first step."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    from transformers import Olmo2Config, Olmo2ForCausalLM

    config = Olmo2Config(vocab_size=TINY_VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Olmo2ForCausalLM(config)
        with torch.no_grad():
            tokens = torch.randint(2, TINY_VOCAB_SIZE, (64, 12))  # <unk> and the words
            hidden = model.model(tokens).last_hidden_state.reshape(-1, config.hidden_size)
            mean = hidden.mean(dim=0)
            model.lm_head.weight[config.eos_token_id] = mean / mean.norm() ** 2
    return model, word_tokenizer()
