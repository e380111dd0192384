"""A Qwen-VL tokenizer of our own: byte-level BPE (``models/tokenizer.py``) with Qwen's special
tokens (``<|im_start|>``, ``<|vision_start|>``, ``<|image_pad|>``, ...) and a chat template
that renders an image part as Qwen2/2.5/3-VL's do: ``<|vision_start|><|image_pad|>
<|vision_end|>``, the prompt builder expanding the pad to one per image token. Used by the
random checkpoints (``random.py``) and the built-in Qwen-VL model; nothing is downloaded.

Unlike Qwen2/2.5-VL's released template it adds no default system prompt (as Qwen3-VL's):
the built-in model's prompts stay short.
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerFast

from vlmbatch.models.tokenizer import bpe_tokenizer, chat_template

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
           "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]

CHAT_TEMPLATE = chat_template("<|vision_start|><|image_pad|><|vision_end|>")


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 640) -> PreTrainedTokenizerFast:
    return bpe_tokenizer(corpus, vocab_size, SPECIAL, CHAT_TEMPLATE)
