"""An S3 API server on 127.0.0.1 for tests: ``moto`` in server mode (a real HTTP server the
SDKs talk to), started by the test, with the environment every AWS SDK reads pointed at it
(``AWS_ENDPOINT_URL``, fake credentials). Nothing leaves the loopback interface."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
       "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def s3_server(monkeypatch: pytest.MonkeyPatch, objects: dict[str, bytes],
              bucket: str = "images") -> Iterator[str]:
    """A moto S3 server holding ``objects`` (key -> bytes) in ``bucket``; yields its URL,
    which ``AWS_ENDPOINT_URL`` (and the fake credentials) name meanwhile."""
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        url = f"http://127.0.0.1:{server._server.server_port}"
        for k, v in {**ENV, "AWS_ENDPOINT_URL": url}.items():
            monkeypatch.setenv(k, v)
        s3 = boto3.client("s3", endpoint_url=url)
        s3.create_bucket(Bucket=bucket)
        for key, data in objects.items():
            s3.put_object(Bucket=bucket, Key=key, Body=data)
        yield url
    finally:
        server.stop()
