"""Where answers go: JSONL (our result lines, or OpenAI batch output lines) or CSV, written a
group at a time by ``vlmbatch run`` (``cli/run.py``) and ``vlmbatch results``
(``outputs/export.py``, which also writes Parquet).

Every format is derived from ``pipeline.records.Answer``: a JSONL line is ``Answer.line()``
(``text`` only where the question generates text: its ``max_new_tokens``, else
--max-new-tokens; ``label``, ``probs`` and ``logprobs`` only for a label-set question); CSV
has the columns ``RESULT_COLUMNS`` (``Answer.COLUMNS``) in that order (``Answer.row``: the
two maps as JSON text), a header row, and an empty field for null. When the input holds a
clip, two columns follow (``CLIP_COLUMNS``, ``clip_row``): ``frames`` (how many the model
saw) and ``seconds`` (their times, as JSON text: ``[0.0, 0.5]``), empty on other items'
rows; without a clip the file is as it was, byte for byte.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from vlmbatch.outputs.lines import write_lines
from vlmbatch.pipeline.media_inputs import VideoInput
from vlmbatch.pipeline.records import Answer, ImageItem

RESULT_COLUMNS = tuple(name for name, _ in Answer.COLUMNS)
TEXT_FORMATS = ("jsonl", "csv")
# after RESULT_COLUMNS when the input holds a clip (CSV here, Parquet: ``outputs/export.py``)
CLIP_COLUMNS = ("frames", "seconds")


def has_clips(items: list[ImageItem]) -> bool:
    """Whether any item is a clip: its results then carry ``CLIP_COLUMNS``."""
    return any(isinstance(it.image, VideoInput) for it in items)


def clip_row(a: Answer, seconds_as_text: bool = True) -> dict:
    """``a.row()`` with ``CLIP_COLUMNS``: ``frames`` and ``seconds`` (JSON text, or a list
    for Parquet), None on a line that has none (an image, a failed clip)."""
    seconds = None if a.seconds is None else list(a.seconds)
    return {**a.row(), "frames": a.frames,
            "seconds": json.dumps(seconds) if seconds_as_text and seconds is not None
            else seconds}


def format_of(path: Path | None) -> str:
    """The format a results path asks for by its suffix: parquet, csv, else jsonl."""
    suffix = path.suffix.lower() if path is not None else ""
    return {".parquet": "parquet", ".csv": "csv"}.get(suffix, "jsonl")


def line_writer(out: IO[str], fmt: str, openai: bool = False, clips: bool = False
                ) -> Callable[[list[Answer]], None]:
    """A function writing a list of answers to ``out`` in ``fmt`` (one of
    ``TEXT_FORMATS``; CSV writes its header now). For CSV, open ``out`` with ``newline=""``
    (``open_text``). ``openai``: JSONL as OpenAI batch output lines. ``clips``: the input
    holds a clip, so CSV has ``CLIP_COLUMNS`` too (JSONL lines carry them anyway)."""
    if fmt == "csv":
        writer = csv.DictWriter(out, RESULT_COLUMNS + CLIP_COLUMNS if clips else
                                RESULT_COLUMNS, extrasaction="ignore")
        writer.writeheader()

        def rows(answers: list[Answer]) -> None:
            writer.writerows(clip_row(a) if clips else a.row() for a in answers)

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


def check_writable(path: Path) -> None:
    """Raise, before any work, the ``OSError`` that writing ``path`` would (a read-only file
    system, no permission, a missing folder that cannot be made), naming ``path``; neither
    ``path`` nor its folder's other files are changed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            open(path, "r+b").close()  # opened for writing, not truncated
        else:
            tempfile.TemporaryFile(dir=path.parent).close()  # a new file there, gone at once
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e


@contextmanager
def naming(path: Path) -> Iterator[None]:
    """An ``OSError`` that names no file (a full disk on ``write``) names ``path``."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e


class GroupWriter:
    """``vlmbatch run``'s result lines, a group at a time, each group flushed: to the file
    ``path`` (opened here), else to ``out`` or standard output. An ``OSError`` names the
    file; a write that fails part-way (a full disk) cuts the file back to its last whole
    group, so what is kept never ends inside a line."""

    def __init__(self, path: Path | None, fmt: str, openai: bool = False,
                 out: IO[str] | None = None, clips: bool = False) -> None:
        self.path = path if out is None else None  # the file we opened, if any
        self.name = path or Path("<stdout>")
        with naming(self.name):
            self.file = open_text(self.path, fmt) if self.path else (out or sys.stdout)
        self.good = 0  # bytes of whole groups in self.path
        self._write = line_writer(self.file, fmt, openai, clips)  # CSV: the header, unflushed

    def write(self, items: list[ImageItem], answers: list[list[Answer]]) -> None:
        """One group's answers (each item's, in order): the drive loop's sink."""
        try:
            with naming(self.name):
                self._write([a for per_item in answers for a in per_item])
                self.file.flush()
        except OSError:
            self._cut_back()
            raise
        if self.path is not None:
            self.good = os.fstat(self.file.fileno()).st_size

    def close(self) -> None:
        if self.path is not None and not self.file.closed:
            try:
                with naming(self.name):
                    self.file.close()
            except OSError:
                self._cut_back()
                raise

    def _cut_back(self) -> None:
        if self.path is None:
            return
        try:
            self.file.close()  # flushes the rest of the buffer again, or fails again
        except OSError:
            pass
        try:
            os.truncate(self.path, self.good)
        except OSError:
            pass  # the error being raised says what went wrong
