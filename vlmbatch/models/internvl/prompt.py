"""InternVL prompts: one user turn around one image and one question, as token ids.

A ``ChatFormat`` says how a checkpoint writes that turn: HF-native checkpoints render it
with their chat template (``chat_template_format``: an image part becomes
``<IMG_CONTEXT>``), original ``InternVLChatModel`` ones with their ``conversation.py``
template (``template_format``: the user message ``<image>\\n{question}``, ``templates.py``).
Either way the one image placeholder is expanded to ``<img>`` + N x ``<IMG_CONTEXT>`` +
``</img>`` with N = tokens per tile x tiles, exactly as transformers' ``InternVLProcessor``
and ``InternVLChatModel.chat`` do, and the tokenizer's own leading special tokens (InternLM2's
``<s>``; none for Qwen's) go first. Everything before the image is tokenized once; per
request only the question and what follows it are (cached per question). Each piece ends
at an added token (``<img>``, ``</img>``), where the tokenizers split anyway, so the ids
are those of the whole text tokenized at once.

Embedding inputs (``embed``): an image and its text as one user turn, without the assistant
turn (HF-native: ``<|im_start|>user\\n<img> N x <IMG_CONTEXT> </img>\\n{text}<|im_end|>\\n``,
jina's layout in InternVL's template); its ids through ``</img>`` are ``build``'s, so cached
KV serves both. A text alone is its own tokens, as given (jina's text rule; the caller adds
any prefix).

The ``Prompt`` record and its invariant are in ``models/base.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlmbatch.models.base import Prompt
from vlmbatch.models.internvl.templates import Template
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.tiling import TileGrid

_MARK = "\x00QUESTION\x00"


@dataclass(frozen=True)
class ChatFormat:
    """How a checkpoint writes a user turn holding an image and a text."""
    render: Callable[[str, bool], str]  # (text, open answer turn?) -> text, placeholder once
    placeholder: str  # what the image's tokens replace in the rendered text
    start: str  # image start, context and end tokens
    context: str
    end: str


def chat_template_format(tok: Any) -> ChatFormat:
    """An HF-native checkpoint's: its tokenizer's chat template, an image part first."""
    def render(text: str, open_answer: bool) -> str:
        return tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
            tokenize=False, add_generation_prompt=open_answer)
    return ChatFormat(render, tok.context_image_token, tok.start_image_token,
                      tok.context_image_token, tok.end_image_token)


def template_format(template: Template, system: str | None) -> ChatFormat:
    """An original checkpoint's: its ``conversation.py`` template, the user message
    ``<image>\\n{text}`` (``InternVLChatModel.chat``)."""
    def render(text: str, open_answer: bool) -> str:
        return template.question("<image>\n" + text, system, open_answer)
    return ChatFormat(render, "<image>", "<img>", "<IMG_CONTEXT>", "</img>")


def special_prefix(tok: Any) -> list[int]:
    """The ids the tokenizer puts before any text (``<s>`` for InternLM2's); ValueError if
    it also adds some after (none of InternVL's does)."""
    prefix = tok.encode("", add_special_tokens=True)
    plain = tok.encode("a", add_special_tokens=False)
    if tok.encode("a", add_special_tokens=True) != prefix + plain:
        raise ValueError("the tokenizer adds special tokens after the text; InternVL's "
                         "prompts expect them before it only")
    return prefix


class InternVLPrompts:
    def __init__(self, tokenizer: Any, tokens_per_tile: int, image_token_id: int,
                 chat: ChatFormat | None = None) -> None:
        self.tok = tokenizer
        self.tokens_per_tile = tokens_per_tile
        self.image_token_id = image_token_id
        chat = chat or chat_template_format(tokenizer)
        text = chat.render(_MARK, True)
        if text.count(chat.placeholder) != 1 or text.count(_MARK) != 1:
            raise ValueError("the chat format must render exactly one image placeholder "
                             f"{chat.placeholder!r} before the question; got {text!r}")
        head, rest = text.split(chat.placeholder)
        self._between, self._tail = rest.split(_MARK)
        ids = tokenizer.convert_tokens_to_ids
        self._head = special_prefix(tokenizer) + self._encode(head) + [ids(chat.start)]
        self._end = [ids(chat.end)]
        self._embed_tail = chat.render(_MARK, False).split(_MARK)[1]  # no assistant turn
        # a policy asks the same few questions of every image: tokenize each once (bounded,
        # for manifests whose questions are all different)
        self._question = functools.lru_cache(maxsize=4096)(self._encode_question)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _encode_question(self, question: str) -> tuple[int, ...]:
        return tuple(self._encode(self._between + question + self._tail))

    def build(self, question: str, image: PreparedImage) -> Prompt:
        assert isinstance(image.grid, TileGrid)  # InternVL's plan made it
        return self.build_for_tiles(question, image.grid.num_tiles)

    def build_for_tiles(self, question: str, num_tiles: int) -> Prompt:
        n = self.tokens_per_tile * num_tiles
        ids = (*self._head, *[self.image_token_id] * n, *self._end, *self._question(question))
        return Prompt(ids, len(self._head), n)

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
               *self._encode(self._between + text + self._embed_tail))
        return Prompt(ids, len(self._head), n)
