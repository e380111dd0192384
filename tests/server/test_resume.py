"""A batch is a job: a server stopped by SIGTERM finishes the request in flight and leaves
the batch resumable; a server killed with SIGKILL mid-batch and started again on the same
data folder completes it, every request answered exactly once, lines equal to
``vlmbatch run``'s (``serving.py``: ``kill_mid_batch``, ``resume``)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from tests.server.serving import (
    IMAGES,
    Server,
    batch_lines,
    chat_body,
    create_batch,
    data_url,
    in_engines,
    kill_mid_batch,
    pending,
    recorded,
    resume,
    wait_batch,
)
from tests.waiting import wait_until
from vlmbatch.cli.commands import EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.jobs.folder import STORE_FILE
from vlmbatch.jobs.store import JobStore

N = 30
SLOW = {"group_delay": 0.25}  # each batch group of 2 then takes >= 0.25 s
# and each chat engine call 1 s more: a request seen in the engine at SIGTERM is in flight
SLOWER = {**SLOW, "slow_score": 1.0}
QS = ("Is there a red shape?", "Is there a circle?")


def requests(n: int, images: int) -> list[tuple[str, str, str]]:
    return [(f"k{i}", data_url(IMAGES / f"scene_{i % images:02d}.png"), QS[i % 2])
            for i in range(n)]


def in_flight(server: Server) -> tuple[threading.Thread, list[httpx.Response]]:
    """A chat request in the engine (its call slowed by 1 s; waited for until the server
    counts it there): the thread that waits for its answer, and where the answer goes."""
    got: list[httpx.Response] = []
    body = chat_body(data_url(IMAGES / "scene_07.png"), QS[0])

    def send() -> None:
        with server.client() as c:
            got.append(c.post("/v1/chat/completions", json=body))

    t = threading.Thread(target=send)
    t.start()
    wait_until(lambda: got or in_engines(server) > 0, 30, "the chat request in the engine")
    assert not got, got  # answered before it was seen in the engine: the call is not slowed
    return t, got


def recorded_once(job: Path, reqs: list[tuple[str, str, str]]) -> None:
    ids = [ln["id"] for _, res in recorded(job) for ln in res]
    assert sorted(ids) == sorted(cid for cid, _, _ in reqs)  # each once in the store


def equals_run(lines: list[str], reqs: list[tuple[str, str, str]], tmp: Path) -> None:
    (tmp / "in.jsonl").write_text(batch_lines(reqs))
    out = tmp / "run.jsonl"
    assert main(["run", str(tmp / "in.jsonl"), "-o", str(out), "--no-progress"]) == EXIT_OK
    assert lines == out.read_text().splitlines()  # = vlmbatch run, line for line


def test_sigkill_mid_batch_resumed_once_then_sigterm_answers_the_request_in_flight(
        tmp_path: Path) -> None:
    """The slow test below, trimmed for CI (two server starts, 10 requests): a server
    SIGKILLed mid-batch; the next one on the same data folder completes the batch, every
    request answered once, lines equal to ``vlmbatch run``'s; then a chat request in flight
    (its engine call slowed by 1 s) when SIGTERM arrives is answered, and the server exits
    143."""
    data, reqs = tmp_path / "data", requests(10, 6)
    batch_id = kill_mid_batch(data, "--images-per-batch", "2", text=batch_lines(reqs),
                              faults=SLOW)
    job = data / "batches" / batch_id / "job"
    assert pending(job) < len(reqs)
    flight: list = []
    out, lines = resume(data, batch_id, "--images-per-batch", "2",
                        faults={"slow_score": 1.0}, then=lambda r: flight.extend(in_flight(r)))
    t, got = flight
    t.join()
    assert got and got[0].status_code == 200, got  # the request in flight was answered
    assert out.status == "completed", out
    c = out.request_counts
    assert (c.total, c.completed, c.failed) == (10, 10, 0)
    recorded_once(job, reqs)
    equals_run(lines, reqs, tmp_path)


def sigterm_with_a_request_in_flight(data: Path, text: str) -> str:
    """Start a batch, send a chat request, SIGTERM while it is in the engine: the request
    is answered, the server exits 143, the batch stays in progress, its job interrupted."""
    a = Server(data, "--images-per-batch", "2", faults=SLOWER).wait_ready()
    client = a.openai()
    batch_id = str(create_batch(client, text).id)
    wait_batch(client, batch_id, done=4, timeout=90)
    t, got = in_flight(a)
    rc = a.stop()
    t.join()
    assert rc == 143, a.output()
    assert got and got[0].status_code == 200, got  # the request in flight was answered
    record = json.loads((data / "batches" / batch_id / "batch.json").read_text())
    store = JobStore(data / "batches" / batch_id / "job" / STORE_FILE)
    assert record["status"] == "in_progress" and store.get("status") == "interrupted"
    store.close()
    return batch_id


@pytest.mark.slow  # three server starts, ~25 s on 2 cores
def test_sigterm_then_sigkill_then_the_batch_completes_exactly_once(tmp_path: Path) -> None:
    data, reqs = tmp_path / "data", requests(N, 12)
    batch_id = sigterm_with_a_request_in_flight(data, batch_lines(reqs))
    job = data / "batches" / batch_id / "job"
    left = pending(job)
    assert 0 < left < N
    kill_mid_batch(data, "--images-per-batch", "2", batch_id=batch_id, done=N - left + 4,
                   faults=SLOW)  # resumes it, then SIGKILL
    assert 0 < pending(job) < left, (left, pending(job))
    out, lines = resume(data, batch_id, "--images-per-batch", "2")
    c = out.request_counts
    assert out.status == "completed" and (c.total, c.completed, c.failed) == (N, N, 0)
    assert [json.loads(x)["custom_id"] for x in lines] == [cid for cid, _, _ in reqs]
    recorded_once(job, reqs)
    equals_run(lines, reqs, tmp_path)
