"""Byte-level BPE tokenizers of our own, for the built-in models and random test checkpoints.

Byte-level, so any text (any language) tokenizes; the vocabulary is learnt from a small
corpus (training questions), so common words such as "yes"/"no" are single tokens. Each
family gives its special tokens and chat template (``models/internvl/tokenizer.py``,
``models/qwen_vl/tokenizer.py``) so that the same prompt code serves a real checkpoint.
Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from vlmbatch.models.io import ModelError


def chat_template(image_part: str) -> str:
    """A chat template rendering each message as ``<|im_start|>ROLE\\n`` + its parts (an
    image part as ``image_part``, a text part as its text) + ``<|im_end|>\\n``, then
    ``<|im_start|>assistant\\n`` for a generation prompt. No default system prompt."""
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{{ '" + image_part + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


def load_tokenizer(path: Path) -> Any:
    """A checkpoint's tokenizer (transformers' ``AutoTokenizer``); ModelError if it cannot
    be read. A family then checks it with ``check_tokenizer``."""
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001  (transformers raises many kinds)
        raise ModelError(f"cannot load the tokenizer from {path}: {e}") from e


def check_tokenizer(tok: Any, path: Path, has: dict[str, bool], family: str) -> Any:
    """``tok``, or ModelError naming the image tokens of ``has`` (name -> present) it lacks,
    or saying its chat template is missing, with what to copy."""
    missing = [name for name, ok in has.items() if not ok]
    if missing:
        raise ModelError(f"the tokenizer in {path} lacks {family}'s image tokens "
                         f"({', '.join(missing)}); copy the checkpoint's tokenizer files "
                         "(tokenizer.json, tokenizer_config.json) into the folder")
    if getattr(tok, "chat_template", None) is None:
        raise ModelError(f"the tokenizer in {path} has no chat template; copy the "
                         "checkpoint's chat_template.jinja (or tokenizer_config.json) into "
                         "the folder")
    return tok


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
