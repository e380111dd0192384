"""Records passed between job stages: what to ask (Question) of which image (ImageItem)."""

from __future__ import annotations

import reprlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 80
_BRIEF.maxlevel, _BRIEF.maxlist, _BRIEF.maxdict = 3, 4, 4


def brief(value: object) -> str:
    """repr for an error message: short for a multi-MB string, a deep or wide structure
    (a YAML alias bomb's full repr would never finish)."""
    text = _BRIEF.repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


class ManifestError(ValueError):
    """A manifest or policy file is malformed; the message names file, line and problem."""


def check_id(raw: object, where: str, what: str) -> str:
    """An id as written: a non-blank string or a whole number, kept as text (so 7 and "7"
    are the same id). null, true, 1.5 or a list are refused, not turned into "None" etc."""
    if isinstance(raw, bool) or not isinstance(raw, (str, int)) or not str(raw).strip():
        raise ManifestError(f"{where}: {what} must be a non-blank string or a whole number, "
                            f"got {brief(raw)}")
    return str(raw)


def check_unicode(texts: Iterable[str], where: str) -> None:
    """Refuse lone surrogates (JSON's and YAML's "\\ud800" escapes decode to one): they are
    not Unicode, and the UTF-8 results file could not hold them."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ManifestError(f"{where}: {brief(text)} holds a lone surrogate "
                                f"({text[e.start]!r} at character {e.start}), which is not "
                                "valid Unicode") from None


@dataclass(frozen=True)
class Question:
    id: str
    text: str
    threshold: float = 0.5
    # greedy answer tokens to generate for this question (an explanation after the yes/no);
    # None: the run's --max-new-tokens (0 by default: P(yes) only)
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class ImageItem:
    id: str
    image: str  # path, file:// or data: URL, as written in the input
    questions: tuple[Question, ...]
    base_dir: Path  # relative paths resolve against this
