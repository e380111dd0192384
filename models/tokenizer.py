"""Byte-level BPE tokenizers of our own, for the built-in models and random test checkpoints.

Byte-level, so any text (any language) tokenizes; the vocabulary is learnt from a small
corpus (training questions), so common words such as "yes"/"no" are single tokens. Each
family gives its special tokens and chat template (``models/internvl/tokenizer.py``,
``models/qwen_vl/tokenizer.py``) so that the same prompt code serves a real checkpoint.
Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast


def bpe_tokenizer(corpus: Iterable[str], vocab_size: int, special: list[str],
                  chat_template: str, extra_special: dict[str, str] | None = None,
                  eos: str = "<|im_end|>", pad: str = "<|endoftext|>"
                  ) -> PreTrainedTokenizerFast:
    """A BPE of ``vocab_size`` trained on ``corpus``; ``special`` get the first ids, in
    order; ``extra_special`` names some of them as tokenizer attributes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=pad,
        extra_special_tokens=extra_special or {}, chat_template=chat_template,
        model_max_length=4096)
