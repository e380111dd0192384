"""The fetch stage against a real HTTP server on loopback (``tests/loopback.py``): pooled
concurrent fetches, retries on 503 and 429 (``Retry-After`` honoured, or refused when too
long), bounded redirects, a size cap that refuses before reading the body, timeouts, status
codes as reasons, a refused connection, ``Range`` reads of a shard member, table rows."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tests.loopback import LoopbackServer
from vlmbatch.preprocessing.fetch import Fetcher, retry_after
from vlmbatch.preprocessing.limits import MAX_REDIRECTS, FetchOptions
from vlmbatch.preprocessing.sources import MemberRef, RowRef, SourceError

DATA = bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8))
FAST = FetchOptions(concurrency=8, timeout_s=5.0, retries=3, backoff_s=0.01)


@pytest.fixture(scope="module")
def server() -> LoopbackServer:
    with LoopbackServer({"a.bin": DATA}) as s:
        yield s


def fetch(url: str, opts: FetchOptions = FAST) -> bytes:
    with Fetcher(opts) as f:
        return f.fetch(url, Path("/"))


def failure(url: str, opts: FetchOptions = FAST) -> SourceError:
    with pytest.raises(SourceError) as e:
        fetch(url, opts)
    return e.value


def test_many_fetches_overlap_on_one_pool(server: LoopbackServer) -> None:
    """64 images that each take 300 ms: 32 threads keep (nearly) 32 requests in flight (300,
    not 100 ms: on a loaded machine, threads starting late overlapped 7 requests of 100 ms)."""
    server.max_in_flight = 0
    with Fetcher(FetchOptions(concurrency=32)) as f:
        start = time.perf_counter()
        futures = [f.submit(server.url(f"/slow/300/a.bin?{i}"), Path("/")) for i in range(64)]
        got = [x.result() for x in futures]
        took = time.perf_counter() - start
    assert got == [DATA] * 64
    assert server.max_in_flight >= 16, server.max_in_flight
    assert took < 64 * 0.3 / 4, took  # serial would be 19.2 s


def test_503_is_retried_until_it_succeeds_or_the_retries_run_out(server: LoopbackServer) -> None:
    assert fetch(server.url("/fail/2/a.bin")) == DATA
    assert server.requests["/fail/2/a.bin"] == 3
    e = failure(server.url("/fail/9/a.bin"))
    assert e.reason == "status" and "HTTP 503" in str(e)
    assert server.requests["/fail/9/a.bin"] == FAST.retries + 1


def test_retry_after_is_honoured(server: LoopbackServer) -> None:
    start = time.perf_counter()
    assert fetch(server.url("/retry-after/1/a.bin")) == DATA
    assert time.perf_counter() - start >= 1.0  # not the 10 ms backoff
    assert server.requests["/retry-after/1/a.bin"] == 2
    e = failure(server.url("/retry-after/3600/a.bin"))  # too long: fail now, not in an hour
    assert e.reason == "status" and "Retry-After 3600" in str(e)
    assert server.requests["/retry-after/3600/a.bin"] == 1


def test_retry_after_as_a_date() -> None:
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert retry_after("7") == 7.0 and retry_after(None) is None and retry_after("soon") is None


def test_redirects_are_followed_up_to_the_bound(server: LoopbackServer) -> None:
    assert fetch(server.url(f"/redirect/{MAX_REDIRECTS}/a.bin")) == DATA
    e = failure(server.url(f"/redirect/{MAX_REDIRECTS + 1}/a.bin"))
    assert e.reason == "redirects"


def test_a_body_over_the_cap_is_refused_before_it_is_read(server: LoopbackServer) -> None:
    start = time.perf_counter()
    e = failure(server.url("/big"))  # claims 1 GiB: refused on its Content-Length
    assert e.reason == "too_large" and time.perf_counter() - start < 5
    assert server.sent["/big"] < 8 << 20  # the server had written next to nothing
    capped = FetchOptions(max_bytes=1 << 20, backoff_s=0.01)
    e = failure(server.url("/chunked/16"), capped)  # no length: stopped once past the cap
    assert e.reason == "too_large" and "1,048,576" in str(e)
    assert fetch(server.url("/img/a.bin"), FetchOptions(max_bytes=len(DATA))) == DATA


def test_a_slow_server_times_out(server: LoopbackServer) -> None:
    start = time.perf_counter()
    e = failure(server.url("/slow/3000/a.bin"), FetchOptions(timeout_s=0.3, backoff_s=0.01))
    assert e.reason == "timeout" and time.perf_counter() - start < 2.5


@pytest.mark.parametrize(("code", "reason"), [(404, "not_found"), (403, "access_denied"),
                                              (401, "access_denied"), (400, "status"),
                                              (500, "status")])
def test_statuses_are_the_items_reasons(server: LoopbackServer, code: int, reason: str) -> None:
    e = failure(server.url(f"/status/{code}/x"))
    assert e.reason == reason and f"HTTP {code}" in str(e)
    retried = code >= 500
    assert server.requests[f"/status/{code}/x"] == (FAST.retries + 1 if retried else 1)


def test_a_refused_connection_is_retried_then_fails() -> None:
    with LoopbackServer() as s:
        url = s.url("/img/a.bin")
    e = failure(url)  # the server is gone: its port refuses
    assert e.reason == "connection" and f"{FAST.retries + 1} attempts" in str(e)


def test_a_shard_member_is_one_range_request(server: LoopbackServer, tmp_path: Path) -> None:
    ref = MemberRef(server.url("/img/a.bin"), "k.png", 100, 250)
    with Fetcher(FAST) as f:
        assert f.fetch(ref, Path("/")) == DATA[100:350]
        local = tmp_path / "s.tar"
        local.write_bytes(DATA)
        assert f.fetch(MemberRef(str(local), "k.png", 100, 250), Path("/")) == DATA[100:350]
        with pytest.raises(SourceError, match="shorter"):
            f.fetch(MemberRef(str(local), "k.png", 4900, 250), Path("/"))
    with pytest.raises(SourceError) as e:
        Fetcher(FetchOptions(max_bytes=100)).fetch(ref, Path("/"))
    assert e.value.reason == "too_large"


def test_table_rows_by_identity(tmp_path: Path, server: LoopbackServer) -> None:
    """Bytes, HF Image structs (bytes, or a path when there are none) and a row out of range,
    across row groups of a Parquet file and an Arrow stream file."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (tmp_path / "side.bin").write_bytes(b"side")
    cells = [{"bytes": bytes([i]) * 10, "path": None} for i in range(9)]
    cells[4] = {"bytes": None, "path": "side.bin"}
    cells[5] = {"bytes": None, "path": server.url("/img/a.bin")}
    cells[6] = {"bytes": None, "path": None}
    table = pa.table({"image": cells, "raw": [bytes([i]) * 3 for i in range(9)]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table, max_chunksize=4)
    with Fetcher(FAST) as f:
        for name in ("t.parquet", "t.arrow"):
            file = str(tmp_path / name)
            got = [f.fetch(RowRef(file, i, "image"), Path("/")) if i != 6 else None
                   for i in range(9)]
            assert got == [bytes([i]) * 10 for i in range(4)] + [b"side", DATA, None] + [
                bytes([i]) * 10 for i in (7, 8)]
            assert f.fetch(RowRef(file, 8, "raw"), Path("/")) == b"\x08" * 3
            for ref, reason in [(RowRef(file, 6, "image"), "not_found"),
                                (RowRef(file, 9, "image"), None),
                                (RowRef(file, 0, "nope"), None)]:
                with pytest.raises(SourceError) as e:
                    f.fetch(ref, Path("/"))
                assert reason is None or e.value.reason == reason
