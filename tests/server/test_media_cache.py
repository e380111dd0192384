"""The media cache (``server/media_cache.py``): an image is decoded once, whichever
request asks about it, however many ask at once; a different image never hits, not even one
of the same size, nor one whose hash collides (the bytes are compared); the budget holds,
counted. Decodes are counted where they happen: in the decoder (a stand-in ``PrepareWorkers``
that counts what it is given). Then on the shared real server, through ``/metrics``: the
second request about an image decodes nothing."""

from __future__ import annotations

import io
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.server.serving import IMAGES, Server, chat_body, data_url
from vlmbatch.pipeline.config import PrepareConfig
from vlmbatch.pipeline.preparers import prepare_now
from vlmbatch.pipeline.task import ImageRef
from vlmbatch.preprocessing.prepare import TilingConfig
from vlmbatch.server.media_cache import MediaCache
from vlmbatch.serving.errors import APIError

PLAN = TilingConfig(tile_size=16, max_tiles=2, use_thumbnail=False)
OPTS = PrepareConfig(decode_timeout=0).options("cpu")


class CountingDecoder:
    """A ``PrepareWorkers`` that decodes on the caller's thread and counts the images it is given;
    ``gate``: each decode waits for it (so that requests pile up on one in flight)."""

    def __init__(self) -> None:
        self.decoded: list[bytes] = []
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()

    def submit(self, ref: ImageRef) -> Future:
        with self.lock:
            assert isinstance(ref.image, bytes)
            self.decoded.append(ref.image)
        self.gate.wait(10)
        f: Future = Future()
        try:
            f.set_result(prepare_now(ref, PLAN, OPTS, None))
        except Exception as e:  # noqa: BLE001
            f.set_exception(e)
        return f

    def stop(self) -> None:
        pass


def png(seed: int, size: tuple[int, int] = (20, 20)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def cache(budget: int = 1 << 20, **kw: object) -> tuple[MediaCache, CountingDecoder]:
    decoder = CountingDecoder()
    return MediaCache(PLAN, OPTS, None, budget, decoder, **kw), decoder  # type: ignore[arg-type]


def test_a_second_request_decodes_nothing() -> None:
    c, decoder = cache()
    a = png(0)
    first = c.prepare(a)
    assert decoder.decoded == [a]
    assert c.get(a) is first and c.prepare(a) is first  # the same prepared image
    assert decoder.decoded == [a]  # decoded once
    assert (c.stats().hits, c.stats().misses) == (2, 1)


def test_concurrent_requests_for_a_new_image_decode_it_once() -> None:
    c, decoder = cache()
    decoder.gate.clear()
    a = png(1)
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(c.prepare, a) for _ in range(8)]
        threading.Timer(0.3, decoder.gate.set).start()
        images = [f.result(10) for f in futures]
    assert decoder.decoded == [a] and all(im is images[0] for im in images)
    assert (c.stats().hits, c.stats().misses) == (7, 1)


def test_a_different_image_of_the_same_size_never_hits() -> None:
    c, decoder = cache()
    a, b = png(2), png(3)
    assert Image.open(io.BytesIO(a)).size == Image.open(io.BytesIO(b)).size == (20, 20)
    ia, ib = c.prepare(a), c.prepare(b)
    assert c.get(b) is ib and ia.cache_key != ib.cache_key
    assert decoder.decoded == [a, b] and c.stats().misses == 2


def test_a_colliding_hash_never_hits() -> None:
    """Every image hashes the same: the bytes, compared, keep them apart."""
    c, decoder = cache(hash_fn=lambda data: b"same")
    a, b = png(4), png(5)
    ia = c.prepare(a)
    assert c.get(b) is None  # same hash, other bytes
    ib = c.prepare(b)
    assert decoder.decoded == [a, b] and ia.cache_key != ib.cache_key
    assert np.array_equal(ib.rows, prepare_now(ImageRef(b, Path("/"), "b"), PLAN, OPTS,
                                               None).rows)
    # and two different images decoding at once under one hash both decode
    decoder.gate.clear()
    d, e = png(6), png(7)
    with ThreadPoolExecutor(2) as pool:
        fd, fe = pool.submit(c.prepare, d), pool.submit(c.prepare, e)
        threading.Timer(0.3, decoder.gate.set).start()
        assert fd.result(10).cache_key != fe.result(10).cache_key
    assert decoder.decoded[-2:] in ([d, e], [e, d])


def test_the_budget_holds_and_evictions_are_counted() -> None:
    one = cache()[0]
    size = len(png(10)) + one.prepare(png(10)).rows.nbytes
    c, decoder = cache(budget=2 * size + 10)
    for seed in (10, 11, 12):
        c.prepare(png(seed))
    s = c.stats()
    assert (s.entries, s.evictions) == (2, 1) and s.bytes <= 2 * size + 10
    c.prepare(png(10))  # the oldest was evicted: decoded again
    assert len(decoder.decoded) == 4
    big, _ = cache(budget=10)
    big.prepare(png(13))
    assert big.stats().entries == 0  # over the budget: not kept


def test_a_bad_image_is_a_400_and_not_kept() -> None:
    c, decoder = cache()
    with pytest.raises(APIError) as e:
        c.prepare(b"not an image")
    assert e.value.status == 400 and e.value.code == "invalid_image"
    with pytest.raises(APIError):
        c.prepare(b"not an image")
    assert len(decoder.decoded) == 2 and c.stats().entries == 0


def test_reading_data_urls_and_refusals() -> None:
    c, _ = cache()
    path = IMAGES / "scene_00.png"
    assert c.read(data_url(path)) == (data_url(path), path.read_bytes())
    for url, code in [("data:image/png;base64,%%%", "invalid_image_url"),
                      ("file:///etc/passwd", "invalid_image_url"),
                      ("https://example.com/a.png", "invalid_image_url")]:
        with pytest.raises(APIError) as e:
            c.read(url)
        assert (e.value.status, e.value.code) == (400, code)


def media(server: Server) -> dict[str, float]:
    page = httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text
    return {s.name: s.value for fam in text_string_to_metric_families(page)
            for s in fam.samples if s.name.startswith("vlmbatch_media_cache")}


def test_the_server_decodes_an_image_once(server: Server) -> None:
    url = data_url(IMAGES / "scene_11.png")
    with server.client() as c:
        before = media(server)
        first = c.post("/v1/chat/completions", json=chat_body(url, "Is there a red shape?"))
        mid = media(server)
        again = c.post("/v1/chat/completions", json=chat_body(url, "Is there a circle?"))
        after = media(server)
    assert first.status_code == again.status_code == 200
    assert mid["vlmbatch_media_cache_misses_total"] \
        <= before["vlmbatch_media_cache_misses_total"] + 1  # unless another test had it
    assert after["vlmbatch_media_cache_misses_total"] == mid["vlmbatch_media_cache_misses_total"]
    assert after["vlmbatch_media_cache_hits_total"] == mid["vlmbatch_media_cache_hits_total"] + 1
    assert after["vlmbatch_media_cache_bytes"] > 0 and after["vlmbatch_media_cache_images"] >= 1

