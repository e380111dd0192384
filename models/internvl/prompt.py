"""InternVL prompts: chat template around one image and one question, as token ids.

The model's own chat template renders a user turn holding an image part and a text part; the
image part's placeholder (``<IMG_CONTEXT>``) is expanded to ``<img>`` + N x ``<IMG_CONTEXT>`` +
``</img>`` with N = tokens per tile x tiles, exactly as transformers' ``InternVLProcessor``
does. Everything around the question is tokenized once; per request only the question is.

The ``Prompt`` record and its invariant are in ``models/base.py``.
"""

from __future__ import annotations

import functools
from typing import Any

from models.base import Prompt
from preprocessing.prepare import PreparedImage
from preprocessing.tiling import TileGrid

_MARK = "\x00QUESTION\x00"


class InternVLPrompts:
    def __init__(self, tokenizer: Any, tokens_per_tile: int, image_token_id: int) -> None:
        self.tok = tokenizer
        self.tokens_per_tile = tokens_per_tile
        self.image_token_id = image_token_id
        ctx = tokenizer.context_image_token
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _MARK}]}],
            tokenize=False, add_generation_prompt=True)
        if text.count(ctx) != 1 or text.count(_MARK) != 1:
            raise ValueError("the chat template must render exactly one image placeholder "
                             f"{ctx!r} before the question; got {text!r}")
        head, rest = text.split(ctx)
        self._between, tail = rest.split(_MARK)
        enc = self._encode
        self._head = enc(head) + [tokenizer.convert_tokens_to_ids(tokenizer.start_image_token)]
        self._end = [tokenizer.convert_tokens_to_ids(tokenizer.end_image_token)]
        self._tail = enc(tail)
        # a policy asks the same few questions of every image: tokenize each once (bounded,
        # for manifests whose questions are all different)
        self._question = functools.lru_cache(maxsize=4096)(self._encode_question)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _encode_question(self, question: str) -> tuple[int, ...]:
        return tuple(self._encode(self._between + question))

    def build(self, question: str, image: PreparedImage) -> Prompt:
        assert isinstance(image.grid, TileGrid)  # InternVL's plan made it
        return self.build_for_tiles(question, image.grid.num_tiles)

    def build_for_tiles(self, question: str, num_tiles: int) -> Prompt:
        n = self.tokens_per_tile * num_tiles
        ids = (*self._head, *[self.image_token_id] * n, *self._end, *self._question(question),
               *self._tail)
        return Prompt(ids, len(self._head), n)
