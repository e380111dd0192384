"""The chat template around one image and one question, cut into the text pieces a prompt
builder tokenizes (``internvl/prompt.py``, ``qwen_vl/prompt.py``).

The checkpoint's own template renders, with markers in place of the texts:

- ``[user: image, QUESTION]`` + generation prompt: ``head`` + image placeholder + ``between``
  + the question + ``tail`` (the tail ends where the assistant's answer starts);
- ``[system: SYSTEM, user: image, QUESTION]`` + generation prompt: ``system_head`` holds the
  text before and after the system text, everything from the image on is as above (a
  template that drops a system turn, or renders it after the image, has none: a system turn
  is then refused). A template with a default system prompt (Qwen2-VL's released one) renders
  it in ``head``, and a given system turn replaces it, as transformers renders it;
- ``[user: image, QUESTION], [assistant: ANSWER]`` without a generation prompt: the text
  between the generation prompt and the answer is ``answer_lead`` (chatml's templates:
  nothing, so a choice follows ``<|im_start|>assistant\\n`` with no leading space). A label
  set's choices are tokenized as ``answer_lead + choice`` (``PromptBuilder.answer_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUESTION = "\x00QUESTION\x00"
SYSTEM = "\x00SYSTEM\x00"
ANSWER = "\x00ANSWER\x00"


@dataclass(frozen=True)
class ChatLayout:
    head: str  # before the image placeholder, without a system turn
    between: str  # after the image placeholder, before the question
    tail: str  # after the question, through the generation prompt
    answer_lead: str  # after the generation prompt, before the assistant's answer
    system_head: tuple[str, str] | None  # before and after a system turn's text (None: none)

    def head_with(self, system: str | None) -> str:
        """The text before the image placeholder, with ``system`` as the system turn;
        ValueError where the template renders none."""
        if system is None:
            return self.head
        if self.system_head is None:
            raise ValueError("this checkpoint's chat template renders no system turn before "
                             "the image: a question's system turn cannot be asked")
        return self.system_head[0] + system + self.system_head[1]


def _user(image: dict) -> dict:
    return {"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}


def chat_layout(tokenizer: Any, placeholder: str,
                chat_kwargs: dict[str, Any] | None = None) -> ChatLayout:
    """The pieces of ``tokenizer``'s chat template around an image part rendered as
    ``placeholder`` (``chat_kwargs``: the template's own switches, e.g. Qwen3.5's
    ``enable_thinking=False``); ValueError if it does not render exactly one placeholder
    before the question."""
    image = {"type": "image"}

    def render(messages: list[dict], generation: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation,
                                             **(chat_kwargs or {}))

    text = render([_user(image)], True)
    if text.count(placeholder) != 1 or text.count(QUESTION) != 1 \
            or text.index(placeholder) > text.index(QUESTION):
        raise ValueError(f"the chat template must render exactly one image placeholder "
                         f"{placeholder!r} before the question; got {text!r}")
    head, rest = text.split(placeholder)
    between, tail = rest.split(QUESTION)
    with_answer = render([_user(image), {"role": "assistant", "content": ANSWER}], False)
    lead = (with_answer[len(text): with_answer.index(ANSWER)]
            if with_answer.startswith(text) and ANSWER in with_answer else "")
    return ChatLayout(head, between, tail, lead, _system_head(render, image, placeholder, rest))


def _system_head(render: Any, image: dict, placeholder: str,
                 rest: str) -> tuple[str, str] | None:
    """The text before and after a system turn's text, or None where the template does not
    render one before the image, whole, with the rest unchanged."""
    try:
        text = render([{"role": "system", "content": SYSTEM}, _user(image)], True)
    except Exception:  # noqa: BLE001  (a template may raise on a system turn: none then)
        return None
    if text.count(SYSTEM) != 1 or text.count(placeholder) != 1:
        return None
    head, after = text.split(placeholder)
    if after != rest or SYSTEM not in head:
        return None
    before, after_system = head.split(SYSTEM)
    return before, after_system
