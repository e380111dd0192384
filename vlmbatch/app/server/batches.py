"""Files and batches: ``/v1/files`` and ``/v1/batches`` (OpenAI's Batch API over our job
store), their records on disk, and their routes.

Files: ``DATA/files/ID`` holds a file's bytes, ``DATA/files/ID.json`` its ``FileRecord``. Both
are written under a temporary name and renamed into place, the record last, so a file either
exists whole or not at all (a server killed mid-upload leaves a ``.part`` that the next start
removes). Ids are ``file-`` + 32 hex digits (uploads) or ``file-<batch hex>-output`` /
``-errors`` (a batch's results, so finalizing twice writes the same file). An id that does
not match is unknown before any path is built from it.

Batches: one folder per batch, its record and its job::

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
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, Field

from vlmbatch.app.server.chat import STRICT
from vlmbatch.app.server.errors import APIError, bad_request
from vlmbatch.jobs.folder import STORE_FILE, is_job
from vlmbatch.jobs.store import JobStore

if TYPE_CHECKING:
    from vlmbatch.app.server.serve import ServerState

CHAT, EMBEDDINGS = "/v1/chat/completions", "/v1/embeddings"  # the endpoints batches run


FILE_ID = re.compile(r"^file-[0-9a-f]{32}(-output|-errors)?$")
PURPOSES = ("batch", "batch_output")


@dataclass(frozen=True)
class FileRecord:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str

    def openai(self) -> dict:
        return {**asdict(self), "object": "file", "status": "processed",
                "status_details": None, "expires_at": None}


class FileStore:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        for part in self.folder.glob(".*.part"):  # uploads cut short by a kill
            part.unlink(missing_ok=True)

    def _paths(self, file_id: str) -> tuple[Path, Path]:
        if not FILE_ID.match(file_id):
            raise self._missing(file_id)
        return self.folder / file_id, self.folder / f"{file_id}.json"

    @staticmethod
    def _missing(file_id: str) -> APIError:
        shown = file_id if len(file_id) <= 80 else file_id[:80] + "..."
        return APIError(404, f"no such file: {shown!r}", "file_id", "file_not_found")

    def _commit(self, file_id: str, part: Path, filename: str, purpose: str) -> FileRecord:
        data, meta = self._paths(file_id)
        rec = FileRecord(file_id, part.stat().st_size, int(time.time()), filename, purpose)
        os.replace(part, data)
        tmp = meta.with_name(f".{meta.name}.part")
        tmp.write_text(json.dumps(asdict(rec)))
        os.replace(tmp, meta)  # the record last: a file is listed only once whole
        return rec

    def create(self, src: IO[bytes], filename: str, purpose: str) -> FileRecord:
        """An uploaded file, copied from ``src``; ``purpose`` must be ``batch``."""
        if purpose != "batch":
            raise APIError(400, f"purpose {purpose[:40]!r} is not supported: this server keeps "
                           "batch input files only (purpose=batch)", "purpose", "invalid_value")
        file_id = f"file-{uuid.uuid4().hex}"
        part = self.folder / f".{file_id}.part"
        with part.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        return self._commit(file_id, part, filename[:255] or "upload.jsonl", purpose)

    def write(self, file_id: str, filename: str, lines: Iterable[str]) -> FileRecord:
        """A batch's output or error file from its lines (the same id if written again)."""
        part = self.folder / f".{file_id}.part"
        with part.open("w", encoding="utf-8") as out:
            out.writelines(lines)
        return self._commit(file_id, part, filename, "batch_output")

    def get(self, file_id: str) -> FileRecord:
        _, meta = self._paths(file_id)
        try:
            return FileRecord(**json.loads(meta.read_text()))
        except FileNotFoundError:
            raise self._missing(file_id) from None

    def path(self, file_id: str) -> Path:
        """The file's bytes on disk (404 unless it exists)."""
        self.get(file_id)
        return self._paths(file_id)[0]

    def delete(self, file_id: str) -> dict:
        data, meta = self._paths(file_id)
        with self._lock:
            if not meta.exists():
                raise self._missing(file_id)
            meta.unlink()
            data.unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}




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


def _check(req: BatchRequest, state: ServerState) -> None:
    """A 400 (or 404 for an unknown input file) for a batch this server cannot run."""
    if req.endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint: {req.endpoint[:60]!r} is not supported; batches run "
                          f"{' or '.join(ENDPOINTS)}", "endpoint", "invalid_value")
    if req.endpoint == EMBEDDINGS and state.embedder is None:
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
    if state.files.get(req.input_file_id).purpose != "batch":
        raise bad_request(f"file {req.input_file_id} is not a batch input file (purpose "
                          "'batch')", "input_file_id", "invalid_value")


def file_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    files = state.files

    @router.post("/v1/files")
    def create_file(file: UploadFile = File(), purpose: str = Form()) -> JSONResponse:
        return JSONResponse(files.create(file.file, file.filename or "", purpose).openai())

    @router.get("/v1/files/{file_id}")
    def get_file(file_id: str) -> JSONResponse:
        return JSONResponse(files.get(file_id).openai())

    @router.get("/v1/files/{file_id}/content")
    def file_content(file_id: str) -> FileResponse:
        return FileResponse(files.path(file_id), media_type="application/octet-stream",
                            filename=files.get(file_id).filename)

    @router.delete("/v1/files/{file_id}")
    def delete_file(file_id: str) -> JSONResponse:
        return JSONResponse(files.delete(file_id))

    return router


def batch_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    book = state.book

    def shown(rec: BatchRecord) -> JSONResponse:
        return JSONResponse(rec.openai(book.counts(rec)))

    @router.post("/v1/batches")
    def create_batch(req: BatchRequest) -> JSONResponse:
        _check(req, state)
        rec = book.create(req.endpoint, req.input_file_id, req.completion_window, req.metadata)
        state.worker.validate(rec.id)
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
        def cancel(r: BatchRecord) -> BatchRecord:
            if r.status not in ("validating", "in_progress"):
                raise APIError(409, f"batch {r.id} is {r.status}: only a validating or "
                               "in-progress batch can be cancelled", "batch_id",
                               "batch_not_cancellable")
            return r.at("cancelling")

        rec = book.update(batch_id, cancel)
        if not state.scheduler.cancel_batch(batch_id) and rec.times.get("in_progress_at"):
            state.worker.finalize(batch_id)  # a job the engine thread does not hold
        return shown(rec)

    return router
