"""The soak of issue 30 (``bench/soak.py``): 20,000 chat requests from 64 concurrent clients
while a batch of 200 runs on ``vlmbatch serve``: no error other than 429s the clients
retried, the batch completed exactly once, the server's RSS (engine process included) flat
within 10% after the first 20% of the requests; p50/p99 printed. Slow (minutes on 2
cores); ``test_engines.py`` runs a trimmed one in CI."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.checks import Checks
from bench.soak import batch_once, check, run_soak, start_batch
from tests.server.serving import KEY, Server


@pytest.mark.slow  # 20,000 requests: ~5-10 min on 2 shared cores
def test_soak_20000_requests_64_clients_with_a_batch(tmp_path: Path) -> None:
    server = Server(tmp_path / "data", "--images-per-batch", "4").wait_ready(300)
    try:
        with server.client() as c:
            batch_id, ids = start_batch(c, 200)
            s = run_soak(server, 20000, 64, KEY)
            batch = batch_once(c, batch_id, ids, 600)
    finally:
        assert server.stop() in (0, 143), server.output()
    checks = Checks()
    check(s, batch, 0.2, checks)
    assert not checks.failed, checks.failed
