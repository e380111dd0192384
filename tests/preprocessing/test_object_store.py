"""``s3://`` images through fsspec (s3fs) against a real S3 API server on loopback (moto in
server mode, ``tests/s3_server.py``), found through ``AWS_ENDPOINT_URL`` as the SDK reads it:
bytes, a member's byte range, and the item errors (not found, too large, a missing extra)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.s3_server import s3_server
from vlmbatch.preprocessing.fetch import Fetcher
from vlmbatch.preprocessing.limits import FetchOptions
from vlmbatch.preprocessing.sources import MemberRef, SourceError

pytest.importorskip("s3fs")
DATA = bytes(range(256)) * 40


def test_s3_objects_read_through_the_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    with s3_server(monkeypatch, {"a/b.png": DATA}), Fetcher(FetchOptions(retries=1)) as f:
        assert f.fetch("s3://images/a/b.png", Path("/")) == DATA
        assert f.fetch(MemberRef("s3://images/a/b.png", "k.png", 10, 90), Path("/")) \
            == DATA[10:100]
        for url, reason in [("s3://images/a/none.png", "not_found"),
                            ("s3://no-such-bucket/b.png", "not_found")]:
            with pytest.raises(SourceError) as e:
                f.fetch(url, Path("/"))
            assert e.value.reason == reason, e.value
    with s3_server(monkeypatch, {"a/b.png": DATA}), \
            Fetcher(FetchOptions(max_bytes=1000)) as f:
        with pytest.raises(SourceError) as e:
            f.fetch("s3://images/a/b.png", Path("/"))
        assert e.value.reason == "too_large"


def test_a_store_without_its_extra_names_it() -> None:
    with Fetcher() as f, pytest.raises(SourceError, match=r"vlmbatch\[gcs\]|vlmbatch\[azure\]"):
        f.fetch("gs://bucket/x.png" if not _has("gcsfs") else "az://c/x.png", Path("/"))


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
