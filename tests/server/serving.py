"""The server tests' machinery, once: a ``vlmbatch serve`` subprocess on a free port of
127.0.0.1 (optionally with fault hooks, ``tests/faults.py``) and the fixture factory that
starts one per module (``server_fixture``), waiting for a batch (``wait_batch``), killing a
server mid-batch and resuming it (``kill_mid_batch``, ``resume``), the engine processes of
a server (``engine_pids``), images as data: URLs and OpenAI batch lines. Every wait goes
through ``tests/waiting.py``'s ``wait_until``. The session's shared server (one start for
the modules that neither kill nor reconfigure theirs) is ``conftest.py``'s ``standard``."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.loopback import free_port
from tests.waiting import wait_until
from vlmbatch.jobs.folder import STORE_FILE
from vlmbatch.jobs.store import JobStore

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "examples" / "images"
KEY = "test-key-123"
DONE = ("completed", "failed", "cancelled")
BATCH_S = 300.0  # the longest any batch of these tests may take (a hang fails, not a slow row)


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
    """``vlmbatch serve`` in a subprocess; ``faults``: hooks for it (``tests/faults.py``);
    ``command``/``cwd``: how it is started (default ``python -m vlmbatch`` from the
    repository's root)."""

    def __init__(self, data_dir: Path, *args: str, faults: dict | None = None,
                 key: str | None = KEY, command: list[str] | None = None,
                 cwd: Path = ROOT) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = command or ([sys.executable, "-m", "vlmbatch"] if faults is None
                          else [sys.executable, "-m", "tests.faults", json.dumps(faults), "--"])
        auth = ["--api-key", key] if key else []
        self.log = Path(data_dir).with_suffix(".log")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log.open("ab")
        self.proc = subprocess.Popen(
            [*cmd, "serve", "--port", str(self.port), "--data-dir", str(data_dir),
             "--threads", "1", *auth, *args],
            cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "OPENCV_LOG_LEVEL": "SILENT"})
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def openai(self):  # noqa: ANN201
        """The official client on this server (our key, no retries: a failure shows)."""
        import openai

        return openai.OpenAI(api_key=KEY, base_url=self.url + "/v1", max_retries=0)

    def wait_ready(self, timeout: float = 90) -> Server:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.output()}")
            return httpx.get(self.url + "/health", timeout=1).status_code == 200

        wait_until(healthy, timeout, f"the server on {self.url} answering /health "
                   f"({self.log})", interval=0.2, retry_on=(httpx.HTTPError,))
        return self

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


def server_fixture(*args: str, faults: dict | None = None, ready_s: float = 90,
                   scope: str = "module") -> Callable[..., Iterator[Server]]:
    """A pytest fixture (``server = server_fixture(...)`` in a test module): one
    ``vlmbatch serve ARGS`` for the module's tests, stopped (and checked to stop cleanly)
    after them."""

    @pytest.fixture(scope=scope)  # type: ignore[call-overload]
    def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
        s = Server(tmp_path_factory.mktemp("serve") / "data", *args,
                   faults=faults).wait_ready(ready_s)
        yield s
        assert s.stop() in (0, 143), s.output()

    return server


def wait_batch(client: Any, batch_id: str, done: int | None = None,
               timeout: float = BATCH_S) -> Any:
    """The batch (the official client's ``Batch``) once it has finished, or (``done``) once
    it has at least ``done`` requests completed; polled with the client, as a user's loop
    would."""
    def reached() -> Any:
        b = client.batches.retrieve(batch_id)
        finished = b.status in DONE
        return b if finished or (done is not None and b.request_counts.completed >= done) \
            else None

    return wait_until(reached, timeout, f"batch {batch_id} "
                      + ("finished" if done is None else f"with {done} requests done"))


def in_engines(server: Server) -> int:
    """Chat requests sent to the server's engine processes and not answered yet (its
    ``/metrics``, ``vlmbatch_queue_depth{queue="interactive"}`` summed over engines)."""
    page = httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text
    return int(sum(s.value for fam in text_string_to_metric_families(page)
                   for s in fam.samples if s.name == "vlmbatch_queue_depth"
                   and s.labels.get("queue") == "interactive"))


def upload(client: Any, text: str, **extra: object):  # noqa: ANN201
    """``text`` as a batch input file (``extra``: ``files.create``'s other arguments)."""
    return client.files.create(file=("in.jsonl", text.encode()), purpose="batch", **extra)


def create_batch(client: Any, text: str, endpoint: str = "/v1/chat/completions"):  # noqa: ANN201
    return client.batches.create(input_file_id=upload(client, text).id, endpoint=endpoint,
                                 completion_window="24h")


def pending(job: Path) -> int:
    """Items of the job not yet recorded."""
    store = JobStore(job / STORE_FILE)
    try:
        return store.counts().pending
    finally:
        store.close()


def recorded(job: Path) -> list[tuple[str, list]]:
    """(item spec, its results) of every item the job's store has recorded."""
    store = JobStore(job / STORE_FILE)
    try:
        return [(spec, res) for spec, res in store.recorded_items()]
    finally:
        store.close()


def kill_mid_batch(data: Path, *args: str, text: str | None = None,
                   batch_id: str | None = None, done: int = 4, faults: dict | None = None,
                   endpoint: str = "/v1/chat/completions") -> str:
    """Start a server on ``data``, submit ``text`` as a new batch (or let it resume
    ``batch_id``), and SIGKILL it (no chance to mark anything) once the batch has ``done``
    requests answered; the batch's id. Its job has items still pending (checked)."""
    k = Server(data, *args, faults=faults).wait_ready()
    try:
        client = k.openai()
        if batch_id is None:
            assert text is not None
            batch_id = str(create_batch(client, text, endpoint).id)
        wait_batch(client, batch_id, done=done)
    finally:
        k.kill()
    assert pending(data / "batches" / batch_id / "job") > 0
    return batch_id


def resume(data: Path, batch_id: str, *args: str, faults: dict | None = None,
           then: Callable[[Server], object] | None = None) -> tuple[Any, list[str]]:
    """Start a server on ``data`` again: it resumes the batch; (the finished batch, its
    output lines). ``then(server)`` runs before the server is stopped with SIGTERM (which
    must end it with 143)."""
    r = Server(data, *args, faults=faults).wait_ready()
    try:
        client = r.openai()
        b = wait_batch(client, batch_id)
        lines = client.files.content(b.output_file_id).text.splitlines() \
            if b.output_file_id else []
        if then is not None:
            then(r)
    finally:
        rc = r.stop()
    assert rc == 143, r.output()
    return b, lines


def engine_pids(server: Server) -> list[int]:
    """The server's engine processes (its children running ``engine_process``, started by
    any of its threads: each thread's children are listed under that thread)."""
    children = []
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        try:
            children += (task / "children").read_text().split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return [int(c) for c in children
            if b"vlmbatch.serving.engine_process" in Path(f"/proc/{c}/cmdline").read_bytes()]
