"""A running Label Studio, through its HTTP API: the project created from our labelling
configuration or reused by title, tasks imported into it, its annotations exported as JSON.

Plain HTTP (the standard library's ``urllib``), not ``label-studio-sdk``: the SDK 2.1 pins
``opencv-python-headless<4.13`` (and ``nltk``, ``datamodel-code-generator``...), which would
downgrade the OpenCV vlmbatch resizes with, and the four calls used here are stable parts of
Label Studio's API (``/api/projects``, ``/api/projects/ID/import``, ``/api/projects/ID/export``).

Access tokens: a legacy token is sent as ``Authorization: Token KEY``; a personal access
token (a JWT refresh token) is first exchanged at ``/api/token/refresh`` for an access token,
sent as ``Bearer``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from vlmbatch.pipeline.questions import ManifestError

TIMEOUT = 120.0  # seconds per request: an import of many tasks is one request


@dataclass(frozen=True)
class Studio:
    """Where a Label Studio runs, the token to use, and the project (its title or id)."""
    url: str
    token: str | None
    project: str | None


class Api:
    """The few calls this module makes, with the token's header; errors as ManifestError
    naming the call and Label Studio's answer."""

    def __init__(self, studio: Studio) -> None:
        if not studio.token:
            raise ManifestError(f"--url {studio.url}: give --token or set LABEL_STUDIO_API_KEY "
                                "(Label Studio: Account & Settings, Access Token)")
        self.base = studio.url.rstrip("/")
        self.auth = f"Token {studio.token}"
        if studio.token.count(".") == 2:  # a JWT: a personal access (refresh) token
            access = self.call("POST", "/api/token/refresh", {"refresh": studio.token}, auth=False)
            self.auth = f"Bearer {access['access']}"

    def call(self, method: str, path: str, body: Any = None, auth: bool = True) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if auth:
            req.add_header("Authorization", self.auth)
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            text = e.read()[:300].decode(errors="replace")
            raise ManifestError(f"Label Studio at {self.base}: {method} {path}: HTTP {e.code} "
                                f"{text}") from None
        except urllib.error.URLError as e:
            raise ManifestError(f"Label Studio at {self.base} cannot be reached ({e.reason}); "
                                "is it running, and is --url right?") from None

    def find(self, project: str) -> dict[str, Any] | None:
        """The project of that id (digits) or title; None when there is none."""
        page, listed = 1, 0
        while True:
            got = self.call("GET", f"/api/projects?page={page}&page_size=100")
            rows = got["results"] if isinstance(got, dict) else got
            for p in rows:
                if str(p["id"]) == project or p["title"] == project:
                    return p
            listed += len(rows)
            if not isinstance(got, dict) or not rows or listed >= got.get("count", 0):
                return None
            page += 1


def push_tasks(studio: Studio, title: str, config: str, tasks: list[dict[str, Any]],
               folders: Iterable[Path] = ()) -> tuple[int, str]:
    """Import ``tasks`` into the project ``title`` (created with ``config`` when there is
    none of that title, its configuration replaced by ``config`` otherwise), ``folders``
    (of local images) connected to it as local-files storages; (id, title)."""
    api = Api(studio)
    p = api.find(title)
    if p is None:
        p = api.call("POST", "/api/projects", {"title": title, "label_config": config})
    elif (p.get("label_config") or "").strip() != config.strip():
        api.call("PATCH", f"/api/projects/{p['id']}", {"label_config": config})
    _connect(api, int(p["id"]), folders)
    api.call("POST", f"/api/projects/{p['id']}/import", tasks)
    return int(p["id"]), str(p["title"])


def outermost(folders: Iterable[Path]) -> list[Path]:
    """The folders not inside another of them, sorted."""
    out: list[Path] = []
    for f in sorted(set(folders)):
        if not any(o == f or o in f.parents for o in out):
            out.append(f)
    return out


def _connect(api: Api, project: int, folders: Iterable[Path]) -> None:
    """A local-files storage per folder (not synced: it only lets Label Studio serve the
    files under it to this project's users), unless one already covers it."""
    have = [Path(s["path"]) for s in api.call("GET", f"/api/storages/localfiles?project="
                                              f"{project}")]
    for f in outermost(folders):
        if not any(h == f or h in f.parents for h in have):
            api.call("POST", "/api/storages/localfiles", {
                "project": project, "path": str(f), "use_blob_urls": False,
                "title": f"vlmbatch {f.name}"})


def pull_export(studio: Studio) -> list[dict[str, Any]]:
    """The project's tasks with their annotations, as Label Studio's JSON export."""
    api = Api(studio)
    project = str(studio.project)
    p = api.find(project)
    if p is None:
        raise ManifestError(f"--project {project}: no such project at {studio.url}")
    got = api.call("GET", f"/api/projects/{p['id']}/export?exportType={quote('JSON')}")
    if not isinstance(got, list):
        raise ManifestError(f"Label Studio at {studio.url}: the export of project {p['id']} is "
                            "not a list of tasks")
    return got
