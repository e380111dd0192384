"""InternVL prompts: chat template around one image and one question, as token ids.

The model's own chat template renders a user turn holding an image part and a text part
(after a system turn, when the question has one); the image part's placeholder
(``<IMG_CONTEXT>``) is expanded to ``<img>`` + N x ``<IMG_CONTEXT>`` + ``</img>`` with N =
tokens per tile x tiles, exactly as transformers' ``InternVLProcessor`` does. Everything around
the question is tokenized once (per system turn); per request only the question is. A label
set's choices are tokenized as the assistant's answer would be (``models/chat.py``).

Embedding inputs (``embed``): an image and its text as one user turn, without the assistant
turn, ``<|im_start|>user\n<img> N x <IMG_CONTEXT> </img>\n{text}<|im_end|>\n`` (jina's layout
in InternVL's template); its ids through ``</img>`` are ``build``'s, so cached KV serves both.
A text alone is its own tokens, as given (jina's text rule; the caller adds any prefix).

The ``Prompt`` record and its invariant are in ``models/base.py``.
"""

from __future__ import annotations

import functools
from typing import Any

from vlmbatch.models.base import Prompt
from vlmbatch.models.chat import QUESTION, chat_layout
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.tiling import TileGrid


class InternVLPrompts:
    def __init__(self, tokenizer: Any, tokens_per_tile: int, image_token_id: int) -> None:
        self.tok = tokenizer
        self.tokens_per_tile = tokens_per_tile
        self.image_token_id = image_token_id
        self.layout = chat_layout(tokenizer, tokenizer.context_image_token)
        self._between = self.layout.between
        enc = self._encode
        self._start = tokenizer.convert_tokens_to_ids(tokenizer.start_image_token)
        self._head = self._head_ids(None)
        self._end = [tokenizer.convert_tokens_to_ids(tokenizer.end_image_token)]
        self._tail = enc(self.layout.tail)
        no_gen = tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"},
                                          {"type": "text", "text": QUESTION}]}],
            tokenize=False, add_generation_prompt=False)
        self._embed_tail = enc(no_gen.split(QUESTION)[1])  # the user turn's end, no assistant
        # a policy asks the same few questions (and system turns, and label sets) of every
        # image: tokenize each once (bounded, for manifests whose questions all differ)
        self._question = functools.lru_cache(maxsize=4096)(self._encode_question)
        self._heads = functools.lru_cache(maxsize=256)(self._head_ids)
        self.answer_ids = functools.lru_cache(maxsize=4096)(self._answer_ids)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _encode_question(self, question: str) -> tuple[int, ...]:
        return tuple(self._encode(self._between + question))

    def _head_ids(self, system: str | None) -> tuple[int, ...]:
        """The ids through ``<img>``, after ``system``'s turn when given."""
        return (*self._encode(self.layout.head_with(system)), self._start)

    def _answer_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self._encode(self.layout.answer_lead + text))

    def build(self, question: str, image: PreparedImage, system: str | None = None) -> Prompt:
        assert isinstance(image.grid, TileGrid)  # InternVL's plan made it
        return self.build_for_tiles(question, image.grid.num_tiles, system)

    def build_for_tiles(self, question: str, num_tiles: int,
                        system: str | None = None) -> Prompt:
        n = self.tokens_per_tile * num_tiles
        head = self._head if system is None else self._heads(system)
        ids = (*head, *[self.image_token_id] * n, *self._end, *self._question(question),
               *self._tail)
        return Prompt(ids, len(head), n)

    def embed(self, text: str, image: PreparedImage | None) -> Prompt:
        """An embedding input (see the module docstring); ``image_len`` 0 without an image."""
        if image is None:
            alone = tuple(self._encode(text))
            if not alone:
                raise ValueError("an embedding input needs an image or a non-empty text")
            return Prompt(alone, 0, 0)
        assert isinstance(image.grid, TileGrid)  # InternVL's plan made it
        n = self.tokens_per_tile * image.grid.num_tiles
        ids = (*self._head, *[self.image_token_id] * n, *self._end,
               *self._encode(self._between + text), *self._embed_tail)
        return Prompt(ids, len(self._head), n)
