"""Fuzzing the server: hundreds of malformed requests (bad JSON, wrong types, missing
fields, huge or empty inputs, unknown models, bad base64, path traversal in file://, wrong
auth, garbage ids and multipart) against one running server (the session's shared one,
``conftest.py``). Not one may get a 5xx, every 4xx must be OpenAI's error shape, and the
server must still answer afterwards.

Derandomized (the cases are the same on every run); ``SEEN`` counts the requests sent and
the last test checks it is at least ``MIN_CASES``.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from urllib.parse import quote, unquote, urlparse

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.serving import IMAGES, KEY, Server, batch_lines, chat_body, data_url
from vlmbatch.server.batch_worker import input_errors
from vlmbatch.server.config import ServerConfig

MIN_CASES = 1000  # docs/server.md and docs/status.md: about 1,000 a run (1,033 measured)
SEEN: list[int] = []  # status of every fuzzed response
FUZZ = settings(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
POSTS = ["/v1/chat/completions", "/v1/embeddings", "/v1/batches", "/v1/files",
         "/v1/batches/batch_" + "0" * 32 + "/cancel"]
DELETE = object()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=8)


@pytest.fixture(scope="module")
def http(server: Server):  # noqa: ANN201
    with server.client() as c:
        yield c


def check(r: httpx.Response) -> None:
    """No 5xx; a 4xx is ``{"error": {"message", "type", "param", "code"}}``."""
    SEEN.append(r.status_code)
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)


def template() -> dict:
    return chat_body(data_url(IMAGES / "scene_00.png"), "Is there a red shape?", max_tokens=1,
                     logprobs=True, top_logprobs=2)


PATHS = [("model",), ("messages",), ("messages", 0), ("messages", 0, "role"),
         ("messages", 0, "content"), ("messages", 0, "content", 0),
         ("messages", 0, "content", 0, "type"), ("messages", 0, "content", 0, "image_url"),
         ("messages", 0, "content", 0, "image_url", "url"), ("messages", 0, "content", 1),
         ("messages", 0, "content", 1, "text"), ("max_tokens",), ("logprobs",),
         ("top_logprobs",), ("stream",), ("n",), ("temperature",), ("max_completion_tokens",)]


def mutated(path: tuple, value: object) -> dict:
    body = template()
    *head, last = path
    node = body
    for key in head:
        node = node[key]
    if value is DELETE and isinstance(node, dict):
        node.pop(last, None)
    elif value is DELETE:
        del node[last]
    else:
        node[last] = copy.deepcopy(value)
    return body


@settings(FUZZ, max_examples=170)
@given(st.sampled_from(PATHS), st.one_of(st.just(DELETE), json_values))
def test_chat_with_one_field_broken(http: httpx.Client, path: tuple, value: object) -> None:
    # json.dumps, not httpx's json=: a float field may be inf or nan, which Python writes
    # as Infinity / NaN (not JSON) and httpx refuses to encode; the server must refuse it
    check(http.post("/v1/chat/completions", content=json.dumps(mutated(path, value)),
                    headers={"content-type": "application/json"}))


@settings(FUZZ, max_examples=90)
@given(st.sampled_from(POSTS), st.binary(max_size=300) | st.text(max_size=300),
       st.sampled_from(["application/json", "text/plain", "multipart/form-data",
                        "multipart/form-data; boundary=x", ""]))
def test_raw_bodies(http: httpx.Client, path: str, body: bytes | str, ctype: str) -> None:
    check(http.post(path, content=body, headers={"content-type": ctype}))


@settings(FUZZ, max_examples=90)
@given(st.sampled_from(POSTS), json_values)
def test_json_values_of_any_shape(http: httpx.Client, path: str, value: object) -> None:
    check(http.post(path, content=json.dumps(value), headers={"content-type":
                                                             "application/json"}))


segments = st.sampled_from(["..", ".", "%2e%2e", "ok.png", "link.png", "secret.png", "",
                            "etc", "passwd", "%00", "a b", "..%2f", "~"])
image_urls = st.one_of(
    st.builds(lambda s: "data:image/png;base64," + s, st.text(max_size=40)),
    st.builds(lambda b: "data:image/png;base64," + base64.b64encode(b).decode(),
              st.binary(max_size=200)),  # valid base64, not an image
    st.builds(lambda parts, host: f"file://{host}" + "/".join(["", *parts]),
              st.lists(segments, max_size=6), st.sampled_from(["", "localhost", "evil", ".."])),
    st.builds(lambda scheme, rest: f"{scheme}{rest}",
              st.sampled_from(["http://", "https://", "ftp://", "", "data:", "file:"]),
              st.text(max_size=30)))


@settings(FUZZ, max_examples=110)
@given(image_urls, st.booleans())
def test_image_urls(http: httpx.Client, media: Path, url: str, rooted: bool) -> None:
    if rooted and url.startswith("file://") and not url.startswith("file://" + str(media)):
        url = url.replace("file://", f"file://{media}", 1)  # traversal from inside the root
    r = http.post("/v1/chat/completions", json=chat_body(url, "Is there a red shape?"))
    check(r)
    if url.startswith("file://") and r.status_code == 200:  # only ever a file in the root
        read = Path(unquote(urlparse(url).path)).resolve()
        assert read.is_relative_to(media.resolve()) and read.name == "ok.png", url


bad_inputs = st.one_of(
    st.just([]), st.just(""), st.just([""]), st.just([[]]), st.just([1, "a"]),
    st.just([-1, 2]), st.just([[1], "a"]), st.just(["a"] * 2049), st.just([[7] * 8193]),
    st.booleans(), st.floats(), st.dictionaries(st.text(max_size=5), json_values, max_size=3),
    st.lists(st.booleans(), min_size=1, max_size=3), st.lists(st.floats(), min_size=1))


@settings(FUZZ, max_examples=80)
@given(bad_inputs, st.sampled_from(["input", "encoding_format", "dimensions", "model",
                                    "modality", "messages", "both"]), json_values)
def test_embeddings_invalid(http: httpx.Client, bad: object, what: str, value: object) -> None:
    body: dict = {"model": "vlmbatch", "input": ["fine text"]}
    if what == "input":
        body["input"] = bad
    elif what == "encoding_format":
        body["encoding_format"] = value if value not in ("float", "base64") else "utf8"
    elif what == "dimensions":
        fine = value is None or (isinstance(value, int) and not isinstance(value, bool)
                                 and value > 0)  # None or n: valid
        body["dimensions"] = 0 if fine else value
    elif what == "model":
        body["model"] = value if value != "vlmbatch" else "other"
    elif what == "modality":
        body.update(modality="image", input=["data:image/png;base64,@@", "file:///etc/passwd"])
    elif what == "messages":
        body = {"model": "vlmbatch", "messages": bad if bad != [] else [{"role": "user"}]}
    else:
        body["messages"] = [{"role": "user", "content": "x"}]
    r = http.post("/v1/embeddings", json=body)
    check(r)
    assert 400 <= r.status_code < 500


# what an HTTP header value may hold (RFC 9110: visible ASCII, space, tab, and bytes >= 0x80
# as UTF-8 here); a control character is malformed HTTP, refused by uvicorn's parser with its
# own plain-text 400 before any app sees the request
FIELD_CHARS = st.characters(codec="utf-8", exclude_categories=("Cc", "Cs"))


@settings(FUZZ, max_examples=60)
@given(st.sampled_from(["GET /v1/models", "POST /v1/chat/completions", "GET /v1/batches",
                        "POST /v1/files", "GET /v1/files/x", "DELETE /v1/files/x",
                        "POST /v1/embeddings", "GET /health"]),
       st.one_of(st.none(), st.text(FIELD_CHARS, max_size=30).map(lambda t: "Bearer " + t),
                 st.sampled_from(["Basic abc", KEY, f"Bearer {KEY} ", f"bearer {KEY}",
                                  f"Bearer {KEY[:-1]}", ""])))
def test_wrong_auth(server: Server, call: str, auth: str | None) -> None:
    method, path = call.split(" ")
    headers = {} if auth is None else {"Authorization": auth.encode()}  # UTF-8 bytes too
    try:
        r = httpx.request(method, server.url + path, headers=headers, timeout=30)
    except httpx.LocalProtocolError:  # a header value httpx itself refuses to send
        return
    check(r)
    assert r.status_code == (200 if path == "/health" else 401)


@settings(FUZZ, max_examples=70)
@given(st.text(max_size=60), st.one_of(st.none(), st.text(max_size=8)),
       st.one_of(st.none(), st.text(max_size=40)))
def test_ids_and_queries(http: httpx.Client, ident: str, limit: str | None,
                         after: str | None) -> None:
    ident = quote(ident, safe="")
    check(http.get(f"/v1/files/{ident}"))
    check(http.delete(f"/v1/files/{ident}"))
    check(http.get(f"/v1/files/{ident}/content"))
    check(http.get(f"/v1/batches/{ident}"))
    check(http.post(f"/v1/batches/{ident}/cancel"))
    params = {k: v for k, v in (("limit", limit), ("after", after)) if v is not None}
    check(http.get("/v1/batches", params=params))


@settings(FUZZ, max_examples=150)
@given(st.lists(st.integers(1, 120), min_size=1, max_size=4), st.integers(1, 100),
       st.sampled_from(["x", "Is there a red shape? ", "é中 "]))
def test_a_batch_line_over_the_prompt_limit_is_that_line_s_error(
        tmp_path_factory: pytest.TempPathFactory, sizes: list[int], limit: int,
        piece: str) -> None:
    """The batch's input check (``batch_worker.input_errors``, what ``/v1/batches`` runs
    before the batch): lines whose questions are ``sizes`` characters long, under
    ``--max-prompt-chars limit``: an error for exactly the first line over it (the check
    stops at a line's refusal), ``context_length_exceeded``, else none. Not counted in
    ``SEEN`` (no request)."""
    path = tmp_path_factory.getbasetemp() / "limit.jsonl"
    url = data_url(IMAGES / "scene_00.png")
    texts = [(piece * n)[:n] for n in sizes]
    path.write_text(batch_lines([(f"c{i}", url, t) for i, t in enumerate(texts)]))
    got = input_errors(path, ServerConfig(max_prompt_chars=limit))
    over = [i + 1 for i, t in enumerate(texts) if len(t) > limit]
    assert [(e["line"], e["code"]) for e in got] == [(line, "context_length_exceeded")
                                                     for line in over[:1]], got


def test_huge_and_empty_inputs(http: httpx.Client) -> None:
    url = data_url(IMAGES / "scene_00.png")
    cases = [
        ("/v1/chat/completions", chat_body(url, "x" * (2 << 20))),  # 413
        ("/v1/chat/completions", chat_body(url, "y" * 50_000)),  # over --max-prompt-chars
        ("/v1/chat/completions", chat_body(url, "")), ("/v1/chat/completions", {}),
        ("/v1/chat/completions", {**template(), "messages": []}),
        ("/v1/chat/completions", {**template(), "messages": [{"role": "user", "content": []}]}),
        ("/v1/chat/completions", {**template(), "messages": [{"role": "system",
                                                              "content": "only"}]}),
        ("/v1/chat/completions", chat_body(url, "q", max_tokens=10 ** 30)),
        ("/v1/embeddings", {"model": "vlmbatch", "input": ["z" * (2 << 20)]}),
        ("/v1/embeddings", {"model": "vlmbatch", "input": [[1] * 150_000, [2] * 160_000]}),
        ("/v1/batches", {"input_file_id": "x" * 100_000, "endpoint": "/v1/chat/completions",
                         "completion_window": "24h"}),
    ]
    for path, body in cases:
        check(http.post(path, content=json.dumps(body),
                        headers={"content-type": "application/json"}))
    for depth in (5_000, 100_000):  # nested deeper than Python's JSON parser recurses
        for path in ("/v1/chat/completions", "/v1/embeddings", "/v1/batches"):
            check(http.post(path, content="[" * depth + "]" * depth,
                            headers={"content-type": "application/json"}))
    check(http.post("/v1/files", files={"file": ("x.jsonl", b"x" * (2 << 20))},
                    data={"purpose": "batch"}))
    check(http.post("/v1/files", files={"nofile": ("x", b"x")}, data={"purpose": "batch"}))
    assert 413 in SEEN


def test_the_server_still_answers(http: httpx.Client) -> None:
    assert len(SEEN) >= MIN_CASES, len(SEEN)
    assert not [s for s in SEEN if s >= 500]
    r = http.post("/v1/chat/completions", json=template())
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    assert http.get("/health").status_code == 200
    print(f"fuzz: {len(SEEN)} requests, statuses {sorted(set(SEEN))}, 0 with 5xx")
