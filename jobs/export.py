"""A job's results out of its store: JSONL (ours or OpenAI batch output lines), CSV or Parquet.

All stream the store in manifest order, so memory stays bounded whatever the job's size.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import IO

from jobs.job import STORE_FILE, read_job_file, require_job
from jobs.openai_batch import write_lines
from jobs.store import JobStore


def export_results(job: Path, out: IO[str]) -> int:
    require_job(job)
    openai = read_job_file(Path(job)).get("format") == "openai"
    store = JobStore(Path(job) / STORE_FILE)
    try:
        n = 0
        for line in store.results():
            out.write(write_lines([line], openai))
            n += 1
        return n
    finally:
        store.close()


# The columns of a result line, in order (CSV and Parquet); ``text`` only with
# --max-new-tokens, else empty (CSV) or null (Parquet).
RESULT_COLUMNS = ("id", "question_id", "question", "answer", "p_yes", "margin",
                  "image_tokens", "error", "text")


def export_csv(job: Path, out: IO[str]) -> int:
    """Every recorded result line as a CSV row (header ``RESULT_COLUMNS``; None -> empty
    field), for spreadsheets; ``out`` must be opened with ``newline=""``."""
    require_job(job)
    store = JobStore(Path(job) / STORE_FILE)
    try:
        writer = csv.DictWriter(out, RESULT_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        n = 0
        for line in store.results():
            writer.writerow(line)
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
