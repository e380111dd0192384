"""Helpers for the server tests: a ``vlmbatch serve`` subprocess on a free port of
127.0.0.1 (optionally with fault hooks, ``tests/faults.py``), images as data: URLs, and
OpenAI batch lines."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
IMAGES = ROOT / "examples" / "images"
KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def chat_body(url: str, question: str, **extra: object) -> dict:
    return {"model": "vlmbatch", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": question}]}], **extra}


def batch_lines(requests: list[tuple[str, str, str]]) -> str:
    """(custom_id, image URL, question) -> an OpenAI batch input file's text."""
    return "".join(json.dumps({"custom_id": cid, "method": "POST",
                               "url": "/v1/chat/completions",
                               "body": chat_body(url, q, max_tokens=1)}) + "\n"
                   for cid, url, q in requests)


class Server:
    """``vlmbatch serve`` in a subprocess; ``faults``: hooks for it (``tests/faults.py``)."""

    def __init__(self, data_dir: Path, *args: str, faults: dict | None = None,
                 key: str | None = KEY) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = (["-m", "vlmbatch"] if faults is None
               else ["-m", "tests.faults", json.dumps(faults), "--"])
        auth = ["--api-key", key] if key else []
        self.log = Path(data_dir).with_suffix(".log")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, *cmd, "serve", "--port", str(self.port), "--data-dir",
             str(data_dir), "--threads", "1", *auth, *args],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "OPENCV_LOG_LEVEL": "SILENT"})
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def openai(self):  # noqa: ANN201
        """The official client on this server (our key, no retries: a failure shows)."""
        import openai

        return openai.OpenAI(api_key=KEY, base_url=self.url + "/v1", max_retries=0)

    def wait_ready(self, timeout: float = 90) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout}s: {self.output()}")

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log.read_text(errors="replace")[-3000:]

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._log.close()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then wait (SIGKILL if it does not end in ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
