"""Qwen-VL prompts: the checkpoint's chat template around one image and one question.

The template renders an image part as ``<|vision_start|><|image_pad|><|vision_end|>``; the
pad is expanded to one per image token (``PatchGrid.tokens``), as transformers'
``Qwen2VLProcessor`` does. The shared prefix ends at ``<|vision_end|>`` (``Prompt.prefix_len``).
Each prompt carries its M-RoPE positions and rope delta (``positions.py``); they depend only
on the image start, the grid and the prompt's length, so they are memoised on those.
Everything around the question is tokenized once (per system turn: a question's system turn
comes before the image, in the shared prefix); per request only the question is. A label
set's choices are tokenized as the assistant's answer would be (``models/chat.py``).
``chat_kwargs`` go to the chat template: Qwen3.5's family passes ``enable_thinking=False``
(the answer then starts right after the assistant turn's opening, with no reasoning first;
a template that does not read it ignores it).

Embedding inputs (``embed``) follow the embedding model's own layout, an ``EmbedTemplate``:
jina-embeddings-v4's by default (an image: ``<|im_start|>user\n<|vision_start|>`` pads
``<|vision_end|>{text}<|im_end|>\n``, no assistant turn; a text alone: its own tokens), and
ColQwen2's (``COLQWEN2``: its processor's ``visual_prompt_prefix`` ending
``<|im_end|><|endoftext|>``, queries ``Query: {text}`` + 10 pad tokens + ``\n``). A text
alone is one M-RoPE position per token on all three axes (transformers' text-only rule).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from vlmbatch.models.base import Prompt
from vlmbatch.models.chat import chat_layout
from vlmbatch.models.config_io import ModelError
from vlmbatch.models.qwen_vl.positions import Grid, image_prompt_positions
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.qwen_vl import PatchGrid


@dataclass(frozen=True)
class EmbedTemplate:
    """How embedding inputs are written around the image and the text (module docstring).
    ``{pad}`` in ``query_after`` is the tokenizer's pad token (ColQwen2's "query
    augmentation" token)."""
    image_head: str = "<|im_start|>user\n"  # before <|vision_start|>
    image_tail: str = "<|im_end|>\n"  # after the input's text
    query_before: str = ""  # a text alone: query_before + text + query_after
    query_after: str = ""


JINA = EmbedTemplate()
# transformers' ColQwen2Processor: visual_prompt_prefix, and process_queries' f"{query_prefix}
# {text}{pad * 10}\n"
COLQWEN2 = EmbedTemplate(image_tail="<|im_end|><|endoftext|>", query_before="Query: ",
                         query_after="{pad}" * 10 + "\n")


class QwenVLPrompts:
    def __init__(self, tokenizer: Any, image_token_id: int, vision_start_id: int,
                 vision_end_id: int, merge: int, embed_template: EmbedTemplate = JINA,
                 chat_kwargs: dict[str, Any] | None = None) -> None:
        self.tok = tokenizer
        self.image_token_id = image_token_id
        self.merge = merge
        pad = tokenizer.convert_ids_to_tokens(image_token_id)
        end = tokenizer.convert_ids_to_tokens(vision_end_id)
        try:
            self.layout = chat_layout(tokenizer, pad, chat_kwargs)
        except ValueError as e:
            raise ModelError(str(e)) from None
        if not self.layout.between.startswith(end):
            raise ModelError(f"the chat template must render one image as {pad}{end} before "
                             f"the question; got {self.layout.between!r} after {pad}")
        self._between = self.layout.between[len(end):]
        self._tail = self._encode(self.layout.tail)
        self._vision_start = vision_start_id
        self._head = self._head_ids(None)
        self._end = [vision_end_id]
        # a policy asks the same few questions (system turns, label sets) of every image:
        # tokenize each once (bounded)
        self._question = functools.lru_cache(maxsize=4096)(self._encode_question)
        self._heads = functools.lru_cache(maxsize=256)(self._head_ids)
        self.answer_ids = functools.lru_cache(maxsize=4096)(self._answer_ids)
        self._positions = functools.lru_cache(maxsize=4096)(self._positions_of)
        self._embed_head = (*self._encode(embed_template.image_head), vision_start_id)
        self._embed_tail = tuple(self._encode(embed_template.image_tail))
        self._query = (embed_template.query_before, embed_template.query_after.replace(
            "{pad}", tokenizer.pad_token or ""))
        self._query_tail = tuple(self._encode(self._query[1]))
        self._text_positions = functools.lru_cache(maxsize=1024)(_text_positions)
        self._embed_positions = functools.lru_cache(maxsize=4096)(self._embed_positions_of)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _encode_question(self, question: str) -> tuple[int, ...]:
        return tuple(self._encode(self._between + question))

    def _head_ids(self, system: str | None) -> tuple[int, ...]:
        """The ids through ``<|vision_start|>``, after ``system``'s turn when given."""
        head = self.layout.head_with(system)
        ids = tuple(self._encode(head))
        if not ids or ids[-1] != self._vision_start:
            raise ModelError(f"the chat template's image part must start with the token "
                             f"{self._vision_start} (<|vision_start|>); got {head!r}")
        return ids

    def _answer_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self._encode(self.layout.answer_lead + text))

    def _positions_of(self, start: int, grid_thw: Grid, length: int
                      ) -> tuple[torch.Tensor, int]:
        return image_prompt_positions(start, grid_thw, self.merge, length)

    def build(self, question: str, image: PreparedImage, system: str | None = None) -> Prompt:
        grid = image.grid
        assert isinstance(grid, PatchGrid)  # the family's plan made it
        return self.build_for_grid(question, grid, system)

    def build_for_grid(self, question: str, grid: PatchGrid,
                       system: str | None = None) -> Prompt:
        n = grid.tokens
        head = self._head if system is None else self._heads(system)
        ids = (*head, *[self.image_token_id] * n, *self._end, *self._question(question),
               *self._tail)
        positions, delta = self._positions(len(head), grid.thw, len(ids))  # [3, L], read-only
        return Prompt(ids, len(head), n, positions, delta)

    def _embed_positions_of(self, grid_thw: Grid, length: int) -> tuple[torch.Tensor, int]:
        return image_prompt_positions(len(self._embed_head), grid_thw, self.merge, length)

    def embed(self, text: str, image: PreparedImage | None) -> Prompt:
        """An embedding input in the template's layout (module docstring); the image's
        markers at ``image_start - 1`` and ``image_start + image_len`` as ``Prompt`` says."""
        if image is None:
            if not text:
                raise ValueError("an embedding input needs an image or a non-empty text")
            ids = (*self._encode(self._query[0] + text), *self._query_tail)
            return Prompt(ids, 0, 0, self._text_positions(len(ids)), 0)
        grid = image.grid
        assert isinstance(grid, PatchGrid)  # the family's plan made it
        n = grid.tokens
        ids = (*self._embed_head, *[self.image_token_id] * n, *self._end, *self._encode(text),
               *self._embed_tail)
        positions, delta = self._embed_positions(grid.thw, len(ids))  # [3, L], read-only
        return Prompt(ids, len(self._embed_head), n, positions, delta)


def _text_positions(length: int) -> torch.Tensor:
    """A text-only prompt's M-RoPE positions ``[3, L]``: the index on every axis."""
    return torch.arange(length).expand(3, length)
