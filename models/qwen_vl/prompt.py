"""Qwen-VL prompts: the checkpoint's chat template around one image and one question.

The template renders an image part as ``<|vision_start|><|image_pad|><|vision_end|>``; the
pad is expanded to one per image token (``PatchGrid.tokens``), as transformers'
``Qwen2VLProcessor`` does. The shared prefix ends at ``<|vision_end|>`` (``Prompt.prefix_len``).
Each prompt carries its M-RoPE positions and rope delta (``positions.py``); they depend only
on the image start, the grid and the prompt's length, so they are memoised on those.
Everything around the question is tokenized once; per request only the question is.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from models.base import Prompt
from models.io import ModelError
from models.qwen_vl.positions import Grid, image_prompt_positions
from preprocessing.prepare import PreparedImage
from preprocessing.qwen_vl import PatchGrid

_MARK = "\x00QUESTION\x00"


class QwenVLPrompts:
    def __init__(self, tokenizer: Any, image_token_id: int, vision_start_id: int,
                 vision_end_id: int, merge: int) -> None:
        self.tok = tokenizer
        self.image_token_id = image_token_id
        self.merge = merge
        pad = tokenizer.convert_ids_to_tokens(image_token_id)
        end = tokenizer.convert_ids_to_tokens(vision_end_id)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _MARK}]}],
            tokenize=False, add_generation_prompt=True)
        if text.count(pad) != 1 or text.count(_MARK) != 1 or pad + end not in text:
            raise ModelError(f"the chat template must render one image as {pad}{end} before "
                             f"the question; got {text!r}")
        head, rest = text.split(pad)
        self._between, tail = rest[len(end):].split(_MARK)
        self._head = self._encode(head)
        if not self._head or self._head[-1] != vision_start_id:
            raise ModelError(f"the chat template's image part must start with the token "
                             f"{vision_start_id} (<|vision_start|>); got {head!r}")
        self._end = [vision_end_id]
        self._tail = self._encode(tail)
        # a policy asks the same few questions of every image: tokenize each once (bounded)
        self._question = functools.lru_cache(maxsize=4096)(self._encode_question)
        self._positions = functools.lru_cache(maxsize=4096)(self._positions_of)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _encode_question(self, question: str) -> tuple[int, ...]:
        return tuple(self._encode(self._between + question))

    def _positions_of(self, grid_thw: Grid, length: int) -> tuple[torch.Tensor, int]:
        return image_prompt_positions(len(self._head), grid_thw, self.merge, length)

    def build(self, question: str, image: PreparedImage) -> Prompt:
        grid = image.grid
        assert isinstance(grid, PatchGrid)  # the family's plan made it
        return self.build_for_grid(question, grid)

    def build_for_grid(self, question: str, grid: PatchGrid) -> Prompt:
        n = grid.tokens
        ids = (*self._head, *[self.image_token_id] * n, *self._end, *self._question(question),
               *self._tail)
        positions, delta = self._positions(grid.thw, len(ids))  # [3, L]: shared, read-only
        return Prompt(ids, len(self._head), n, positions, delta)

    def embed(self, text: str, image: PreparedImage | None) -> Prompt:
        """Embedding inputs of this family are not done (jina-embeddings-v4's and ColQwen2's
        pooling, ``docs/embeddings.md``): a clear error rather than a wrong vector."""
        raise NotImplementedError("embeddings of Qwen-VL checkpoints are not supported yet "
                                  "(docs/embeddings.md, 'Not done')")
