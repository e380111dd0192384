"""Batches of ``/v1/embeddings`` requests through the official ``openai`` client: output
lines equal ``VLM.embed`` on the built-in embedding model and the interactive endpoint
(float, base64, ``dimensions``), in input order, a request with a list input one request;
bad lines named at validation; a request over the token limit in the error file; cancel
keeps whole requests (on the session's shared server, ``conftest.py``); ``--no-embeddings``
refuses them; a server killed with SIGKILL mid-batch and started again embeds every request
exactly once."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import openai
import pytest

import vlmbatch
from tests.server.serving import (
    IMAGES,
    Server,
    batch_lines,
    create_batch,
    data_url,
    kill_mid_batch,
    pending,
    recorded,
    resume,
    wait_batch,
)

URL = "/v1/embeddings"


@pytest.fixture(scope="module")
def embed_vlm() -> vlmbatch.VLM:
    return vlmbatch.VLM(vlmbatch.EMBED_MODEL)


def embed_lines(reqs: list[tuple[str, str | list[str], dict]], url: str = URL) -> str:
    return "".join(json.dumps({"custom_id": cid, "method": "POST", "url": url,
                               "body": {"model": "vlmbatch", "input": inp, **extra}}) + "\n"
                   for cid, inp, extra in reqs)


def vectors(data: list[dict], fmt: str) -> np.ndarray:
    """An embeddings ``data`` list as [N, D] float32, decoding base64."""
    if fmt == "base64":
        return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
                         for d in data])
    return np.array([d["embedding"] for d in data], np.float32)


def create(client: openai.OpenAI, text: str, endpoint: str = URL):  # noqa: ANN201
    return create_batch(client, text, endpoint)


REQS: list[tuple[str, str | list[str], dict]] = [
    ("z-first", "a red circle", {}),
    ("b", ["a blue square", "two green triangles", "a yellow circle"], {}),
    ("b64", ["a blue square", "two green triangles"], {"encoding_format": "base64"}),
    ("d64", ["a red circle", "a blue square"], {"dimensions": 64}),
    ("a", "three shapes", {"dimensions": 64, "encoding_format": "base64"}),
]


def test_output_equals_vlm_embed_and_the_interactive_endpoint(
        client: openai.OpenAI, embed_vlm: vlmbatch.VLM) -> None:
    b = wait_batch(client, create(client, embed_lines(REQS)).id, timeout=60)
    assert b.status == "completed", b
    assert b.endpoint == URL and b.error_file_id is None
    c = b.request_counts
    assert (c.total, c.completed, c.failed) == (len(REQS), len(REQS), 0)  # requests
    lines = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in lines] == [cid for cid, _, _ in REQS]  # input order
    got: dict[str, np.ndarray] = {}
    for (cid, inp, extra), out in zip(REQS, lines):
        texts = [inp] if isinstance(inp, str) else inp
        assert out["error"] is None and out["response"]["status_code"] == 200
        body = out["response"]["body"]
        assert body["object"] == "list" and body["model"] == "vlmbatch"
        assert [(d["object"], d["index"]) for d in body["data"]] == \
            [("embedding", i) for i in range(len(texts))]
        v = got[cid] = vectors(body["data"], extra.get("encoding_format", "float"))
        dims = extra.get("dimensions")
        assert v.shape == (len(texts), dims or embed_vlm.embed(texts=["x"]).shape[1])
        want = embed_vlm.embed(texts=texts, **({"dimensions": dims} if dims else {}))
        assert np.abs(v - want).max() <= 1e-5, cid
        live = client.embeddings.create(model="vlmbatch", input=texts, encoding_format="float",
                                        **({"dimensions": dims} if dims else {}))
        assert np.abs(v - np.array([d.embedding for d in live.data], np.float32)).max() \
            <= 1e-5, cid
        assert body["usage"] == {"prompt_tokens": live.usage.prompt_tokens,
                                 "total_tokens": live.usage.total_tokens}
    # the same strings in float and in base64 lines: the same floats
    assert np.abs(got["b64"] - got["b"][:2]).max() <= 1e-5
    assert np.abs(np.linalg.norm(got["d64"], axis=1) - 1).max() <= 1e-5  # re-normalised


def test_bad_lines_are_named_and_fail_the_batch(client: openai.OpenAI) -> None:
    text = embed_lines([("ok", "a red circle", {})]) \
        + batch_lines([("chat", data_url(IMAGES / "scene_00.png"), "Is it red?")]) \
        + embed_lines([("ids", [1, 2, 3], {}), ("num", 5, {}),  # type: ignore[list-item]
                       ("dims", "a circle", {"dimensions": 63})]) \
        + json.dumps({"method": "POST", "url": URL, "body": {"model": "m", "input": "x"}}) \
        + "\n"
    b = wait_batch(client, create(client, text).id, timeout=60)
    assert b.status == "failed" and b.output_file_id is None
    errors = [(e.line, e.message) for e in b.errors.data]
    assert [n for n, _ in errors] == [2, 3, 4, 5, 6]
    for (_, msg), want in zip(errors, ["does not match the batch's endpoint /v1/embeddings",
                                       "token-id inputs are not supported",
                                       "body.input must be a string", "body.dimensions 63",
                                       "missing 'custom_id'"]):
        assert want in msg, (want, msg)
    b = wait_batch(client, create(client, embed_lines(
        [("same", "x", {}), ("other", "y", {}), ("same", "z", {})])).id, timeout=60)
    assert b.status == "failed"
    assert "'same' appears twice (first on line 1)" in b.errors.data[0].message
    # and an embeddings line in a chat batch
    chat = batch_lines([("c", data_url(IMAGES / "scene_00.png"), "Is it red?")]) \
        + embed_lines([("e", "a red circle", {})])
    b = wait_batch(client, create(client, chat, "/v1/chat/completions").id, timeout=60)
    assert b.status == "failed" and [e.line for e in b.errors.data] == [2]
    assert "embedding requests go in a file of their own" in b.errors.data[0].message


def test_cancel_keeps_whole_requests(client: openai.OpenAI) -> None:
    reqs: list[tuple[str, str | list[str], dict]] = [
        (f"c{i}", [f"shape {i}", f"circle {i}", f"square {i}"], {}) for i in range(40)]
    b = create(client, embed_lines(reqs))
    wait_batch(client, b.id, done=4, timeout=60)
    assert client.batches.cancel(b.id).status == "cancelling"
    b = wait_batch(client, b.id, timeout=60)
    assert b.status == "cancelled"
    done = b.request_counts.completed
    assert 4 <= done < 40 and b.request_counts.total == 40
    lines = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in lines] == [f"c{i}" for i in range(done)]
    assert all(len(x["response"]["body"]["data"]) == 3 for x in lines)  # whole requests


def test_no_embeddings_refuses_embedding_batches(tmp_path: Path) -> None:
    s = Server(tmp_path / "data", "--no-embeddings").wait_ready()
    try:
        c = s.openai()
        with pytest.raises(openai.BadRequestError) as e:
            create(c, embed_lines(REQS))
        err = e.value.body
        assert isinstance(err, dict) and err["code"] == "embeddings_unavailable"
        assert "--no-embeddings" in err["message"] and err["param"] == "endpoint"
        assert c.batches.list().data == []  # nothing recorded
    finally:
        assert s.stop() in (0, 143), s.output()


def test_sigkill_mid_batch_then_each_request_embedded_once(tmp_path: Path,
                                                           embed_vlm: vlmbatch.VLM) -> None:
    reqs = [(f"k{i}", [f"shape {i}", f"a red shape {i}"] if i % 3 == 0 else f"circle {i}", {})
            for i in range(12)]
    data = tmp_path / "data"
    batch_id = kill_mid_batch(data, "--images-per-batch", "2", text=embed_lines(reqs),
                              faults={"group_delay": 0.3}, endpoint=URL)
    assert pending(data / "batches" / batch_id / "job") < len(reqs)
    out, text = resume(data, batch_id, "--images-per-batch", "2")
    assert out.status == "completed", out
    c = out.request_counts
    assert (c.total, c.completed, c.failed) == (12, 12, 0)
    lines = [json.loads(x) for x in text]
    assert [x["custom_id"] for x in lines] == [cid for cid, _, _ in reqs]
    got = recorded(data / "batches" / batch_id / "job")
    assert sorted(json.loads(s)["custom_id"] for s, _ in got) == sorted(
        cid for cid, _, _ in reqs)  # each request recorded once, with one result per string
    assert [len(res) for _, res in got] == [2 if i % 3 == 0 else 1 for i in range(12)]
    for (_, inp, _), x in zip(reqs, lines):
        texts = [inp] if isinstance(inp, str) else inp
        got = vectors(x["response"]["body"]["data"], "float")
        assert np.abs(got - embed_vlm.embed(texts=texts)).max() <= 1e-5


def test_a_request_over_the_token_limit_goes_to_the_error_file(client: openai.OpenAI) -> None:
    reqs: list[tuple[str, str | list[str], dict]] = [
        ("ok", "a red circle", {}), ("long", ["fine", "a red circle " * 2740], {}),
        ("after", ["a blue square"], {})]  # "long"'s second string: 8,221 tokens
    b = wait_batch(client, create(client, embed_lines(reqs)).id, timeout=120)
    assert b.status == "completed", b
    c = b.request_counts
    assert (c.total, c.completed, c.failed) == (3, 2, 1)
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == ["ok", "after"]
    (err,) = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert err["custom_id"] == "long" and err["response"] is None
    assert err["error"]["code"] == "too_large_error"
    assert "input 1" in err["error"]["message"] and "8,192" in err["error"]["message"]
