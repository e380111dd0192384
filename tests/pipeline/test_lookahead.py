"""The drive's look-ahead over remote images (``pipeline/drive.py`` ``Lookahead``), by counts
against a real server on loopback (``tests/loopback.py``), never by time: while the model
holds a group, ``fetch.concurrency`` fetches are in flight; what is fetched and decoded ahead
stays within the windows; every image is fetched once and the groups come out in order,
equal to the same images read from local files; closing cancels the fetches not started."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.loopback import LoopbackServer
from tests.pipeline.test_drive import assert_same, groups_of
from tests.waiting import wait_until
from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.drive import prepare_group, prepared_groups
from vlmbatch.pipeline.hooks import FaultHooks
from vlmbatch.pipeline.preparers import PrepareWorkers, preparer
from vlmbatch.pipeline.questions import Question
from vlmbatch.pipeline.records import ImageItem
from vlmbatch.pipeline.task import AnswerTask, ImageRef, Prepared
from vlmbatch.preprocessing.limits import FetchOptions
from vlmbatch.preprocessing.prepare import TilingConfig

TILING = TilingConfig(tile_size=56)
TASK = AnswerTask()
N, PER, AHEAD, C = 48, 4, 1, 8  # images, per group, groups decoded ahead, fetches at once
DECODING = AHEAD + 1  # groups in the decode window: the next one and AHEAD behind it


def opts(concurrency: int = C) -> PrepareOptions:
    """Threads (no decoder processes), so the hook counting decodes runs in this process."""
    return PrepareOptions(10**8, threads=2, ahead=AHEAD,
                          fetch=FetchOptions(concurrency=concurrency, timeout_s=30.0))


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """N PNGs of random pixels and sizes."""
    folder = tmp_path_factory.mktemp("lookahead")
    rng = np.random.default_rng(0)
    for i in range(N):
        h, w = (int(x) for x in rng.integers(20, 120, 2))
        cv2.imwrite(str(folder / f"{i}.png"), rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    return folder


@pytest.fixture
def server(images: Path) -> Iterator[LoopbackServer]:
    with LoopbackServer({p.name: p.read_bytes() for p in images.iterdir()}) as s:
        yield s
        s.gate.set()  # a test that failed holding requests lets them go


def items(folder: Path, where: callable) -> list[ImageItem]:  # type: ignore[valid-type]
    return [ImageItem(f"i{i}", where(i), (Question("q", "Red?"),), folder) for i in range(N)]


def assert_same_images(got: list[Prepared], folder: Path) -> None:
    """``got`` (the groups of ``items``, fetched) = the same images read from local files,
    group by group, item by item."""
    local = [prepare_group(TASK, g, TILING)
             for g in groups_of(items(folder, lambda i: f"{i}.png"), PER)]
    assert len(got) == len(local)
    for a, b in zip(got, local, strict=True):
        assert [it.id for it in a.items] == [it.id for it in b.items]
        assert not a.errors and not b.errors
        assert_same(dataclasses.replace(a, items=b.items), b)


def test_fetches_stay_in_flight_while_the_model_holds_a_group(images: Path,
                                                              server: LoopbackServer) -> None:
    """The first group is served at once; the others only when the gate opens: while the
    caller holds the first (the model busy), C requests wait at the server, no more (C
    threads), and then every image is read exactly once and each group equals its
    local-files twin, in order."""
    its = items(images, lambda i: server.url(f"/{'img' if i < PER else 'hold'}/{i}.png"))
    gen = prepared_groups(TASK, groups_of(its, PER), TILING, opts())
    got = [next(gen)]
    wait_until(lambda: server.in_flight == C, 10, f"{C} fetches in flight at once")
    assert sum(server.requests.values()) == PER + C  # the first group's and C held ones
    server.gate.set()
    got += list(gen)
    assert_same_images(got, images)
    assert sorted(server.requests.values()) == [1] * N, "an image fetched twice or never"


def test_what_is_fetched_and_decoded_ahead_stays_within_the_windows(
        images: Path, server: LoopbackServer) -> None:
    """With the caller at group k: images decoded (started) <= groups 0..k and the decode
    window behind it; images fetched <= those and C more (the bytes fetched but not being
    decoded: at most C images'); both bounds reached, so the counts are not vacuous."""
    decoded: list[str] = []
    lock = threading.Lock()

    def count(source: str) -> None:
        with lock:
            decoded.append(source)

    its = items(images, lambda i: server.url(f"/img/{i}.png"))
    size = {it.image: (images / f"{i}.png").stat().st_size for i, it in enumerate(its)}
    gen = prepared_groups(TASK, groups_of(its, PER), TILING, opts(),
                          FaultHooks(before_prepare=count))
    fetched = lambda: sum(server.requests.values())  # noqa: E731
    for k, group in enumerate(gen):
        assert not group.errors
        decode_bound = min(N, PER * (k + DECODING))
        fetch_bound = min(N, decode_bound + C)
        if k == 0:  # the windows fill up while the caller holds the first group
            wait_until(lambda b=fetch_bound: fetched() == b, 10, f"{fetch_bound} fetched")
            wait_until(lambda b=decode_bound: len(decoded) == b, 10, f"{decode_bound} decoded")
        with lock:
            held = sum(server.sent[p.removeprefix(server.base)] for p in
                       set(size) - set(decoded))  # fetched, not decoded: bytes
        assert len(decoded) <= decode_bound, (k, len(decoded))
        assert fetched() <= fetch_bound, (k, fetched())
        assert held <= C * max(size.values()), (k, held)
    assert fetched() == N and len(decoded) == N


class Recording:
    """A caller's long-lived workers (a server's, the Python API's), recording the fetches
    the look-ahead asks of them."""

    def __init__(self, inner: PrepareWorkers) -> None:
        self.inner, self.fetches = inner, []

    def fetch(self, ref: ImageRef) -> Future:
        self.fetches.append(self.inner.fetch(ref))
        return self.fetches[-1]

    def submit(self, ref: ImageRef, fetched: Future | None = None) -> Future:
        return self.inner.submit(ref, fetched)

    def stop(self) -> None:
        self.inner.stop()


def test_closing_cancels_the_fetches_not_started(images: Path, server: LoopbackServer) -> None:
    """Closed while C requests are held, on workers that stay running: once those are let
    go, every other fetch asked for was cancelled, and no other request was made."""
    its = items(images, lambda i: server.url(f"/{'img' if i < PER else 'hold'}/{i}.png"))
    workers = Recording(preparer(TILING, opts()))  # type: ignore[arg-type]
    try:
        gen = prepared_groups(TASK, groups_of(its, PER), TILING, opts(), workers=workers)
        next(gen)
        wait_until(lambda: server.in_flight == C, 10, f"{C} fetches in flight at once")
        gen.close()
        server.gate.set()
        wait_until(lambda: all(f.done() for f in workers.fetches), 10, "every fetch ended")
        assert len(workers.fetches) > PER + C  # some were still queued
        assert sum(not f.cancelled() for f in workers.fetches) == PER + C
        assert sum(server.requests.values()) == PER + C
    finally:
        workers.stop()
