"""Files: ``/v1/files`` as OpenAI has them (upload with ``expires_after``, list with
``purpose``/``limit``/``after``/``order``, retrieve, content, delete), on disk.

``DATA/files/ID`` holds a file's bytes, ``DATA/files/ID.json`` its ``FileRecord``. Both are
written under a temporary name and renamed into place, the record last, so a file either
exists whole or not at all (a server killed mid-upload leaves a ``.part`` that the next
start removes). Ids are ``file-`` + 32 hex digits (uploads) or ``file-<batch hex>-output`` /
``-errors`` (a batch's results, so finalizing twice writes the same file). An id that does
not match is unknown before any path is built from it.

A file past its ``expires_at`` is gone: not listed, a 404, its bytes removed when next
listed or asked for. A file that a batch still in progress reads (``validating`` to
``cancelling``: its input) cannot be deleted (409) and does not expire until that batch
ends. Listing is by creation time (``order``: ``desc``, the default, or ``asc``),
``after`` the last id of the previous page, as the official client's iterator sends it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import FileResponse, JSONResponse

from vlmbatch.server.errors import bad_request
from vlmbatch.serving.errors import APIError

FILE_ID = re.compile(r"^file-[0-9a-f]{32}(-output|-errors)?$")
PURPOSES = ("batch", "batch_output")
EXPIRES_S = (3600, 30 * 24 * 3600)  # OpenAI's bounds on expires_after.seconds


@dataclass(frozen=True)
class FileRecord:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None = None  # unix seconds; None: kept until deleted

    def openai(self) -> dict:
        return {**asdict(self), "object": "file", "status": "processed",
                "status_details": None}


class FileStore:
    """The files on disk; ``in_use(id)`` says whether a batch in progress reads a file
    (set by the server: deleting or expiring such a file waits for it)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.in_use: Callable[[str], bool] = lambda file_id: False
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

    def _commit(self, file_id: str, part: Path, filename: str, purpose: str,
                expires_s: int | None = None) -> FileRecord:
        data, meta = self._paths(file_id)
        now = int(time.time())
        rec = FileRecord(file_id, part.stat().st_size, now, filename, purpose,
                         None if expires_s is None else now + expires_s)
        os.replace(part, data)
        tmp = meta.with_name(f".{meta.name}.part")
        tmp.write_text(json.dumps(asdict(rec)))
        os.replace(tmp, meta)  # the record last: a file is listed only once whole
        return rec

    def create(self, src: IO[bytes], filename: str, purpose: str,
               expires_s: int | None = None) -> FileRecord:
        """An uploaded file, copied from ``src``; ``purpose`` must be ``batch``;
        ``expires_s``: seconds after its creation when it is deleted."""
        if purpose != "batch":
            raise APIError(400, f"purpose {purpose[:40]!r} is not supported: this server keeps "
                           "batch input files only (purpose=batch)", "purpose", "invalid_value")
        file_id = f"file-{uuid.uuid4().hex}"
        part = self.folder / f".{file_id}.part"
        with part.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        return self._commit(file_id, part, filename[:255] or "upload.jsonl", purpose,
                            expires_s)

    def write(self, file_id: str, filename: str, lines: Iterable[str]) -> FileRecord:
        """A batch's output or error file from its lines (the same id if written again)."""
        part = self.folder / f".{file_id}.part"
        with part.open("w", encoding="utf-8") as out:
            out.writelines(lines)
        return self._commit(file_id, part, filename, "batch_output")

    def _expired(self, rec: FileRecord) -> bool:
        """Past its time and read by no batch in progress: then removed, and True."""
        if rec.expires_at is None or rec.expires_at > time.time() or self.in_use(rec.id):
            return False
        self._remove(rec.id)
        return True

    def get(self, file_id: str) -> FileRecord:
        _, meta = self._paths(file_id)
        try:
            rec = FileRecord(**json.loads(meta.read_text()))
        except FileNotFoundError:
            raise self._missing(file_id) from None
        if self._expired(rec):
            raise self._missing(file_id)
        return rec

    def all(self) -> list[FileRecord]:
        """Every file not expired, oldest first (within a second by when its record was
        written, then by id)."""
        recs = []
        for meta in self.folder.glob("file-*.json"):
            try:
                recs.append((self.get(meta.name[:-len(".json")]), meta.stat().st_mtime_ns))
            except (APIError, FileNotFoundError):  # deleted or expired meanwhile
                continue
        return [r for r, _ in sorted(recs, key=lambda x: (x[0].created_at, x[1], x[0].id))]

    def path(self, file_id: str) -> Path:
        """The file's bytes on disk (404 unless it exists)."""
        self.get(file_id)
        return self._paths(file_id)[0]

    def _remove(self, file_id: str) -> bool:
        data, meta = self._paths(file_id)
        with self._lock:
            if not meta.exists():
                return False
            meta.unlink()
            data.unlink(missing_ok=True)
        return True

    def delete(self, file_id: str) -> dict:
        """Remove a file (404 if there is none; 409 while a batch in progress reads it)."""
        self.get(file_id)
        if self.in_use(file_id):
            raise APIError(409, f"file {file_id} is the input of a batch in progress; cancel "
                           "the batch or wait for it to end", "file_id", "file_in_use")
        if not self._remove(file_id):
            raise self._missing(file_id)
        return {"id": file_id, "object": "file", "deleted": True}


def page_of(recs: list[FileRecord], after: str | None, limit: int) -> dict:
    """One page of a listing in its order: the records after ``after`` (400 if it is not
    one of them), at most ``limit``."""
    if after is not None:
        ids = [r.id for r in recs]
        if after not in ids:
            raise bad_request(f"after: no such file {after[:80]!r}", "after", "invalid_value")
        recs = recs[ids.index(after) + 1:]
    page = recs[:limit]
    return {"object": "list", "data": [r.openai() for r in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None, "has_more": len(recs) > limit}


def file_routes(files: FileStore) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/files")
    def create_file(file: UploadFile = File(), purpose: str = Form(),
                    anchor: str | None = Form(None, alias="expires_after[anchor]"),
                    seconds: int | None = Form(None, alias="expires_after[seconds]")
                    ) -> JSONResponse:
        if (anchor is None) != (seconds is None) or anchor not in (None, "created_at"):
            raise bad_request("expires_after needs anchor 'created_at' and seconds",
                              "expires_after", "invalid_value")
        if seconds is not None and not EXPIRES_S[0] <= seconds <= EXPIRES_S[1]:
            raise bad_request(f"expires_after.seconds must be in {EXPIRES_S[0]}.."
                              f"{EXPIRES_S[1]}", "expires_after", "invalid_value")
        return JSONResponse(files.create(file.file, file.filename or "", purpose,
                                         seconds).openai())

    @router.get("/v1/files")
    def list_files(purpose: str | None = Query(None, max_length=40),
                   limit: int = Query(10000, ge=1, le=10000),
                   after: str | None = Query(None, max_length=200),
                   order: str = Query("desc", pattern="^(asc|desc)$")) -> JSONResponse:
        recs = [r for r in files.all() if purpose is None or r.purpose == purpose]
        return JSONResponse(page_of(recs[::-1] if order == "desc" else recs, after, limit))

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
