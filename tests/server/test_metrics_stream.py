"""``GET /metrics`` and ``stream: true`` on a stand-in engine (``fakes.py``: every answer
p_yes 0.25, 7 prompt tokens): the page parses with ``prometheus_client``'s own parser and
its counters move by exactly what the test sent; a streamed yes/no answer is one chunk
with its logprobs (the official client's stream iterator), ``include_usage`` adds the
usage chunk, and the stream carries what the plain response carries."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.loopback import free_port
from tests.server.fakes import fake_server
from tests.server.serving import IMAGES, chat_body, data_url
from vlmbatch.server.config import ServerConfig

Q = "Is there a red shape?"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    cfg = ServerConfig(data_dir=tmp_path_factory.mktemp("metrics"), port=free_port(),
                       allowed_local_media_path=IMAGES, embeddings=False)
    with fake_server(cfg) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(api_key="none", base_url=served[0] + "/v1", max_retries=0)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def sample(page: dict, name: str, **labels: str) -> float:
    return page.get((name, tuple(sorted(labels.items()))), 0.0)


def ask(client: openai.OpenAI, image: str, **extra: object):  # noqa: ANN201
    return client.chat.completions.create(
        model="vlmbatch", max_tokens=1, **extra,  # type: ignore[call-overload]
        messages=chat_body(data_url(IMAGES / image), Q)["messages"])


def test_a_yes_no_streams_as_one_chunk_with_its_logprobs(client: openai.OpenAI) -> None:
    plain = ask(client, "scene_01.png", logprobs=True, top_logprobs=2)
    chunks = list(ask(client, "scene_01.png", logprobs=True, top_logprobs=2, stream=True))
    assert len(chunks) == 1  # no usage chunk unless asked for
    (c,) = chunks[0].choices
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].usage is None
    assert c.delta.role == "assistant" and c.delta.content == plain.choices[0].message.content
    assert c.delta.content == "no" and c.finish_reason == "stop"  # p_yes 0.25
    top = {t.token: math.exp(t.logprob) for t in c.logprobs.content[0].top_logprobs}
    assert top["yes"] == pytest.approx(1 / (1 + math.e), abs=1e-6)  # sigmoid(margin -1)
    assert top == {t.token: math.exp(t.logprob)
                   for t in plain.choices[0].logprobs.content[0].top_logprobs}


def test_include_usage_adds_a_last_chunk_of_usage(client: openai.OpenAI) -> None:
    chunks = list(ask(client, "scene_02.png", stream=True,
                      stream_options={"include_usage": True}))
    assert len(chunks) == 2 and chunks[0].usage is None and chunks[1].choices == []
    u = chunks[1].usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (7, 1, 8)
    assert chunks[0].id == chunks[1].id
    plain = ask(client, "scene_02.png").usage
    assert (plain.prompt_tokens, plain.completion_tokens) == (7, 1)


def test_stream_options_without_stream_is_a_400(served) -> None:  # noqa: ANN001
    body = chat_body(data_url(IMAGES / "scene_00.png"), Q,
                     stream_options={"include_usage": True})
    r = httpx.post(served[0] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_metrics_count_what_was_asked(served, client: openai.OpenAI) -> None:  # noqa: ANN001
    url = served[0]
    before = scrape(url)
    for i in (4, 5, 6):  # images no other test asks about: each prefilled whole
        ask(client, f"scene_0{i}.png")
    list(ask(client, "scene_07.png", stream=True))
    ask(client, "scene_04.png")  # asked again: 5 of its 7 prompt tokens cached
    with pytest.raises(openai.BadRequestError):
        ask(client, "scene_00.png", n=2)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_" + "0" * 32)
    after = scrape(url)

    def moved(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    chat = "/v1/chat/completions"
    assert moved("vlmbatch_requests_total", endpoint=chat, status="200") == 5
    assert moved("vlmbatch_requests_total", endpoint=chat, status="400") == 1
    assert moved("vlmbatch_requests_total", endpoint="/v1/batches/{id}", status="404") == 1
    assert moved("vlmbatch_request_duration_seconds_count", endpoint=chat) == 6
    assert moved("vlmbatch_request_duration_seconds_bucket", endpoint=chat, le="+Inf") == 6
    assert moved("vlmbatch_questions_answered_total", source="interactive") == 5
    assert moved("vlmbatch_prompt_tokens_total", kind="prefilled") == 4 * 7 + 2
    assert moved("vlmbatch_prompt_tokens_total", kind="cached") == 5
    prompt = sum(sample(after, "vlmbatch_prompt_tokens_total", kind=k)
                 for k in ("prefilled", "cached"))
    assert sample(after, "vlmbatch_prefix_cache_hit_rate") == pytest.approx(
        sample(after, "vlmbatch_prompt_tokens_total", kind="cached") / prompt)
    assert moved("vlmbatch_requests_total", endpoint="/metrics", status="200") == 1
    assert sample(after, "vlmbatch_engine_up", engine="0") == 1
    assert sample(after, "vlmbatch_queue_depth", engine="0", queue="interactive") == 0
    assert sample(after, "vlmbatch_engine_restarts_total") == 0
    assert sample(after, "vlmbatch_batches", state="completed") == 0
