"""``/v1/files`` on disk: ``DATA/files/ID`` holds a file's bytes, ``DATA/files/ID.json`` its
``FileRecord``. Both are written under a temporary name and renamed into place, the record
last, so a file either exists whole or not at all (a server killed mid-upload leaves a
``.part`` that the next start removes).

Ids are ``file-`` + 32 hex digits (uploads) or ``file-<batch hex>-output`` / ``-errors``
(a batch's results, so finalizing twice writes the same file). An id that does not match
is unknown before any path is built from it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from vlmbatch.app.server.errors import APIError

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
