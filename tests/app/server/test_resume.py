"""A batch is a job: a server stopped by SIGTERM finishes the request in flight and leaves
the batch resumable; a server killed with SIGKILL mid-batch and started again on the same
data folder completes it, every request answered exactly once, lines equal to
``vlmbatch run``'s."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.app.server.serving import IMAGES, Server, batch_lines, chat_body, data_url
from vlmbatch.app.cli import EXIT_OK, main
from vlmbatch.jobs.folder import STORE_FILE
from vlmbatch.jobs.store import JobStore

N = 30
SLOW = {"group_delay": 0.25}  # each batch group of 2 then takes >= 0.25 s
# and each chat engine call 1 s more: a request sent 0.3 s before SIGTERM is still in flight
SLOWER = {**SLOW, "slow_score": 1.0}


def counts(c: httpx.Client, batch_id: str) -> tuple[str, int]:
    b = c.get(f"/v1/batches/{batch_id}").json()
    return b["status"], b["request_counts"]["completed"]


def wait_for(c: httpx.Client, batch_id: str, done: int | None = None,
             timeout: float = 90) -> tuple[str, int]:
    """Until the batch has ``done`` answers (None: until it has finished)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st, n = counts(c, batch_id)
        if (done is not None and n >= done) or st in ("completed", "failed", "cancelled"):
            return st, n
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} stuck at {counts(c, batch_id)}")


def pending(job: Path) -> int:
    store = JobStore(job / STORE_FILE)
    try:
        return store.counts().pending
    finally:
        store.close()


def sigterm_with_a_request_in_flight(data: Path, text: str) -> str:
    """Start a batch, send a chat request, SIGTERM while it is in the engine: the request
    is answered, the server exits 143, the batch stays in progress, its job interrupted."""
    a = Server(data, "--images-per-batch", "2", faults=SLOWER).wait_ready()
    with a.client() as c:
        f = c.post("/v1/files", files={"file": ("in.jsonl", text.encode())},
                   data={"purpose": "batch"}).json()
        b = c.post("/v1/batches", json={"input_file_id": f["id"], "completion_window": "24h",
                                        "endpoint": "/v1/chat/completions"}).json()
        wait_for(c, b["id"], done=4)
        got: list[httpx.Response] = []
        body = chat_body(data_url(IMAGES / "scene_07.png"), "Is there a red shape?")
        t = threading.Thread(target=lambda: got.append(c.post("/v1/chat/completions",
                                                              json=body)))
        t.start()
        time.sleep(0.3)  # in flight: in the engine thread (slowed by 1 s)
        rc = a.stop()
        t.join()
    assert rc == 143, a.output()
    assert got and got[0].status_code == 200, got  # the request in flight was answered
    record = json.loads((data / "batches" / b["id"] / "batch.json").read_text())
    store = JobStore(data / "batches" / b["id"] / "job" / STORE_FILE)
    assert record["status"] == "in_progress" and store.get("status") == "interrupted"
    store.close()
    return str(b["id"])


def test_sigkill_mid_batch_resumed_once_then_sigterm_answers_the_request_in_flight(
        tmp_path: Path) -> None:
    """The slow test below, trimmed for CI (two server starts, 10 requests): a server
    SIGKILLed mid-batch; the next one on the same data folder completes the batch, every
    request answered once, lines equal to ``vlmbatch run``'s; then a chat request in flight
    (its engine call slowed by 1 s) when SIGTERM arrives is answered, and the server exits
    143."""
    data, n = tmp_path / "data", 10
    reqs = [(f"k{i}", data_url(IMAGES / f"scene_{i % 6:02d}.png"),
             ["Is there a red shape?", "Is there a circle?"][i % 2]) for i in range(n)]
    (tmp_path / "in.jsonl").write_text(batch_lines(reqs))
    k = Server(data, "--images-per-batch", "2", faults=SLOW).wait_ready()
    with k.client() as c:
        f = c.post("/v1/files", files={"file": ("in.jsonl", batch_lines(reqs).encode())},
                   data={"purpose": "batch"}).json()
        batch_id = c.post("/v1/batches", json={"input_file_id": f["id"],
                                               "completion_window": "24h",
                                               "endpoint": "/v1/chat/completions"}).json()["id"]
        wait_for(c, batch_id, done=4)
    k.kill()  # SIGKILL mid-batch: no chance to mark anything
    job = data / "batches" / batch_id / "job"
    assert 0 < pending(job) < n
    r = Server(data, "--images-per-batch", "2", faults={"slow_score": 1.0}).wait_ready()
    with r.client() as c:
        assert wait_for(c, batch_id) == ("completed", n)  # resumed by the new server
        out = c.get(f"/v1/batches/{batch_id}").json()
        lines = c.get(f"/v1/files/{out['output_file_id']}/content").text.splitlines()
        got: list[httpx.Response] = []
        body = chat_body(data_url(IMAGES / "scene_07.png"), "Is there a red shape?")
        t = threading.Thread(target=lambda: got.append(c.post("/v1/chat/completions",
                                                              json=body)))
        t.start()
        time.sleep(0.3)  # in flight: in the engine thread (slowed by 1 s)
        rc = r.stop()
        t.join()
    assert rc == 143, r.output()
    assert got and got[0].status_code == 200, got  # the request in flight was answered
    assert out["request_counts"] == {"total": n, "completed": n, "failed": 0}
    store = JobStore(job / STORE_FILE)
    recorded = [ln["id"] for (x,) in store.db.execute("SELECT result FROM items")
                for ln in json.loads(x)]
    store.close()
    assert sorted(recorded) == sorted(cid for cid, _, _ in reqs)  # each once in the store
    run_out = tmp_path / "run.jsonl"
    assert main(["run", str(tmp_path / "in.jsonl"), "-o", str(run_out),
                 "--no-progress"]) == EXIT_OK
    assert lines == run_out.read_text().splitlines()  # = vlmbatch run, line for line


@pytest.mark.slow  # three server starts, ~25 s on 2 cores
def test_sigterm_then_sigkill_then_the_batch_completes_exactly_once(tmp_path: Path) -> None:
    data = tmp_path / "data"
    reqs = [(f"k{i}", data_url(IMAGES / f"scene_{i % 12:02d}.png"),
             ["Is there a red shape?", "Is there a circle?"][i % 2]) for i in range(N)]
    (tmp_path / "in.jsonl").write_text(batch_lines(reqs))
    batch_id = sigterm_with_a_request_in_flight(data, batch_lines(reqs))
    job = data / "batches" / batch_id / "job"
    left = pending(job)
    assert 0 < left < N

    k = Server(data, "--images-per-batch", "2", faults=SLOW).wait_ready()  # resumes it
    with k.client() as c:
        wait_for(c, batch_id, done=N - left + 4)
    k.kill()  # SIGKILL mid-batch: no chance to mark anything
    assert 0 < pending(job) < left, (left, pending(job))

    r = Server(data, "--images-per-batch", "2").wait_ready()
    try:
        with r.client() as c:
            assert wait_for(c, batch_id) == ("completed", N)
            out = c.get(f"/v1/batches/{batch_id}").json()
            assert out["request_counts"] == {"total": N, "completed": N, "failed": 0}
            lines = c.get(f"/v1/files/{out['output_file_id']}/content").text.splitlines()
    finally:
        assert r.stop() == 143
    assert [json.loads(x)["custom_id"] for x in lines] == [cid for cid, _, _ in reqs]
    store = JobStore(job / STORE_FILE)
    recorded = [ln["id"] for (x,) in store.db.execute("SELECT result FROM items")
                for ln in json.loads(x)]
    store.close()
    assert sorted(recorded) == sorted(cid for cid, _, _ in reqs)  # each once in the store
    run_out = tmp_path / "run.jsonl"
    assert main(["run", str(tmp_path / "in.jsonl"), "-o", str(run_out),
                 "--no-progress"]) == EXIT_OK
    assert lines == run_out.read_text().splitlines()  # = vlmbatch run, line for line
