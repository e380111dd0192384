"""``vlmbatch serve`` on the built-in model, through the official ``openai`` client: chat
completions with logprobs, concurrency and per-request errors, the media policy and the
limits, and the Batch API (files, batches to ``completed`` equal to ``vlmbatch run``,
cancel, list); its engine process loads no web stack. On the session's shared server
(``conftest.py``: its batch groups slowed, 0.2 s each, so that a batch is still running
when a test cancels it or talks to the server meanwhile)."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

import vlmbatch
from tests.server.serving import (
    IMAGES,
    KEY,
    Server,
    batch_lines,
    chat_body,
    data_url,
    engine_pids,
    upload,
    wait_batch,
)
from tests.waiting import wait_until
from vlmbatch.cli.commands import EXIT_ITEM_ERRORS
from vlmbatch.cli.main import main

RED = "Is there a red shape?"
WEB = (b"pydantic_core", b"httptools", b"uvloop")  # shared objects of the web stack


@pytest.fixture(scope="module")
def vlm() -> vlmbatch.VLM:
    return vlmbatch.VLM()


def p_yes_of(vlm: vlmbatch.VLM, image: Path, question: str) -> float:
    (a,) = vlm.ask([image], [question])
    assert a.p_yes is not None
    return a.p_yes


def error_of(r: httpx.Response) -> dict:
    """The OpenAI error object of a 4xx, checked for its shape."""
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_chat_completion_with_logprobs(client: openai.OpenAI, vlm: vlmbatch.VLM) -> None:
    image = IMAGES / "scene_01.png"
    r = client.chat.completions.create(
        model="vlmbatch", max_tokens=1, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": RED}]}])
    want = p_yes_of(vlm, image, RED)
    top = {t.token: math.exp(t.logprob) for t in r.choices[0].logprobs.content[0].top_logprobs}
    assert top["yes"] == pytest.approx(want, abs=1e-6)
    assert top["yes"] + top["no"] == pytest.approx(1.0, abs=1e-6)
    assert r.choices[0].message.content == ("yes" if want >= 0.5 else "no")
    assert r.model_extra["vlmbatch"]["p_yes"] == round(want, 6)
    assert r.model_extra["vlmbatch"]["image_tokens"] == 80
    assert r.usage.prompt_tokens > 80 and r.usage.completion_tokens == 1
    assert [m.id for m in client.models.list()] == ["vlmbatch"]


def test_text_answers_and_one_top_logprob(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="vlmbatch", max_completion_tokens=6, logprobs=True, top_logprobs=1,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(IMAGES / "scene_02.png")}},
            {"type": "text", "text": "What color is the shape?"}]}])
    assert isinstance(r.choices[0].message.content, str)
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 1
    assert 0 <= r.model_extra["vlmbatch"]["p_yes"] <= 1


def test_label_set_chat_equals_vlm_ask(server: Server, vlm: vlmbatch.VLM) -> None:
    """vLLM's ``structured_outputs: {"choice": [...]}`` and its older ``guided_choice``: the
    content is the most probable choice, ``vlmbatch`` carries ``vlmbatch.VLM.ask``'s label,
    probs and logprobs, ``logprobs: true`` the choices' normalised log-probabilities; a
    malformed label set is a 400."""
    image = IMAGES / "scene_01.png"
    colours = ["red", "green", "blue", "black", "gray", "teal", "yellow", "brown"]
    q = "What color is the shape?"
    (want,) = vlm.ask([image], [{"id": "c", "text": q, "choices": colours}])
    assert want.probs is not None
    with server.client() as c:
        for extra in ({"structured_outputs": {"choice": colours}}, {"guided_choice": colours}):
            r = c.post("/v1/chat/completions", json=chat_body(
                data_url(image), q, logprobs=True, top_logprobs=3, **extra))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["message"]["content"] == want.label
            v = body["vlmbatch"]
            assert (v["label"], v["p_yes"], v["margin"]) == (want.label, None, None)
            for k in ("probs", "logprobs"):  # batched apart: float32 rounding apart
                assert v[k] == pytest.approx(getattr(want, k), abs=1e-5)
            top = body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            assert [t["token"] for t in top] == sorted(colours, key=lambda k: -want.probs[k])[:3]
            assert math.exp(top[0]["logprob"]) == pytest.approx(want.probs[want.label], abs=1e-6)
        for bad in ({"guided_choice": ["red"]}, {"guided_choice": ["red", "red"]},
                    {"structured_outputs": {"regex": "a+"}},
                    {"structured_outputs": {"choice": ["a", "b"]}, "guided_choice": ["c", "d"]}):
            r = c.post("/v1/chat/completions", json=chat_body(data_url(image), q, **bad))
            assert r.status_code == 400, (bad, r.text)
            assert error_of(r)["message"]


def test_concurrent_requests_and_a_bad_image_is_its_own_400(server: Server,
                                                           vlm: vlmbatch.VLM) -> None:
    questions = [RED, "Is there a circle?", "Is there a blue shape?"]
    good = [(IMAGES / f"scene_0{i}.png", q) for i in range(4) for q in questions]
    bad = [chat_body("data:image/png;base64,aGVsbG8=", RED),  # not an image
           chat_body("data:image/png;base64,%%%", RED),  # not base64
           chat_body("https://example.com/a.png", RED)]
    bodies = [chat_body(data_url(p), q, max_tokens=1) for p, q in good] + bad
    with server.client() as c, ThreadPoolExecutor(len(bodies)) as pool:
        rs = list(pool.map(lambda b: c.post("/v1/chat/completions", json=b), bodies))
    for (path, q), r in zip(good, rs):
        assert r.status_code == 200, r.text
        assert r.json()["vlmbatch"]["p_yes"] == round(p_yes_of(vlm, path, q), 6)
    codes = [(r.status_code, error_of(r)["code"]) for r in rs[len(good):]]
    assert codes == [(400, "invalid_image"), (400, "invalid_image_url"),
                     (400, "invalid_image_url")]


def test_file_urls_only_inside_the_allowed_folder(server: Server, media: Path,
                                                  tmp_path: Path) -> None:
    with server.client() as c:
        r = c.post("/v1/chat/completions",
                   json=chat_body((media / "scene_03.png").as_uri(), RED))
        assert r.status_code == 200, r.text
        for url in [f"file://{media}/../../pyproject.toml", f"file://{media}/%2e%2e/secret.png",
                    f"file://{media}/link.png", f"file://{IMAGES}/scene_03.png",
                    "file:///etc/passwd", f"file://{tmp_path}/x.png"]:
            r = c.post("/v1/chat/completions", json=chat_body(url, RED))
            assert r.status_code == 400 and "outside" in error_of(r)["message"], url


def test_limits(server: Server) -> None:
    big = Image.new("RGB", (1500, 1000))  # 1.5 MP, over --max-pixels 1,000,000
    buf = io.BytesIO()
    big.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    small = data_url(IMAGES / "scene_00.png")
    with server.client() as c:
        cases = [
            (chat_body(url, RED), 400, "image_too_large"),
            (chat_body(small, "x" * 20_000), 400, "context_length_exceeded"),
            # 15,400 characters, ~4,400 tokens: past the built-in model's 4,096-token context
            (chat_body(small, "Is there a red shape? " * 700), 400, "context_length_exceeded"),
            (chat_body(small, RED, max_tokens=100_000), 400, "invalid_value"),
            (chat_body(small, RED, n=2), 400, "unsupported_parameter"),
            ({**chat_body(small, RED), "model": "gpt-4o"}, 404, "model_not_found"),
            (chat_body(small, "y" * (3 << 20)), 413, "request_too_large"),  # over 1 MiB
        ]
        for body, status, code in cases:
            r = c.post("/v1/chat/completions", json=body)
            assert (r.status_code, error_of(r)["code"]) == (status, code), r.text[:300]


def test_api_key(server: Server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200  # open
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": "Bearer x"},
                   json=chat_body(data_url(IMAGES / "scene_00.png"), RED))
    assert r.status_code == 401


@pytest.fixture(scope="module")
def embed_vlm() -> vlmbatch.VLM:
    return vlmbatch.VLM(vlmbatch.EMBED_MODEL)


def test_embeddings_equal_vlm_embed(client: openai.OpenAI, server: Server,
                                    embed_vlm: vlmbatch.VLM) -> None:
    """The official client (base64 by default, decoded by it) gets ``VLM.embed``'s vectors
    from the built-in embedding model, texts and a data: URL image; float output equals the
    base64; a Matryoshka size the checkpoint declares works, another is a 400."""
    texts = ["a red circle", "a blue square"]
    r = client.embeddings.create(model="vlmbatch", input=texts)
    want = embed_vlm.embed(texts=texts)
    got = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens > 0
    assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)) <= 1e-5
    with server.client() as c:
        plain = c.post("/v1/embeddings", json={"model": "vlmbatch", "input": texts,
                                                "encoding_format": "float"}).json()
        assert [d["embedding"] for d in plain["data"]] == got
        image = IMAGES / "scene_02.png"
        r2 = c.post("/v1/embeddings", json={"model": "vlmbatch", "modality": "image",
                                            "input": [data_url(image)],
                                            "encoding_format": "float"}).json()
        (want_im,) = embed_vlm.embed(images=[image])
        assert max(abs(a - b) for a, b in zip(r2["data"][0]["embedding"], want_im)) <= 1e-5
        small = c.post("/v1/embeddings", json={"model": "vlmbatch", "input": texts,
                                               "dimensions": 64, "encoding_format": "float"})
        assert len(small.json()["data"][0]["embedding"]) == 64
        bad = c.post("/v1/embeddings", json={"model": "vlmbatch", "input": texts,
                                             "dimensions": 63})
        assert bad.status_code == 400 and error_of(bad)["param"] == "input"
        ids = c.post("/v1/embeddings", json={"model": "vlmbatch", "input": [1, 2, 3]})
        assert ids.status_code == 400 and "token-id" in error_of(ids)["message"]
        r = c.post("/v1/embeddings", json={"model": "vlmbatch", "input": []})
        assert r.status_code == 400 and error_of(r)["param"] == "input"


def test_batch_lifecycle_output_equals_vlmbatch_run(client: openai.OpenAI,
                                                    tmp_path: Path) -> None:
    reqs = [(f"r{i}", data_url(IMAGES / f"scene_{i % 12:02d}.png"), q)
            for i, q in enumerate([RED, "Is there a circle?"] * 7)]
    reqs.insert(5, ("broken", "data:image/png;base64,aGVsbG8=", RED))
    text = batch_lines(reqs)
    f = upload(client, text)
    assert client.files.retrieve(f.id).bytes == len(text.encode())
    assert client.files.content(f.id).content == text.encode()
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h", metadata={"who": "test"})
    assert b.status == "validating" and b.metadata == {"who": "test"}
    b = wait_batch(client, b.id, timeout=60)
    assert b.status == "completed", b
    counts = b.request_counts
    assert (counts.total, counts.completed, counts.failed) == (15, 14, 1)
    assert b.in_progress_at and b.finalizing_at and b.completed_at
    got = client.files.content(b.output_file_id).text.splitlines()
    got_err = client.files.content(b.error_file_id).text.splitlines()
    (tmp_path / "in.jsonl").write_text(text)
    out = tmp_path / "run.jsonl"
    assert main(["run", str(tmp_path / "in.jsonl"), "-o", str(out), "--no-progress"]) \
        == EXIT_ITEM_ERRORS
    want = out.read_text().splitlines()
    assert got == [x for x in want if json.loads(x)["error"] is None]
    assert got_err == [x for x in want if json.loads(x)["error"] is not None]
    assert json.loads(got_err[0])["custom_id"] == "broken"
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_cancel_keeps_the_answers_so_far(client: openai.OpenAI, server: Server) -> None:
    reqs = [(f"c{i}", data_url(IMAGES / f"scene_{i % 12:02d}.png"), RED) for i in range(60)]
    b = client.batches.create(input_file_id=upload(client, batch_lines(reqs)).id,
                              endpoint="/v1/chat/completions", completion_window="24h")
    wait_batch(client, b.id, done=4, timeout=60)
    started = time.monotonic()
    with server.client() as c:  # answered while the batch runs, not after it
        r = c.post("/v1/chat/completions", json=chat_body(data_url(IMAGES / "scene_05.png"), RED))
    assert r.status_code == 200 and time.monotonic() - started < 3
    assert client.batches.retrieve(b.id).status == "in_progress"
    assert client.batches.cancel(b.id).status == "cancelling"
    b = wait_batch(client, b.id, timeout=60)
    assert b.status == "cancelled" and b.cancelled_at
    done = b.request_counts.completed
    assert 4 <= done < 60 and b.request_counts.total == 60
    lines = client.files.content(b.output_file_id).text.splitlines()
    assert len(lines) == done and [json.loads(x)["custom_id"] for x in lines] == \
        [f"c{i}" for i in range(done)]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(b.id)


def test_list_is_newest_first_and_paginated(client: openai.OpenAI) -> None:
    f = upload(client, batch_lines([("l0", data_url(IMAGES / "scene_00.png"), RED)]))
    made = [client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h").id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    everything = [b.id for b in client.batches.list(limit=2)]  # the client follows `after`
    assert everything[:3] == made[::-1] and len(everything) == len(set(everything)) >= 5
    for batch_id in made:
        assert wait_batch(client, batch_id, timeout=60).status == "completed"


def test_invalid_batches(client: openai.OpenAI, server: Server) -> None:
    bad = upload(client, 'not json\n')
    b = wait_batch(client, client.batches.create(
        input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h").id,
        timeout=60)
    assert b.status == "failed" and b.errors.data[0].line == 1
    assert "not an OpenAI batch file" in b.errors.data[0].message
    lines = batch_lines([("a", data_url(IMAGES / "scene_00.png"), RED),
                         ("b", "file:///etc/passwd", RED), ("a", "data:,x", RED)])
    b = wait_batch(client, client.batches.create(
        input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
        completion_window="24h").id,
        timeout=60)
    assert b.status == "failed" and [e.line for e in b.errors.data] == [2]
    url = data_url(IMAGES / "scene_00.png")  # what chat refuses, a batch line refuses too
    for long in ("x" * 20_000, "Is there a red shape? " * 700):  # chars; 4,096 tokens
        b = wait_batch(client, client.batches.create(
            input_file_id=upload(client, batch_lines([("a", url, RED), ("b", url, long)])).id,
            endpoint="/v1/chat/completions", completion_window="24h").id, timeout=60)
        assert b.status == "failed" and [(e.line, e.code) for e in b.errors.data] == [
            (2, "context_length_exceeded")], b.errors
    ok = upload(client, batch_lines([("x", data_url(IMAGES / "scene_00.png"), RED)])).id
    with server.client() as c:
        for body, status in [
                ({"input_file_id": ok, "endpoint": "/v1/completions",
                  "completion_window": "24h"}, 400),
                ({"input_file_id": ok, "endpoint": "/v1/chat/completions",
                  "completion_window": "1h"}, 400),
                ({"input_file_id": "file-" + "0" * 32, "endpoint": "/v1/chat/completions",
                  "completion_window": "24h"}, 404),
                ({"endpoint": "/v1/chat/completions", "completion_window": "24h"}, 400)]:
            r = c.post("/v1/batches", json=body)
            assert r.status_code == status, r.text
            error_of(r)
        r = c.post("/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "tune"})
        assert r.status_code == 400 and error_of(r)["param"] == "purpose"
        for path in ("/v1/files/../../etc/passwd", "/v1/files/file-zz", "/v1/batches/batch_1"):
            assert c.get(path).status_code == 404


def test_duplicate_custom_ids_fail_the_batch(client: openai.OpenAI) -> None:
    url = data_url(IMAGES / "scene_00.png")
    f = upload(client, batch_lines([("same", url, RED), ("same", url, RED)]))
    b = wait_batch(client, client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id,
        timeout=60)
    assert b.status == "failed" and "appears twice" in b.errors.data[0].message
    assert str(os.sep + "files" + os.sep) not in b.errors.data[0].message  # no server paths


def test_the_engine_process_loads_no_web_stack(server: Server) -> None:
    """The engine process (``vlmbatch.serving.engine_process``) has none of the web stack's
    shared objects mapped (FastAPI and Starlette cannot be imported without pydantic's
    core); the HTTP process, on the same check, has them."""
    def mapped(pid: int) -> set[bytes]:
        maps = Path(f"/proc/{pid}/maps").read_bytes()
        return {name for name in WEB if name in maps}

    (pid,) = wait_until(lambda: engine_pids(server), 30, "the engine process listed")
    assert b"pydantic_core" in mapped(server.proc.pid)  # the check sees what is there
    assert mapped(pid) == set(), f"engine process {pid} maps {mapped(pid)}"


def test_concurrent_requests_share_engine_calls_and_answer_as_vlm(
        server: Server, vlm: vlmbatch.VLM) -> None:
    """24 requests at once (4 images, 6 questions each): the answers ``VLM.ask`` gives (to
    1e-6), in fewer engine calls than requests (the engine thread batches them into its
    calls, which cut them into forwards under the offline token budget)."""
    questions = [RED, "Is there a circle?", "Is there a blue shape?", "Is there a triangle?",
                 "Is there more than one shape?", "Is the shape in the left half?"]
    asked = [(IMAGES / f"scene_{8 + i:02d}.png", q) for i in range(4) for q in questions]
    want = {(str(p), q): a.p_yes for p in {p for p, _ in asked}
            for q, a in zip(questions, vlm.ask([p], questions))}
    calls = metric(server, "vlmbatch_engine_calls_total")
    bodies = [chat_body(data_url(p), q, max_tokens=1) for p, q in asked]
    with server.client() as c, ThreadPoolExecutor(len(bodies)) as pool:
        rs = list(pool.map(lambda b: c.post("/v1/chat/completions", json=b), bodies))
    made = metric(server, "vlmbatch_engine_calls_total") - calls
    for (p, q), r in zip(asked, rs):
        assert r.status_code == 200, r.text
        # both 6-decimal values: within one step of the rounding (1e-6), float noise off
        assert round(abs(r.json()["vlmbatch"]["p_yes"] - want[(str(p), q)]), 9) <= 1e-6
    assert 1 <= made < len(bodies), made


def metric(server: Server, name: str) -> float:
    page = httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text
    return next(s.value for fam in text_string_to_metric_families(page) for s in fam.samples
                if s.name == name)
