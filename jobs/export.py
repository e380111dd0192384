"""A job's results out of its store: JSONL (ours or OpenAI batch output lines), CSV or Parquet.

All stream the store in manifest order, so memory stays bounded whatever the job's size.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

from jobs.job import STORE_FILE, read_job_file, require_job
from jobs.sinks import RESULT_COLUMNS, line_writer
from jobs.store import JobStore


def export_text(job: Path, out: IO[str], fmt: str = "jsonl") -> int:
    """Every recorded result line to ``out`` as JSONL (OpenAI batch output lines for a job
    submitted in that format) or CSV (our columns for either; ``jobs/sinks.py``)."""
    require_job(job)
    openai = read_job_file(Path(job)).get("format") == "openai"
    write = line_writer(out, fmt, openai)
    store = JobStore(Path(job) / STORE_FILE)
    try:
        n = 0
        for line in store.results():
            write([line])
            n += 1
        return n
    finally:
        store.close()


def export_parquet(job: Path, path: Path, rows_per_group: int = 65536) -> int:
    """Every recorded result line as a Parquet row (columns ``RESULT_COLUMNS``), written in
    row groups: memory stays bounded."""
    require_job(job)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ModuleNotFoundError as e:
        raise ImportError("Parquet output needs pyarrow: pip install 'vlmbatch[parquet]'") from e
    schema = pa.schema([("id", pa.string()), ("question_id", pa.string()),
                        ("question", pa.string()), ("answer", pa.string()),
                        ("p_yes", pa.float64()), ("margin", pa.float64()),
                        ("image_tokens", pa.int64()), ("error", pa.string()),
                        ("text", pa.string())])
    store = JobStore(Path(job) / STORE_FILE)
    n = 0
    try:
        with pq.ParquetWriter(str(path), schema) as writer:
            rows: list[dict] = []
            for line in store.results():
                rows.append({k: line.get(k) for k in RESULT_COLUMNS})
                if len(rows) == rows_per_group:
                    writer.write_table(pa.Table.from_pylist(rows, schema))
                    n += len(rows)
                    rows = []
            if rows or n == 0:
                writer.write_table(pa.Table.from_pylist(rows, schema))
                n += len(rows)
    finally:
        store.close()
    return n
