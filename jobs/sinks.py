"""Where answers go: JSONL (our result lines, or OpenAI batch output lines) or CSV, written a
group at a time by ``vlmbatch run`` (``jobs/runner.py``) and ``vlmbatch results``
(``jobs/export.py``, which also writes Parquet).

Every format is derived from ``pipeline.records.Answer``: a JSONL line is ``Answer.line()``
(``text`` only where the question generates text: its ``max_new_tokens``, else
--max-new-tokens); CSV has the columns ``RESULT_COLUMNS`` (``Answer.COLUMNS``) in that
order, a header row, and an empty field for null.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import IO

from jobs.openai_batch import write_lines
from pipeline.records import Answer

RESULT_COLUMNS = tuple(name for name, _ in Answer.COLUMNS)
TEXT_FORMATS = ("jsonl", "csv")


def format_of(path: Path | None) -> str:
    """The format a results path asks for by its suffix: parquet, csv, else jsonl."""
    suffix = path.suffix.lower() if path is not None else ""
    return {".parquet": "parquet", ".csv": "csv"}.get(suffix, "jsonl")


def line_writer(out: IO[str], fmt: str, openai: bool = False
                ) -> Callable[[list[Answer]], None]:
    """A function writing a list of answers to ``out`` in ``fmt`` (one of
    ``TEXT_FORMATS``; CSV writes its header now). For CSV, open ``out`` with ``newline=""``
    (``open_text``). ``openai``: JSONL as OpenAI batch output lines."""
    if fmt == "csv":
        writer = csv.DictWriter(out, RESULT_COLUMNS, extrasaction="ignore")
        writer.writeheader()

        def rows(answers: list[Answer]) -> None:
            writer.writerows(a.line() for a in answers)

        return rows
    if fmt != "jsonl":
        raise ValueError(f"format {fmt!r} not one of {TEXT_FORMATS}")

    def write(answers: list[Answer]) -> None:
        out.write(write_lines(answers, openai))

    return write


def open_text(path: Path, fmt: str) -> IO[str]:
    """``path`` opened for writing ``fmt`` (its parent folders made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "w", newline="" if fmt == "csv" else None, encoding="utf-8")
