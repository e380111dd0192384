"""``vlmbatch serve --engines 2`` (two engine processes of 1 thread each, the built-in
model) through the official client: answers equal ``vlmbatch.VLM``'s whichever engine
gives them, ``usage`` filled for chat responses and batch output lines; then both engine
processes SIGKILLed with requests in flight and a batch running: each request in flight
is a 200 or a 503 with ``Retry-After``, new ones are answered once the engines are back
(the client retries), the batch completes with every request answered exactly once, and
``/metrics`` counts the restarts. Between them, a trimmed soak. Engine calls are slowed by
0.3 s so that requests are in flight when the engines are killed."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import vlmbatch
from bench.soak import batch_once, run_soak, start_batch
from tests.server.serving import (
    IMAGES,
    KEY,
    Server,
    batch_lines,
    chat_body,
    create_batch,
    data_url,
    engine_pids,
    in_engines,
    server_fixture,
    wait_batch,
)
from tests.waiting import wait_until

QS = ("Is there a red shape?", "Is there a circle?")
server = server_fixture("--engines", "2", "--images-per-batch", "2",
                        faults={"slow_score": 0.3}, ready_s=240)


def metric(server: Server, name: str, **labels: str) -> float:
    page = httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text
    return next(s.value for fam in text_string_to_metric_families(page) for s in fam.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def ask(client: openai.OpenAI, image: str, q: str, **extra: object):  # noqa: ANN201
    return client.chat.completions.create(
        model="vlmbatch", **extra,  # type: ignore[call-overload]
        messages=chat_body(data_url(IMAGES / image), q)["messages"])


def test_two_engines_answer_as_vlm_with_usage(server: Server, client: openai.OpenAI) -> None:
    assert len(engine_pids(server)) == 2
    images = [f"scene_{i:02d}.png" for i in range(6)]
    want = {int(a.image_id): a for a in vlmbatch.VLM().ask([IMAGES / im for im in images],
                                                           [QS[0]])}
    got: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(
        i, ask(client, images[i], QS[0], max_tokens=1))) for i in range(len(images))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(want) == list(range(len(images)))
    for i, a in want.items():
        r = got[i]
        assert r.model_extra["vlmbatch"]["p_yes"] == pytest.approx(a.p_yes, abs=1e-6)
        assert r.usage.completion_tokens == 1
        assert r.usage.prompt_tokens > r.model_extra["vlmbatch"]["image_tokens"] > 0
    assert metric(server, "vlmbatch_engine_up", engine="0") == 1
    assert metric(server, "vlmbatch_engine_up", engine="1") == 1
    text = ask(client, images[0], "Describe the picture.", max_tokens=4)
    assert text.choices[0].message.content and 1 <= text.usage.completion_tokens <= 4
    assert text.usage.total_tokens == text.usage.prompt_tokens + text.usage.completion_tokens
    # a batch line's usage is the interactive request's
    b = wait_batch(client, create_batch(client, batch_lines(
        [("u0", data_url(IMAGES / images[1]), QS[0])])).id, timeout=120)
    (line,) = client.files.content(b.output_file_id).text.splitlines()
    usage = json.loads(line)["response"]["body"]["usage"]
    assert usage == {"prompt_tokens": got[1].usage.prompt_tokens, "completion_tokens": 1,
                     "total_tokens": got[1].usage.prompt_tokens + 1}


def test_a_trimmed_soak_with_a_batch(server: Server) -> None:
    """``bench/soak.py``'s checks on 300 requests from 16 clients while a batch runs (the
    20,000-request soak: ``test_soak.py``, slow): no error but retried 429s, the batch
    completed exactly once."""
    with server.client() as c:
        batch_id, ids = start_batch(c, 12)
        s = run_soak(server, 300, 16, KEY)
        assert s.errors == [] and len(s.latency) == 300
        assert batch_once(c, batch_id, ids, 240) is None


def test_engines_killed_requests_503_then_retried_batch_once(server: Server,
                                                           client: openai.OpenAI) -> None:
    n = 12
    reqs = [(f"k{i}", data_url(IMAGES / f"scene_{i % 6:02d}.png"), QS[i % 2])
            for i in range(n)]
    b = create_batch(client, batch_lines(reqs))
    wait_batch(client, b.id, done=2, timeout=120)
    answers: list[httpx.Response] = []
    with server.client() as c:
        def send(i: int) -> None:
            body = chat_body(data_url(IMAGES / f"scene_{6 + i:02d}.png"), QS[0], max_tokens=1)
            answers.append(c.post("/v1/chat/completions", json=body))

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()

        def all_in() -> bool:  # each in an engine or answered, one at least still in
            answered = len(answers)  # read first: one answered meanwhile is not counted twice
            inside = in_engines(server)
            return inside > 0 and answered + inside == len(threads)

        wait_until(all_in, 30, "the 4 requests in the engines (each call slowed by 0.3 s)")
        pids = engine_pids(server)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join()
    assert len(pids) == 2 and len(answers) == 4
    statuses = sorted(r.status_code for r in answers)
    assert set(statuses) <= {200, 503} and 503 in statuses, [r.text for r in answers]
    for r in answers:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] in ("engine_restarting",)
            assert "died" in r.json()["error"]["message"]  # it was in the engine killed
    retrying = server.openai().with_options(max_retries=30)
    r = retrying.chat.completions.create(  # 503s until the engines are back, then answered
        model="vlmbatch", max_tokens=1,
        messages=chat_body(data_url(IMAGES / "scene_10.png"), QS[1])["messages"])
    assert r.choices[0].message.content in ("yes", "no")
    done = wait_batch(client, b.id, timeout=240)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
    lines = client.files.content(done.output_file_id).text.splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in lines) == sorted(c for c, _, _ in reqs)
    assert metric(server, "vlmbatch_engine_restarts_total") == 2
    new = engine_pids(server)
    assert len(new) == 2 and not set(new) & set(pids)
