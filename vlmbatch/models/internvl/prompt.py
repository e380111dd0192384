"""InternVL prompts: one user turn around one image and one question, as token ids.

A ``ChatFormat`` says how a checkpoint writes that turn, as the text pieces of a
``models.chat.ChatLayout`` (head, between, tail, the answer's lead, the system turn's
head): HF-native checkpoints render it with their chat template (``chat_template_format``:
an image part becomes ``<IMG_CONTEXT>``, cut by ``chat.chat_layout``), original
``InternVLChatModel`` ones with their ``conversation.py`` template (``template_format``: the
user message ``<image>\\n{question}``, ``templates.py``). Either way the one image
placeholder is expanded to ``<img>`` + N x ``<IMG_CONTEXT>`` + ``</img>`` with N = tokens
per tile x tiles, exactly as transformers' ``InternVLProcessor`` and
``InternVLChatModel.chat`` do, and the tokenizer's own leading special tokens (InternLM2's
``<s>``; none for Qwen's) go first. Everything before the image is tokenized once (per
system turn); per request only the question and what follows it are (cached per question).
Each piece ends at an added token (``<img>``, ``</img>``), where the tokenizers split
anyway, so the ids are those of the whole text tokenized at once.

A system turn (``build(..., system)``): with a chat template, a system message before the
user turn, where the template renders one there (else ValueError, ``ChatLayout.head_with``).
A ``conversation.py`` template always renders its own system message (the config's
``system_message``, else the template's); a question's system turn replaces it where the
template has one (its ``system_template`` holds ``{system_message}``: every MPT template),
and is refused with a ValueError naming the template where it has none (``internvl_zh``).

A label set's choices are tokenized as the assistant's answer would be: the text the
format puts between the generation prompt and an answer (``answer_lead``: nothing for
chatml's templates and MPT's, a space for ``internvl_zh``'s ``<bot>: ...``), then the choice
(``PromptBuilder.answer_ids``).

Embedding inputs (``embed``): an image and its text as one user turn, without the assistant
turn (HF-native: ``<|im_start|>user\\n<img> N x <IMG_CONTEXT> </img>\\n{text}<|im_end|>\\n``,
jina's layout in InternVL's template); its ids through ``</img>`` are ``build``'s, so cached
KV serves both. A text alone is its own tokens, as given (jina's text rule; the caller adds
any prefix).

The ``Prompt`` record and its invariant are in ``models/base.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vlmbatch.models.base import Prompt
from vlmbatch.models.chat import ANSWER, QUESTION, SYSTEM, ChatLayout, chat_layout
from vlmbatch.models.internvl.parts import context_runs, parts_text
from vlmbatch.models.internvl.templates import Template
from vlmbatch.preprocessing.media import MediaPart
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.tiling import TileGrid


@dataclass(frozen=True)
class ChatFormat:
    """How a checkpoint writes a user turn holding an image and a text (module docstring)."""
    layout: ChatLayout  # the pieces around the image placeholder and the question
    user_end: str  # after the question when no assistant turn follows (embedding inputs)
    start: str  # image start, context and end tokens
    context: str
    end: str
    source: str  # what renders it, for messages
    numbered: bool = False  # several images as ``Image-k: `` lines (original checkpoints)


def chat_template_format(tok: Any) -> ChatFormat:
    """An HF-native checkpoint's: its tokenizer's chat template, an image part first."""
    no_gen = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=False)
    return ChatFormat(chat_layout(tok, tok.context_image_token), no_gen.split(QUESTION)[1],
                      tok.start_image_token, tok.context_image_token, tok.end_image_token,
                      "this checkpoint's chat template")


def template_format(template: Template, system: str | None) -> ChatFormat:
    """An original checkpoint's: its ``conversation.py`` template, the user message
    ``<image>\\n{text}`` (``InternVLChatModel.chat``); ``system``: the config's system
    message (None: the template's)."""
    user, assistant = template.roles
    message = "<image>\n" + QUESTION
    text = template.question(message, system)
    if text.count("<image>") != 1 or text.count(QUESTION) != 1:
        raise ValueError(f"conversation template {template.name!r} must render the image "
                         f"once before the question; got {text!r}")
    head, rest = text.split("<image>")
    between, tail = rest.split(QUESTION)
    with_answer = template.render([(user, message), (assistant, ANSWER)], system)
    lead = (with_answer[len(text): with_answer.index(ANSWER)]
            if with_answer.startswith(text) and ANSWER in with_answer else "")
    system_head = None
    if "{system_message}" in template.system_template:
        s_head, s_rest = template.question(message, SYSTEM).split("<image>")
        if s_rest == rest and s_head.count(SYSTEM) == 1:
            before, after = s_head.split(SYSTEM)
            system_head = before, after
    user_end = template.question(message, system, open_answer=False).split(QUESTION)[1]
    return ChatFormat(ChatLayout(head, between, tail, lead, system_head), user_end,
                      "<img>", "<IMG_CONTEXT>", "</img>",
                      f"conversation template {template.name!r}", numbered=True)


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
        self.chat = chat or chat_template_format(tokenizer)
        self.layout = self.chat.layout
        ids = tokenizer.convert_tokens_to_ids
        self._prefix = special_prefix(tokenizer)
        self._start = ids(self.chat.start)
        self._end = [ids(self.chat.end)]
        self._head = self._head_ids(None)
        # a policy asks the same few questions (and system turns, and label sets) of every
        # image: tokenize each once (bounded, for manifests whose questions all differ)
        self._question = functools.lru_cache(maxsize=4096)(self._encode_question)
        self._heads = functools.lru_cache(maxsize=256)(self._head_ids)
        self.answer_ids = functools.lru_cache(maxsize=4096)(self._answer_ids)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _encode_question(self, question: str) -> tuple[int, ...]:
        return tuple(self._encode(self.layout.between + question + self.layout.tail))

    def _head_ids(self, system: str | None) -> tuple[int, ...]:
        """The ids through ``<img>``, after ``system``'s turn when given (module
        docstring); ValueError where the format renders none."""
        if system is not None and self.layout.system_head is None:
            raise ValueError(f"{self.chat.source} renders no system turn before the image: a "
                             "question's system turn cannot be asked of this checkpoint")
        return (*self._prefix, *self._encode(self.layout.head_with(system)), self._start)

    def _answer_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self._encode(self.layout.answer_lead + text))

    def build(self, question: str, image: PreparedImage, system: str | None = None) -> Prompt:
        assert isinstance(image.grid, TileGrid)  # InternVL's plan made it
        return self.build_for_tiles(question, image.grid.num_tiles, system)

    def build_for_tiles(self, question: str, num_tiles: int,
                        system: str | None = None) -> Prompt:
        n = self.tokens_per_tile * num_tiles
        head = self._head if system is None else self._heads(system)
        ids = (*head, *[self.image_token_id] * n, *self._end, *self._question(question))
        return Prompt(ids, len(head), n)

    def build_parts(self, question: str, parts: Sequence[MediaPart],
                    system: str | None = None) -> Prompt:
        """``PromptBuilder.build_parts`` (``parts.py``); the whole text tokenized at once."""
        if not parts:
            raise ValueError("an item needs at least one image or clip")
        self._head_ids(system)  # the system turn's check
        body, counts = parts_text(parts, self.layout.between, self.chat.numbered,
                                  self.tokens_per_tile,
                                  (self.chat.start, self.chat.context, self.chat.end))
        text = self.layout.head_with(system) + body + question + self.layout.tail
        ids = (*self._prefix, *self._encode(text))
        runs = context_runs(ids, self.image_token_id)
        if len(runs) != sum(counts):
            raise ValueError(f"the prompt holds {len(runs)} image runs for {sum(counts)} "
                             "images and frames: does the question hold an image token?")
        cuts = [sum(counts[:k]) for k in range(len(counts) + 1)]
        by_part = tuple(tuple(runs[a:b]) for a, b in zip(cuts, cuts[1:]))
        first, last = runs[0], runs[-1]
        return Prompt(ids, first[0], last[0] + last[1] - first[0], parts=by_part)

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
               *self._encode(self.layout.between + text + self.chat.user_end))
        return Prompt(ids, len(self._head), n)
