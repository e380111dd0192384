"""Records passed between job stages: what to ask (Question) of which image (ImageItem)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class ManifestError(ValueError):
    """A manifest or policy file is malformed; the message names file, line and problem."""


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
