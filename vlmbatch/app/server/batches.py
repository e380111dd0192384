"""Batches on disk: one folder per batch, its record and its job::

    DATA/batches/ID/batch.json   the BatchRecord (status, times, file ids, errors)
    DATA/batches/ID/job/         a vlmbatch job folder (jobs/job.py): job.json + store.sqlite

A batch *is* a job: its requests are the job's items, answered and recorded exactly once
by the job store, so a server killed mid-batch resumes it when started again. Status::

    validating -> in_progress -> finalizing -> completed
        |              |-> cancelling -> cancelled      (partial output kept)
        '-> failed (the input file is not a valid batch: errors name its lines)

Every change of a record goes through ``BatchBook.update`` under one lock and is written
atomically (temporary file, then rename), so concurrent handlers and the engine thread
never lose one another's update.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vlmbatch.app.server.errors import APIError
from vlmbatch.jobs.folder import STORE_FILE, is_job
from vlmbatch.jobs.store import JobStore

BATCH_ID = re.compile(r"^batch_[0-9a-f]{32}$")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
WINDOW_S = 24 * 3600  # completion_window "24h": reported, not enforced


@dataclass(frozen=True)
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: float
    status: str = "validating"
    metadata: dict[str, str] | None = None
    errors: list[dict] = field(default_factory=list)  # [{code, message, param, line}]
    output_file_id: str | None = None
    error_file_id: str | None = None
    counts: dict[str, int] | None = None  # request_counts, frozen once finished
    times: dict[str, float] = field(default_factory=dict)  # "in_progress_at": t, ...

    def at(self, status: str, **changes: object) -> BatchRecord:
        """This record moved to ``status`` now (its ``<status>_at`` time set)."""
        times = {**self.times, f"{status}_at": time.time()}
        return dataclasses.replace(self, status=status, times=times, **changes)  # type: ignore[arg-type]

    def openai(self, counts: dict[str, int]) -> dict:
        def t(name: str) -> int | None:
            v = self.times.get(name)
            return int(v) if v is not None else None

        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": ({"object": "list", "data": self.errors} if self.errors else None),
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, "created_at": int(self.created_at),
            "in_progress_at": t("in_progress_at"),
            "expires_at": int(self.created_at) + WINDOW_S, "finalizing_at": t("finalizing_at"),
            "completed_at": t("completed_at"), "failed_at": t("failed_at"),
            "expired_at": None, "cancelling_at": t("cancelling_at"),
            "cancelled_at": t("cancelled_at"), "request_counts": counts,
            "metadata": self.metadata}


class BatchBook:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def folder_of(self, batch_id: str) -> Path:
        if not BATCH_ID.match(batch_id):
            raise _missing(batch_id)
        return self.folder / batch_id

    def job_of(self, batch_id: str) -> Path:
        return self.folder_of(batch_id) / "job"

    def create(self, endpoint: str, input_file_id: str, window: str,
               metadata: dict[str, str] | None) -> BatchRecord:
        rec = BatchRecord(f"batch_{uuid.uuid4().hex}", endpoint, input_file_id, window,
                          time.time(), metadata=metadata)
        self.folder_of(rec.id).mkdir()
        with self._lock:
            self._write(rec)
        return rec

    def _write(self, rec: BatchRecord) -> None:
        path = self.folder_of(rec.id) / "batch.json"
        tmp = path.with_name(".batch.json.part")
        tmp.write_text(json.dumps(asdict(rec)))
        os.replace(tmp, path)

    def get(self, batch_id: str) -> BatchRecord:
        try:
            text = (self.folder_of(batch_id) / "batch.json").read_text()
        except FileNotFoundError:
            raise _missing(batch_id) from None
        return BatchRecord(**json.loads(text))

    def update(self, batch_id: str, change: Callable[[BatchRecord], BatchRecord]
               ) -> BatchRecord:
        """Apply ``change`` to the stored record and store the result, atomically."""
        with self._lock:
            rec = change(self.get(batch_id))
            self._write(rec)
            return rec

    def all(self) -> list[BatchRecord]:
        """Every batch, newest first (ties by id)."""
        recs = []
        for d in self.folder.iterdir():
            if BATCH_ID.match(d.name) and (d / "batch.json").is_file():
                recs.append(self.get(d.name))
        return sorted(recs, key=lambda r: (-r.created_at, r.id))

    def counts(self, rec: BatchRecord) -> dict[str, int]:
        """``request_counts``: one request per job item; from the job store while the batch
        runs, frozen in the record once it has finished."""
        if rec.counts is not None:
            return rec.counts
        job = self.job_of(rec.id)
        if not is_job(job):
            return {"total": 0, "completed": 0, "failed": 0}
        return job_counts(job)


def job_counts(job: Path) -> dict[str, int]:
    store = JobStore(job / STORE_FILE)
    try:
        c = store.counts()  # one item per request (an embeddings request: all its strings)
        return {"total": c.total, "completed": c.done, "failed": c.failed}
    finally:
        store.close()


def _missing(batch_id: str) -> APIError:
    shown = batch_id if len(batch_id) <= 80 else batch_id[:80] + "..."
    return APIError(404, f"no such batch: {shown!r}", "batch_id", "batch_not_found")
