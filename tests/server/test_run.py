"""``vlmbatch serve``'s options become its ``ServerConfig``; one server per data folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vlmbatch.cli.args import parse
from vlmbatch.engine.config import ConfigError
from vlmbatch.server.config import API_KEY_ENV, ServerConfig, server_config
from vlmbatch.server.serve import _take_data_dir


def config(*argv: str) -> ServerConfig:
    return server_config(parse(["serve", *argv]).typed)


def test_options_and_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    d = config()
    assert (d.host, d.port, d.api_key, d.max_body_bytes) == ("127.0.0.1", 8000, None, 64 << 20)
    c = config("--port", "9", "--api-key", "k", "--max-body-mib", "3", "--batch-wait-ms", "2",
               "--allowed-local-media-path", str(tmp_path), "--images-per-batch", "4",
               "--max-pixels", "100", "--no-prefix-cache")
    assert (c.port, c.api_key, c.max_body_bytes, c.batch_wait_s, c.images_per_batch,
            c.prepare.max_pixels, c.engine.prefix_cache) == (9, "k", 3 << 20, 0.002, 4, 100, False)
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert config().api_key == "from-env" and config("--api-key", "typed").api_key == "typed"
    with pytest.raises(ConfigError, match="not a folder"):
        config("--allowed-local-media-path", str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="port"):
        config("--port", "70000")
    monkeypatch.setenv(API_KEY_ENV, "")
    with pytest.raises(ConfigError, match="must not be empty"):
        config()


def test_a_second_server_on_the_same_data_folder_is_refused(tmp_path: Path) -> None:
    fd = _take_data_dir(tmp_path / "data")
    try:
        with pytest.raises(ConfigError, match=f"in use by another vlmbatch server \\(pid "
                           f"{os.getpid()}\\)"):
            _take_data_dir(tmp_path / "data")
    finally:
        os.close(fd)
    os.close(_take_data_dir(tmp_path / "data"))  # free once the first has gone
