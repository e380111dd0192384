"""The input readers' own checks (``check_unicode``). The error they raise, ``ManifestError``,
and the question parser's checks (``brief``, ``check_id``, ``parse_choices``) live with
``Question`` in ``pipeline/questions.py``, which every way in shares: import them from
there."""

from __future__ import annotations

from collections.abc import Iterable

from vlmbatch.pipeline.questions import ManifestError, brief


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
