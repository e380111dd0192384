"""Batches: ``/v1/batches`` (OpenAI's Batch API over our job store), their records on disk,
and their routes (the files they read and write: ``files.py``).

One folder per batch, its record and its job::

    DATA/batches/ID/batch.json   the BatchRecord (status, times, file ids, errors)
    DATA/batches/ID/job/         a vlmbatch job folder (jobs/job.py): job.json + store.sqlite

A batch *is* a job: its requests are the job's items, answered and recorded exactly once
by the job store, so a server killed mid-batch resumes it when started again. Status::

    validating -> in_progress -> finalizing -> completed
        |              |-> cancelling -> cancelled      (partial output kept)
        '-> failed (the input file is not a valid batch: errors name its lines)

Every change of a record goes through ``BatchBook.update`` under one lock and is written
atomically (temporary file, then rename), so concurrent handlers and the engine thread
never lose one another's update. Creating a batch only records it (``validating``) and hands
it to the batch worker (``batch_worker.py``), which validates the input file into a job,
queues it for the engine thread and writes the output files. Every handler here is plain
file and SQLite work, run on FastAPI's worker threads.
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
from typing import Protocol

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from vlmbatch.jobs.folder import STORE_FILE, is_job
from vlmbatch.jobs.store import JobStore
from vlmbatch.server.errors import STRICT, bad_request
from vlmbatch.server.files import FileStore
from vlmbatch.serving.errors import APIError

CHAT, EMBEDDINGS = "/v1/chat/completions", "/v1/embeddings"  # the endpoints batches run


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


ENDPOINTS = (CHAT, EMBEDDINGS)


class BatchRequest(BaseModel):
    model_config = STRICT
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)


class Worker(Protocol):
    """What the routes hand batches to (``batch_worker.BatchWorker``)."""

    def validate(self, batch_id: str) -> None: ...

    def finalize(self, batch_id: str) -> None: ...


def _check(req: BatchRequest, files: FileStore, embeddings: bool) -> None:
    """A 400 (or 404 for an unknown input file) for a batch this server cannot run."""
    if req.endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint: {req.endpoint[:60]!r} is not supported; batches run "
                          f"{' or '.join(ENDPOINTS)}", "endpoint", "invalid_value")
    if req.endpoint == EMBEDDINGS and not embeddings:
        raise bad_request("endpoint: embedding batches are not available on this server: it "
                          "was started with --no-embeddings", "endpoint",
                          "embeddings_unavailable")
    if req.completion_window != "24h":
        raise bad_request("completion_window must be '24h'", "completion_window",
                          "invalid_value")
    for k, v in (req.metadata or {}).items():
        if len(k) > 64 or len(v) > 512:
            raise bad_request("metadata keys are at most 64 characters, values 512",
                              "metadata", "invalid_value")
    if files.get(req.input_file_id).purpose != "batch":
        raise bad_request(f"file {req.input_file_id} is not a batch input file (purpose "
                          "'batch')", "input_file_id", "invalid_value")


def batch_routes(book: BatchBook, files: FileStore, worker: Worker,
                 cancel: Callable[[str], bool], embeddings: bool) -> APIRouter:
    """``/v1/batches``: records in ``book``, input files from ``files``, new and finished
    batches handed to ``worker``; ``cancel``: stop a batch where it runs (False: nothing
    holds it); ``embeddings``: embedding batches accepted."""
    router = APIRouter()

    def shown(rec: BatchRecord) -> JSONResponse:
        return JSONResponse(rec.openai(book.counts(rec)))

    @router.post("/v1/batches")
    def create_batch(req: BatchRequest) -> JSONResponse:
        _check(req, files, embeddings)
        rec = book.create(req.endpoint, req.input_file_id, req.completion_window, req.metadata)
        worker.validate(rec.id)
        return shown(rec)

    @router.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str) -> JSONResponse:
        return shown(book.get(batch_id))

    @router.get("/v1/batches")
    def list_batches(after: str | None = Query(None, max_length=200),
                     limit: int = Query(20, ge=1, le=100)) -> JSONResponse:
        recs = book.all()  # newest first
        if after is not None:
            ids = [r.id for r in recs]
            if after not in ids:
                raise bad_request(f"after: no such batch {after[:80]!r}", "after",
                                  "invalid_value")
            recs = recs[ids.index(after) + 1:]
        page = recs[:limit]
        return JSONResponse({"object": "list", "data": [rec.openai(book.counts(rec))
                                                        for rec in page],
                             "first_id": page[0].id if page else None,
                             "last_id": page[-1].id if page else None,
                             "has_more": len(recs) > limit})

    @router.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> JSONResponse:
        def cancelling(r: BatchRecord) -> BatchRecord:
            if r.status not in ("validating", "in_progress"):
                raise APIError(409, f"batch {r.id} is {r.status}: only a validating or "
                               "in-progress batch can be cancelled", "batch_id",
                               "batch_not_cancellable")
            return r.at("cancelling")

        rec = book.update(batch_id, cancelling)
        if not cancel(batch_id) and rec.times.get("in_progress_at"):
            worker.finalize(batch_id)  # a job the engine thread does not hold
        return shown(rec)

    return router
