"""``/v1/files`` and ``/v1/batches``: OpenAI's Batch API over our job store.

Creating a batch only records it (``validating``) and hands it to the batch worker, which
validates the input file into a job and queues it for the engine thread (``batches.py``
has the life cycle, ``batch_worker.py`` the validation and the output files). Every handler
here is plain file and SQLite work, run on FastAPI's worker threads.
"""

from __future__ import annotations

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, Field

from vlmbatch.app.server.batch_worker import CHAT, EMBEDDINGS
from vlmbatch.app.server.batches import BatchRecord
from vlmbatch.app.server.chat import STRICT
from vlmbatch.app.server.errors import APIError, bad_request
from vlmbatch.app.server.state import ServerState

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
