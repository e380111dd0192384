"""Where result lines go: JSONL (ours, or OpenAI batch output lines) or CSV, written a group
at a time by ``vlmbatch run`` (``jobs/runner.py``) and ``vlmbatch results``
(``jobs/export.py``, which also writes Parquet).

A result line is a dict with the keys ``RESULT_COLUMNS`` (``text`` only on lines whose
question generates text: its ``max_new_tokens``, else --max-new-tokens). CSV has those
columns in that order, a header row, and an empty field for null; JSONL keeps each line as
it is.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import IO

from jobs.openai_batch import write_lines

RESULT_COLUMNS = ("id", "question_id", "question", "answer", "p_yes", "margin",
                  "image_tokens", "error", "text")
TEXT_FORMATS = ("jsonl", "csv")


def format_of(path: Path | None) -> str:
    """The format a results path asks for by its suffix: parquet, csv, else jsonl."""
    suffix = path.suffix.lower() if path is not None else ""
    return {".parquet": "parquet", ".csv": "csv"}.get(suffix, "jsonl")


def line_writer(out: IO[str], fmt: str, openai: bool = False) -> Callable[[list[dict]], None]:
    """A function writing a list of result lines to ``out`` in ``fmt`` (one of
    ``TEXT_FORMATS``; CSV writes its header now). For CSV, open ``out`` with ``newline=""``
    (``open_text``). ``openai``: JSONL as OpenAI batch output lines."""
    if fmt == "csv":
        writer = csv.DictWriter(out, RESULT_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        return writer.writerows
    if fmt != "jsonl":
        raise ValueError(f"format {fmt!r} not one of {TEXT_FORMATS}")

    def write(lines: list[dict]) -> None:
        out.write(write_lines(lines, openai))

    return write


def open_text(path: Path, fmt: str) -> IO[str]:
    """``path`` opened for writing ``fmt`` (its parent folders made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "w", newline="" if fmt == "csv" else None, encoding="utf-8")
