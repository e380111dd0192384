"""A real Label Studio for tests, on 127.0.0.1: ``label-studio`` 1.23 from PyPI in a venv of
its own (its pins clash with ours: ``pytz<2023``, ``pyarrow<25``, ``openai<2``, and its SDK's
``opencv-python-headless<4.13``), made on first use under ``~/.cache/vlmbatch`` (or
``$VLMBATCH_LABEL_STUDIO_VENV``) and reused when present; started headless by the test with
an admin user, a legacy API token and local-files serving under a document root, and stopped
when the test ends. Nothing leaves the loopback interface."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.loopback import free_port
from tests.waiting import wait_until

VERSION = "1.23.2"
VENV = Path(os.environ.get("VLMBATCH_LABEL_STUDIO_VENV",
                           Path.home() / ".cache" / "vlmbatch" / f"label-studio-{VERSION}"))
TOKEN = "0123456789abcdef0123456789abcdef01234567"  # the admin's legacy token
START_S = 600  # a first start migrates a fresh SQLite database: ~2 min on a loaded machine


def venv() -> Path:
    """The ``label-studio`` executable, installed into its venv first if absent."""
    exe = VENV / "bin" / "label-studio"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", f"label-studio=={VERSION}"],
                       check=True)
    return exe


@dataclass(frozen=True)
class LabelStudio:
    """A running Label Studio: its URL and calls to its API as its admin."""
    url: str
    token: str = TOKEN

    def call(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(self.url + path, method=method,
                                     data=None if body is None else json.dumps(body).encode())
        req.add_header("Authorization", f"Token {self.token}")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=60) as r:
            data = r.read()
        return json.loads(data) if data and data.lstrip()[:1] in (b"[", b"{") else data


def _healthy(url: str) -> bool:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return r.status == 200


@contextmanager
def label_studio(data_dir: Path, document_root: Path) -> Iterator[LabelStudio]:
    """Label Studio serving ``data_dir``'s database on a free loopback port, local files
    from under ``document_root``."""
    port = free_port()
    env = {**os.environ, "LABEL_STUDIO_USERNAME": "reviewer@example.com",
           "LABEL_STUDIO_PASSWORD": "a-long-test-password", "LABEL_STUDIO_USER_TOKEN": TOKEN,
           "LABEL_STUDIO_ENABLE_LEGACY_API_TOKEN": "true",
           "LOCAL_FILES_SERVING_ENABLED": "true",
           "LOCAL_FILES_DOCUMENT_ROOT": str(document_root), "SENTRY_DSN": "",
           "FRONTEND_SENTRY_DSN": "", "COLLECT_ANALYTICS": "false"}
    log = (data_dir / "label-studio.log").open("wb")
    proc = subprocess.Popen([str(venv()), "start", "--no-browser", "--internal-host",
                             "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir)],
                            env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or _healthy(url), START_S,
                   "Label Studio answering /health", interval=1.0,
                   retry_on=(urllib.error.URLError, ConnectionError, OSError))
        if proc.poll() is not None:
            raise AssertionError(f"label-studio exited {proc.returncode}: "
                                 f"{(data_dir / 'label-studio.log').read_text()[-2000:]}")
        yield LabelStudio(url)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
