"""A question as users write it and as the drive carries it: the ``Question`` record and the
one parser every way in shares (manifest lines, policies, table rows, shard samples, Ray Data
rows, the Python API), with the small checks of input readers and the error they raise.

A question is a string or ``{"id", "text", "threshold"?, "max_new_tokens"?, "choices"?,
"prompt"?, "system"?, "expected"?}`` (``inputs/manifest.py`` documents each field); any other
key is refused (``check_keys``: the key, the keys allowed, a close match suggested), so a
misspelt ``threshold`` cannot silently fall back to 0.5; the readers refuse unknown keys at
every other level of what they read the same way.

Light: no torch, no image decoder (``status`` and ``--help`` import it through the job
layer).
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 80
_BRIEF.maxlevel, _BRIEF.maxlist, _BRIEF.maxdict = 3, 4, 4

# most choices a label-set question may have (each is a row of the engine's continuation)
MAX_CHOICES = 64
QUESTION_KEYS = frozenset({"id", "text", "threshold", "max_new_tokens", "choices", "prompt",
                           "system", "expected"})
YES_NO = ("yes", "no")
# characters a question may hold (its text, instruction and system turn together) unless a
# run says otherwise (--max-prompt-chars): the server's chat limit, and ~2-4x the built-in
# model's 4,096-token context, which the model's own check then bounds
MAX_PROMPT_CHARS = 16_384


class ManifestError(ValueError):
    """A manifest, policy, question or job folder is malformed; the message names file,
    line and problem (and, for a damaged job folder, what to do)."""


@dataclass(frozen=True)
class Question:
    id: str
    text: str
    threshold: float = 0.5
    # greedy answer tokens to generate for this question (an explanation after the yes/no);
    # None: the run's --max-new-tokens (0 by default: P(yes) only)
    max_new_tokens: int | None = None
    # a label set: 2..MAX_CHOICES distinct non-empty strings, scored as the assistant's whole
    # answer; () for a yes/no question
    choices: tuple[str, ...] = ()
    system: str | None = None  # a system turn before the user's (a policy's ``system:``)
    prompt: str | None = None  # an instruction before the question, in the same user turn
    # the user's label for this question ("yes"/"no", or one of its choices): scored by
    # `vlmbatch eval MANIFEST`, kept by a job's store for `vlmbatch report` (right/wrong
    # marks); answering ignores it
    expected: str | None = None

    @property
    def user_text(self) -> str:
        """The user turn's text: the instruction, a newline, then the question."""
        return self.text if self.prompt is None else f"{self.prompt}\n{self.text}"

    @property
    def prompt_chars(self) -> int:
        """The characters the user wrote into the prompt: text, instruction, system turn."""
        return len(self.user_text) + len(self.system or "")


class PromptTooLong(ManifestError):
    """A question over ``PromptLimits`` (the server's code: ``context_length_exceeded``)."""


@dataclass(frozen=True)
class PromptLimits:
    """How long a question may be, checked before any work (``check``): ``chars``
    characters (``Question.prompt_chars``), and, with ``tokens`` (the model's token count of
    a text, from its tokenizer alone) and ``context`` (the model's context in tokens,
    config.json's ``max_position_embeddings``; 0: none stated), its system turn and user
    text at most ``context`` tokens. The image's tokens come on top of those."""
    chars: int = MAX_PROMPT_CHARS
    context: int = 0
    tokens: Callable[[str], int] | None = None

    def check(self, q: Question, where: str) -> None:
        """PromptTooLong naming ``where`` and the question if it is over a limit."""
        if (n := q.prompt_chars) > self.chars:
            raise PromptTooLong(f"{where}: question {q.id!r} is {n:,} characters (text, prompt "
                                f"and system), over the limit of {self.chars:,} "
                                "(--max-prompt-chars)")
        if self.tokens is not None and self.context > 0:
            t = self.tokens(q.user_text) + (self.tokens(q.system) if q.system else 0)
            if t > self.context:
                raise PromptTooLong(f"{where}: question {q.id!r} is {t:,} tokens before its "
                                    f"image's, over the model's context of {self.context:,} "
                                    "(config.json max_position_embeddings)")


def brief(value: object) -> str:
    """repr for an error message: short for a multi-MB string, a deep or wide structure
    (a YAML alias bomb's full repr would never finish)."""
    text = _BRIEF.repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def check_keys(rec: Mapping, allowed: Collection[str], where: str, what: str,
               subject: str = "", inner: tuple[str, Collection[str]] | None = None) -> None:
    """ManifestError naming ``where``, the keys of ``rec`` not in ``allowed`` (a close match
    of the first misspelt one suggested) and the keys ``what`` has; ``subject`` (e.g.
    "question 0 ") says whose keys they are. ``inner``: (what, keys) of the objects ``rec``
    holds (a line's question objects): one of their keys found here is said to go there. A
    reader calls it at every level of what it reads, so a misspelt key is never silently
    ignored with what it held."""
    unknown = sorted((k for k in rec if k not in allowed), key=str)  # YAML keys: 1, null...
    if not unknown:
        return
    names = sorted(allowed)
    words = [k for k in unknown if isinstance(k, str) and len(k) <= 64]
    close = next((m for k in words for m in difflib.get_close_matches(k, names, 1, 0.75)),
                 None)
    hint = f" (did you mean {close!r}?)" if close is not None else ""
    if inner is not None and not hint:
        there = next((m for k in words for m in difflib.get_close_matches(
            k, sorted(inner[1]), 1, 0.75)), None)
        hint = f" ({there!r} is a key of {inner[0]}: it goes inside each)" if there else ""
    raise ManifestError(f"{where}: {subject}{'has ' if subject else ''}unknown key(s) "
                        f"{brief(unknown)}{hint}; {what} has {names}")


def check_id(raw: object, where: str, what: str) -> str:
    """An id as written: a non-blank string or a whole number, kept as text (so 7 and "7"
    are the same id). null, true, 1.5 or a list are refused, not turned into "None" etc."""
    if isinstance(raw, bool) or not isinstance(raw, (str, int)) or not str(raw).strip():
        raise ManifestError(f"{where}: {what} must be a non-blank string or a whole number, "
                            f"got {brief(raw)}")
    return str(raw)


def parse_choices(raw: object, where: str) -> tuple[str, ...]:
    """A label set: a list of 2 to ``MAX_CHOICES`` distinct non-empty strings, as given;
    ManifestError naming ``where`` otherwise."""
    if not isinstance(raw, list) or not all(isinstance(c, str) for c in raw):
        raise ManifestError(f"{where}: choices must be a list of strings, got {brief(raw)}")
    if len(raw) < 2:
        raise ManifestError(f"{where}: choices must list at least 2 labels, got {brief(raw)} "
                            "(a yes/no question has no choices)")
    if len(raw) > MAX_CHOICES:
        raise ManifestError(f"{where}: {len(raw)} choices, over the limit of {MAX_CHOICES}")
    if empty := [i for i, c in enumerate(raw) if not c.strip()]:
        raise ManifestError(f"{where}: choice {empty[0]} is empty")
    if dup := sorted({c for c in raw if raw.count(c) > 1}):
        raise ManifestError(f"{where}: choices repeat: {brief(dup)}")
    return tuple(raw)


def parse_question(raw: object, where: str, index: int, prefix: str = "q") -> Question:
    """A question given as a string or ``{"id", "text", "threshold"?, "max_new_tokens"?,
    "choices"?, "prompt"?, "system"?, "expected"?}``; ManifestError naming ``where`` and
    ``index`` otherwise. Without an id it is ``{prefix}{index}``."""
    if isinstance(raw, str):
        if not raw.strip():
            raise ManifestError(f"{where}: question {index} is empty")
        return Question(id=f"{prefix}{index}", text=raw)
    if not isinstance(raw, dict) or not isinstance(raw.get("text"), str) \
            or not raw["text"].strip():
        raise ManifestError(f"{where}: question {index} must be a string or an object with a "
                            f"non-empty 'text', got {brief(raw)}")
    check_keys(raw, QUESTION_KEYS, where, "a question object", f"question {index} ")
    thr = raw.get("threshold", 0.5)
    if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0.0 <= thr <= 1.0:
        raise ManifestError(f"{where}: question {index} threshold must be a number in [0, 1], "
                            f"got {brief(thr)}")
    gen = raw.get("max_new_tokens")
    if gen is not None and (not isinstance(gen, int) or isinstance(gen, bool) or gen < 0):
        raise ManifestError(f"{where}: question {index} max_new_tokens must be a whole number "
                            f">= 0, got {brief(gen)}")
    choices = parse_choices(raw["choices"], f"{where}: question {index}") \
        if "choices" in raw else ()
    if choices and "threshold" in raw:
        raise ManifestError(f"{where}: question {index} has choices and a threshold: a label "
                            "set's answer is its most probable choice, a threshold applies to "
                            "yes/no questions")
    qid = check_id(raw.get("id", f"{prefix}{index}"), where, f"question {index} id")
    expected = check_expected(raw.get("expected"), choices or None, where, f"question {index}")
    return Question(id=qid, text=raw["text"], threshold=float(thr), max_new_tokens=gen,
                    choices=choices, system=_text(raw, "system", where, index),
                    prompt=_text(raw, "prompt", where, index), expected=expected)


def _text(raw: dict, key: str, where: str, index: int) -> str | None:
    """A question's optional non-blank text field (``system``, ``prompt``)."""
    v = raw.get(key)
    if v is not None and (not isinstance(v, str) or not v.strip()):
        raise ManifestError(f"{where}: question {index} {key} must be a non-empty string, got "
                            f"{brief(v)}")
    return v


def check_expected(raw: object, choices: tuple[str, ...] | None, where: str,
                   what: str) -> str | None:
    """A label as given (``expected`` of a question or a labels line): None when absent,
    else ``"yes"``/``"no"`` for a yes/no question (``choices`` None) or one of ``choices``;
    ManifestError naming ``where`` and ``what`` otherwise. Exact: ``"Yes"`` is refused, not
    read as yes, as a label-set's choices are matched exactly; but true/false are yes/no
    (YAML 1.1 reads a policy's bare ``expected: yes`` as true)."""
    if raw is None:
        return None
    if isinstance(raw, bool):
        raw = "yes" if raw else "no"
    allowed = YES_NO if choices is None else choices
    if not isinstance(raw, str) or raw not in allowed:
        kind = "a yes/no question's" if choices is None else "its"
        raise ManifestError(f"{where}: {what} expected must be one of {kind} answers "
                            f"{list(allowed)}, got {brief(raw)}")
    return raw


def questions_of(questions: object, where: str = "questions") -> tuple[Question, ...]:
    """Questions as a manifest line would give them (ids q0, q1, ... unless set): one or a
    sequence of strings, question objects (dicts) or ``Question``s, their ids distinct.
    ManifestError naming ``where`` for a malformed one, ValueError for none."""
    if isinstance(questions, (str, dict, Question)):
        questions = [questions]
    if not isinstance(questions, Sequence):
        raise ManifestError(f"{where}: questions are a string, a question object or a list of "
                            f"them, got {brief(questions)}")
    out = tuple(q if isinstance(q, Question) else parse_question(q, where, i)
                for i, q in enumerate(questions))
    if not out:
        raise ValueError("no questions to ask")
    ids = [q.id for q in out]
    if len(set(ids)) != len(ids):
        raise ManifestError(f"{where}: question ids repeat: {brief(ids)}")
    return out
