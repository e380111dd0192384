"""The chat templates of InternVL's original releases, by the ``template`` name of their
config.json: the ones InternVL's ``conversation.py`` registers (the copy in
``internvl_chat/internvl/conversation.py`` and in each model repository), read as facts.

Each is ``(system_template, system_message, roles, separator style, sep, sep2)``; the model
renders a conversation with ``get_prompt`` of the style and, for a question about an image,
the user message ``"<image>\\n" + question`` (``InternVLChatModel.chat``), the assistant's
left open; ``<image>`` is then replaced by ``<img>`` + N x ``<IMG_CONTEXT>`` + ``</img>`` and
the whole tokenized with the tokenizer's own special tokens (InternLM2's ``<s>`` first).
A config's ``system_message`` replaces the template's, as the model's ``__init__`` does.

- ``Hermes-2`` (InternVL2-1B, Qwen2) and ``internlm2-chat`` (InternVL2-2B/8B/26B, InternLM2):
  MPT, ``...<|im_end|><|im_start|>user\n{q}<|im_end|><|im_start|>assistant\n``;
- ``internvl2_5`` (InternVL2.5, 3 and 3.5): MPT, the same with ``\n`` after each
  ``<|im_end|>``, and a newer system message;
- ``phi3-chat`` (InternVL2-4B; its Phi-3 decoder is refused): MPT,
  ``...<|end|><|user|>\n{q}<|end|><|assistant|>\n``;
- ``internvl_zh`` (InternVL-Chat-V1-1): INTERNVL_ZH, `` <human>: {q} <bot>:``.

MPT: ``system_template.format(system_message) + sep``, then each message ``role + message +
sep`` (the open one: ``role``). INTERNVL_ZH: ``system_message + sep2``, then message i as
``role + ": " + message + [sep2, sep][i % 2]`` (the open one: ``role + ":"``).
"""

from __future__ import annotations

from dataclasses import dataclass

_INTERNVL2_SYSTEM = ("你是由上海人工智能实验室联合商汤科技开发的"
                     "书生多模态大模型，英文名叫InternVL, "
                     "是一个有用无害的人工智能助手。")
_INTERNVL25_SYSTEM = ("你是书生·万象，英文名是InternVL，"
                      "是由上海人工智能实验室、清华大学及多家合作单位"
                      "联合开发的多模态大语言模型。")


@dataclass(frozen=True)
class Template:
    name: str
    system_template: str
    system_message: str
    roles: tuple[str, str]
    style: str  # "mpt" | "internvl_zh"
    sep: str
    sep2: str = ""

    def render(self, messages: list[tuple[str, str | None]], system: str | None = None) -> str:
        """``get_prompt`` of ``messages`` ``[(role, text or None for the open turn)]``;
        ``system`` replaces the template's system message."""
        sys_msg = self.system_message if system is None else system
        if self.style == "mpt":
            out = self.system_template.format(system_message=sys_msg) + self.sep
            for role, text in messages:
                out += role + text + self.sep if text else role
            return out
        seps = (self.sep2, self.sep)
        out = sys_msg + seps[0]
        for i, (role, text) in enumerate(messages):
            out += role + ": " + text + seps[i % 2] if text else role + ":"
        return out

    def question(self, text: str, system: str | None = None, open_answer: bool = True) -> str:
        """One user turn with ``text``, then (``open_answer``) the assistant's, left open."""
        turns: list[tuple[str, str | None]] = [(self.roles[0], text)]
        return self.render(turns + [(self.roles[1], None)] if open_answer else turns, system)


_CHATML = ("<|im_start|>user\n", "<|im_start|>assistant\n")
TEMPLATES = {t.name: t for t in (
    Template("Hermes-2", "<|im_start|>system\n{system_message}", _INTERNVL2_SYSTEM, _CHATML,
             "mpt", "<|im_end|>"),
    Template("internlm2-chat", "<|im_start|>system\n{system_message}", _INTERNVL2_SYSTEM,
             _CHATML, "mpt", "<|im_end|>"),
    Template("phi3-chat", "<|system|>\n{system_message}", _INTERNVL2_SYSTEM,
             ("<|user|>\n", "<|assistant|>\n"), "mpt", "<|end|>"),
    Template("internvl2_5", "<|im_start|>system\n{system_message}", _INTERNVL25_SYSTEM,
             _CHATML, "mpt", "<|im_end|>\n"),
    Template("internvl_zh", "", "", ("<human>", "<bot>"), "internvl_zh", "</s>", " "),
)}
