"""Records passed between stages (frozen dataclasses, never loose dicts).

    ImageItem(questions: Question...) --prepare--> PreparedImage (preprocessing/)
        --Request per question--> engine --Score--> Answer (one per image x question)

``Answer`` is what the engine side hands to sinks: the JSONL line, the CSV and Parquet
columns, the OpenAI batch output and the Python API's results are all derived from it, in
``Answer.line`` / ``Answer.COLUMNS``. A failed answer carries its ``ErrorKind`` as well as
the message, so nothing downstream matches message text.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

# an image as an item may hold it: a path (relative to ``base_dir``), a file:// or data: URL
# (strings: what a manifest or a job store holds), encoded bytes, or decoded uint8 RGB pixels
# [H, W, 3] (the Python API)
ImageSource = str | bytes | np.ndarray


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
    image: ImageSource
    questions: tuple[Question, ...]
    base_dir: Path  # relative paths resolve against this

    @property
    def source(self) -> str:
        """How messages name the image: its path or URL as given, else ``image ID``."""
        return self.image if isinstance(self.image, str) else f"image {self.id}"


@dataclass(frozen=True)
class Request:
    image: int  # index into the images passed to ``Engine.score``
    question: str
    max_new_tokens: int | None = None  # answer tokens to generate; None: the engine's


@dataclass(frozen=True)
class Score:
    p_yes: float
    margin: float  # logsumexp(yes logits) - logsumexp(no logits)
    image_tokens: int
    text: str | None = None  # greedy answer text when max_new_tokens > 0
    prompt_tokens: int | None = None  # the prompt's tokens (image ones included); None: unknown


class ErrorKind(StrEnum):
    """Why an answer has none: its image could not be read (``source``), decoded
    (``decode``), was over the pixel limit (``too_large``), decoding hung (``decode_timeout``)
    or killed its worker (``decoder_crashed``), or the engine failed on its batch
    (``engine``); ``unknown`` only for failures recorded by versions that kept no kind."""
    SOURCE = "source"
    DECODE = "decode"
    TOO_LARGE = "too_large"
    DECODE_TIMEOUT = "decode_timeout"
    DECODER_CRASHED = "decoder_crashed"
    ENGINE = "engine"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ItemError:
    """Why an image has no answers (every question about it gets this)."""
    kind: ErrorKind
    message: str


@dataclass(frozen=True)
class Answer:
    """One (image, question) result. ``p_yes`` is rounded to 6 decimals and ``margin`` to 4,
    as every output shows them, so the API's answers equal ``vlmbatch run``'s lines."""
    image_id: str
    question_id: str
    question: str
    answer: str | None  # "yes" if p_yes >= the question's threshold, else "no"; None: error
    p_yes: float | None
    margin: float | None
    image_tokens: int | None
    text: str | None = None  # greedy text, where the question (or run) asked for one
    error: str | None = None
    error_kind: ErrorKind | None = None

    # the result line's fields, in order, with their types (CSV/Parquet columns); ``text``
    # appears in a JSONL line only when set
    COLUMNS: ClassVar[tuple[tuple[str, type], ...]] = (
        ("id", str), ("question_id", str), ("question", str), ("answer", str),
        ("p_yes", float), ("margin", float), ("image_tokens", int), ("error", str),
        ("text", str))

    @classmethod
    def scored(cls, image_id: str, q: Question, s: Score) -> Answer:
        return cls(image_id, q.id, q.text, "yes" if s.p_yes >= q.threshold else "no",
                   round(s.p_yes, 6), round(s.margin, 4), s.image_tokens, s.text)

    @classmethod
    def failed(cls, image_id: str, q: Question, err: ItemError) -> Answer:
        return cls(image_id, q.id, q.text, None, None, None, None, None, err.message, err.kind)

    def line(self) -> dict[str, Any]:
        """The result line: ``{"id", "question_id", "question", "answer", "p_yes", "margin",
        "image_tokens", "error"}``, then ``"text"`` when set."""
        d: dict[str, Any] = {"id": self.image_id, "question_id": self.question_id,
                             "question": self.question, "answer": self.answer,
                             "p_yes": self.p_yes, "margin": self.margin,
                             "image_tokens": self.image_tokens, "error": self.error}
        if self.text is not None:
            d["text"] = self.text
        return d

    def record(self) -> dict[str, Any]:
        """``line()`` plus ``error_kind`` when failed: what a job store keeps."""
        d = self.line()
        if self.error_kind is not None:
            d["error_kind"] = self.error_kind.value
        return d

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> Answer:
        """Inverse of ``record`` (also of a plain ``line``, as stores from before the kinds
        hold: a failure there reads as kind ``unknown``)."""
        kind = d.get("error_kind")
        error_kind = ErrorKind(kind) if kind else (ErrorKind.UNKNOWN if d.get("error") else None)
        return cls(d["id"], d["question_id"], d["question"], d["answer"], d["p_yes"],
                   d["margin"], d["image_tokens"], d.get("text"), d.get("error"), error_kind)
