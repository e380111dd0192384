"""``/v1/embeddings`` against a stand-in embedder (the real one is being built on the
embeddings branch): what the request may hold, what reaches the embedder, the float and
base64 encodings (the official client's default, decoded by it), ``dimensions``, ``usage``
and the limits. Without an embedder a valid request is a 501 (``test_server.py``)."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.loopback import free_port
from tests.server.fakes import FakeEmbedBackend, fake_server
from tests.server.serving import IMAGES, data_url
from vlmbatch.server.config import ServerConfig


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    embedder = FakeEmbedBackend()
    cfg = ServerConfig(data_dir=tmp_path_factory.mktemp("emb"), port=free_port(),
                       allowed_local_media_path=IMAGES)
    with fake_server(cfg, embedder) as (url, _):
        yield url, embedder


@pytest.fixture
def http(served):  # noqa: ANN001, ANN201
    with httpx.Client(base_url=served[0], timeout=30) as c:
        yield c


def post(http: httpx.Client, **body: object) -> httpx.Response:
    return http.post("/v1/embeddings", json={"model": "vlmbatch", **body})


def test_the_clients_base64_default_decodes_to_our_floats(served) -> None:  # noqa: ANN001
    client = openai.OpenAI(api_key="none", base_url=served[0] + "/v1", max_retries=0)
    texts = ["a red circle", "two blue squares"]
    default = client.embeddings.create(model="vlmbatch", input=texts)  # asks for base64
    floats = client.embeddings.create(model="vlmbatch", input=texts, encoding_format="float")
    embedder = served[1]
    want = [embedder.vector(x, 8) for x, in zip(embedder.calls[-1][0])]
    for a, b, w in zip(default.data, floats.data, want):
        assert a.embedding == b.embedding == pytest.approx(w.tolist(), abs=0)
    assert default.usage.prompt_tokens == default.usage.total_tokens == 14 + 18
    assert [d.index for d in default.data] == [0, 1]


def test_input_forms_reach_the_embedder(http: httpx.Client, served) -> None:  # noqa: ANN001
    embedder = served[1]
    for inp, kinds in [("one", ["one"]), (["a", "b"], ["a", "b"]), ([5, 6, 7], [(5, 6, 7)]),
                       ([[1, 2], [3]], [(1, 2), (3,)])]:
        r = post(http, input=inp)
        assert r.status_code == 200, r.text
        got = [x.text if x.text is not None else x.token_ids for x in embedder.calls[-1][0]]
        assert got == kinds and len(r.json()["data"]) == len(kinds)
    png = (IMAGES / "scene_00.png").read_bytes()
    r = post(http, input=[data_url(IMAGES / "scene_00.png"), (IMAGES / "scene_01.png").as_uri()],
             modality="image")
    assert r.status_code == 200, r.text
    assert [x.image for x in embedder.calls[-1][0]] == [
        png, (IMAGES / "scene_01.png").read_bytes()]
    r = http.post("/v1/embeddings", json={"model": "vlmbatch", "messages": [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(IMAGES / "scene_00.png")}},
            {"type": "text", "text": "Describe the image."}]}]})
    assert r.status_code == 200 and len(r.json()["data"]) == 1  # one per request
    (x,) = embedder.calls[-1][0]
    assert (x.text, x.image) == ("Describe the image.", png)


def test_dimensions_base64_is_little_endian_float32(http: httpx.Client) -> None:
    r = post(http, input="x", dimensions=3, encoding_format="base64")
    assert r.status_code == 200
    v = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert v.shape == (3,) and np.linalg.norm(v) == pytest.approx(1, abs=1e-6)
    f = post(http, input="x", dimensions=3).json()["data"][0]["embedding"]
    assert v.tolist() == f


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"), ({"input": ""}, "input[0]"), ({"input": ["a", ""]}, "input[1]"),
    ({"input": [[]]}, "input[0]"), ({"input": ["a"] * 2049}, "input"),
    ({"input": [[1] * 8193]}, "input[0]"), ({"input": [[1] * 8000] * 38}, "input"),
    ({"input": [-1]}, "input[0]"), ({"input": [1, "a"]}, "input[0]"), ({"input": True}, "input"),
    ({"input": "x", "encoding_format": "utf8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 9}, "dimensions"),  # over the model's 8
    ({"input": "x", "dimensions": "8"}, "dimensions"),
    ({}, "input"), ({"input": "x", "messages": [{"role": "user", "content": "y"}]}, "input"),
    ({"input": ["data:image/png;base64,@@"], "modality": "image"}, "input[0]"),
    ({"input": ["file:///etc/passwd"], "modality": "image"}, "input[0]"),
    ({"input": [[1, 2]], "modality": "image"}, "input[0]"),
    ({"input": "REFUSE this"}, "input[0]"),  # the embedder's own limit
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(IMAGES / "scene_00.png")}}] * 2}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "  "}]}, "messages"),
])
def test_invalid_requests_are_400s_naming_the_parameter(http: httpx.Client, body: dict,
                                                        param: str) -> None:
    r = post(http, **body)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param, r.json()


def test_unknown_model_is_404(http: httpx.Client, tmp_path: Path) -> None:
    r = http.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
