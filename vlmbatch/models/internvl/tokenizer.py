"""The built-in model's tokenizer: byte-level BPE (``models/tokenizer.py``) with InternVL's
special tokens and chat template, as the HF-native InternVL checkpoints have them (``<img>``,
``<IMG_CONTEXT>``, ``</img>``, ``<|im_start|>``/``<|im_end|>``), so the same prompt code serves a
real checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerFast

from vlmbatch.models.tokenizer import bpe_tokenizer, chat_template

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>",
           "<video>"]

# The InternVL-hf template, less its long default system prompt: an image part becomes
# "<IMG_CONTEXT>\n", which the prompt builder expands to <img> + N x <IMG_CONTEXT> + </img>.
CHAT_TEMPLATE = chat_template("<IMG_CONTEXT>\\n")


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 640) -> PreTrainedTokenizerFast:
    return bpe_tokenizer(corpus, vocab_size, SPECIAL, CHAT_TEMPLATE, {
        "start_image_token": "<img>", "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"})
