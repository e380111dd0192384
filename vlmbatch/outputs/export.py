"""A job's results out of its store: JSONL (ours or OpenAI batch output lines), CSV or Parquet
(one file, or a dataset of several: a folder of ``part-NNNNN.parquet`` files).

All stream the store in manifest order, so memory stays bounded whatever the job's size. The
columns are ``Answer.COLUMNS`` (``pipeline/records.py``), for every format, then ``frames``
and ``seconds`` when the job holds a clip (``outputs/sinks.py``: ``CLIP_COLUMNS``). An
embedding job's results go to an ``EmbeddingSink`` instead (``outputs/embed_sinks.py``:
JSONL, Parquet, .npy), or, for a job of OpenAI embedding requests, as OpenAI batch output
lines (``embed_request_lines``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from vlmbatch.inputs.openai_embeddings import EmbedRequestItem
from vlmbatch.jobs.folder import STORE_FILE, job_format, require_job
from vlmbatch.jobs.store import JobStore
from vlmbatch.outputs.embed_sinks import EmbeddingSink
from vlmbatch.outputs.lines import to_embed_output
from vlmbatch.outputs.sinks import clip_row, line_writer
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.records import Answer, Embedding


def export_text(job: Path, out: IO[str], fmt: str = "jsonl", hooks: FaultHooks = NO_HOOKS) -> int:
    """Every recorded answer to ``out`` as JSONL (OpenAI batch output lines for a job
    submitted in that format) or CSV (our columns for either; ``outputs/sinks.py``)."""
    require_job(job)
    store = JobStore(Path(job) / STORE_FILE)
    try:
        write = line_writer(out, fmt, job_format(Path(job)) == "openai", store.holds_clips())
        n = 0
        for a in store.answers():
            write([a])
            n += 1
            hooks.exported(n)
        return n
    finally:
        store.close()


PARQUET_ROWS_PER_FILE = 1_000_000  # a Parquet dataset's files, unless --rows-per-file


def _pyarrow() -> tuple:
    try:  # optional dependency: the parquet extra
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ModuleNotFoundError as e:
        raise ImportError("Parquet output needs pyarrow: pip install 'vlmbatch[parquet]'") from e
    return pa, pq


def export_parquet(job: Path, path: Path, rows_per_group: int = 65536,
                   hooks: FaultHooks = NO_HOOKS, rows_per_file: int | None = None) -> int:
    """Every recorded answer as a Parquet row (columns ``Answer.COLUMNS``, then ``frames``
    int64 and ``seconds`` list<double> when the job holds a clip), written in row
    groups: memory stays bounded. ``rows_per_file``: ``path`` is a folder, a Parquet dataset
    of files ``part-00000.parquet``, ... of at most that many rows each, in manifest order
    (``pyarrow.parquet.read_table(path)`` reads them back as one table)."""
    require_job(job)
    pa, pq = _pyarrow()
    types = {str: pa.string(), float: pa.float64(), int: pa.int64()}
    schema = pa.schema([(name, types[t]) for name, t in Answer.COLUMNS])
    if rows_per_file is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
    per_file = rows_per_file or float("inf")
    rows_per_group = min(rows_per_group, rows_per_file or rows_per_group)
    store = JobStore(Path(job) / STORE_FILE)
    n, files, writer, in_file = 0, 0, None, 0
    try:
        clips = store.holds_clips()
        if clips:
            schema = schema.append(pa.field("frames", pa.int64())).append(
                pa.field("seconds", pa.list_(pa.float64())))
        rows: list[dict] = []
        for a in store.answers():
            rows.append(clip_row(a, seconds_as_text=False) if clips else a.row())
            hooks.exported(n + len(rows))
            if len(rows) == rows_per_group or in_file + len(rows) == per_file:
                if writer is None:
                    writer = _writer(pq, path, schema, rows_per_file, files)
                    files += 1
                writer.write_table(pa.Table.from_pylist(rows, schema))
                n, in_file, rows = n + len(rows), in_file + len(rows), []
                if in_file == per_file:
                    writer.close()
                    writer, in_file = None, 0
        if rows or n == 0:  # the rest; an empty job still gets one (empty) file
            writer = writer or _writer(pq, path, schema, rows_per_file, files)
            writer.write_table(pa.Table.from_pylist(rows, schema))
            n += len(rows)
    finally:
        if writer is not None:
            writer.close()
        store.close()
    return n


def _writer(pq: Any, path: Path, schema: Any, rows_per_file: int | None, index: int) -> Any:
    """The ParquetWriter of ``path``, or of a dataset's ``index``-th file in it."""
    where = Path(path) / f"part-{index:05d}.parquet" if rows_per_file else Path(path)
    return pq.ParquetWriter(str(where), schema)


def recorded_results(job: Path) -> int:
    """How many results the job has recorded (what an export holds: a row per answer or
    embedding; a request of several strings has one per string)."""
    require_job(job)
    store = JobStore(Path(job) / STORE_FILE)
    try:
        return store.questions_done()
    finally:
        store.close()


def export_embeddings(job: Path, sink: EmbeddingSink, batch: int = 1024) -> int:
    """Every recorded embedding of an embedding job to ``sink``, in manifest order (closed
    at the end); returns how many."""
    require_job(job)
    store = JobStore(Path(job) / STORE_FILE)
    n = 0
    try:
        rows: list[Embedding] = []
        for e in store.records(Embedding.from_record):
            rows.append(e)
            if len(rows) == batch:
                sink.write(rows)
                n, rows = n + len(rows), []
        sink.write(rows)
        sink.close()
        return n + len(rows)
    finally:
        store.close()


def embed_request_lines(job: Path, model: str = "vlmbatch") -> Iterator[dict]:
    """The OpenAI batch output line of every recorded request of a job submitted from a file
    of ``/v1/embeddings`` requests (``inputs/openai_embeddings.py``), in input order."""
    require_job(job)
    store = JobStore(Path(job) / STORE_FILE)
    try:
        for item, results in store.recorded_items(EmbedRequestItem.from_json,
                                                  Embedding.from_record):
            yield to_embed_output(item, results, model)
    finally:
        store.close()


def export_embed_requests(job: Path, out: IO[str]) -> int:
    """``embed_request_lines`` as JSONL to ``out``; returns how many."""
    n = 0
    for n, line in enumerate(embed_request_lines(job), 1):
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
    return n
