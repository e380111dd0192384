"""How ``--engines N`` spreads requests (``serving/processes.py``
``EngineProcesses._pick``), on engine process objects that are never started: one image's
requests go to one engine (its prefix cache), different images over all of them, an engine
``SPREAD`` requests busier than the least loaded one gives its request away, a full queue
is a 429 and no engine up a 503 with ``Retry-After``."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from tests.server.fakes import FakeEngine, picture
from vlmbatch.server.config import ServerConfig
from vlmbatch.serving.errors import APIError
from vlmbatch.serving.processes import SPREAD, EngineProcesses


@pytest.fixture
def pool(tmp_path):  # noqa: ANN001, ANN201
    p = EngineProcesses(ServerConfig(data_dir=tmp_path, engines=3, max_queue=50).serving)
    for e in p.procs:
        e.up = True
    return p


def keys(n: int) -> list[str]:
    """Cache keys of ``n`` random pictures, as the HTTP process prepares them."""
    plan = FakeEngine().image_plan
    return [plan.prepare(picture(seed)).cache_key for seed in range(n)]


def test_one_image_one_engine_many_images_all(pool: EngineProcesses) -> None:
    ks = keys(60)
    homes = [pool._pick(k) for k in ks]
    assert [pool._pick(k) for k in ks] == homes  # the same engine every time
    assert {e.index for e in homes} == {0, 1, 2}


def test_a_busy_engine_gives_its_request_to_the_least_loaded(pool: EngineProcesses) -> None:
    k = keys(1)[0]
    home = pool._pick(k)
    home.outstanding = {i: (Future(), []) for i in range(SPREAD + 1)}
    other = pool._pick(k)
    assert other is not home and len(other.outstanding) == 0
    home.outstanding = {i: (Future(), []) for i in range(SPREAD)}
    assert pool._pick(k) is home  # not yet past the spread


def test_full_is_429_and_none_up_is_503_with_retry_after(pool: EngineProcesses) -> None:
    for e in pool.procs:
        e.outstanding = {i: (Future(), []) for i in range(50)}
    with pytest.raises(APIError) as full:
        pool._pick(keys(1)[0])
    assert full.value.status == 429
    for e in pool.procs:
        e.up = False
    pool.retry_after = 7
    with pytest.raises(APIError) as down:
        pool._pick(keys(1)[0])
    assert down.value.status == 503 and down.value.headers() == {"Retry-After": "7"}
