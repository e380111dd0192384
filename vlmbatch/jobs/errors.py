"""Errors of the job layer, and the small checks of the input readers that raise them."""

from __future__ import annotations

import reprlib
from collections.abc import Iterable

from vlmbatch.pipeline.records import MAX_CHOICES

_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 80
_BRIEF.maxlevel, _BRIEF.maxlist, _BRIEF.maxdict = 3, 4, 4


def brief(value: object) -> str:
    """repr for an error message: short for a multi-MB string, a deep or wide structure
    (a YAML alias bomb's full repr would never finish)."""
    text = _BRIEF.repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


class ManifestError(ValueError):
    """A manifest, policy or job folder is malformed; the message names file, line and
    problem (and, for a damaged job folder, what to do)."""


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
