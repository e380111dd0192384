"""The session's shared ``vlmbatch serve`` (``server``, unless a module defines its own
with ``serving.server_fixture``): one start for every test that
neither kills nor reconfigures its server (``test_server.py``, ``test_embed_batches.py``,
``test_fuzz.py``), each server start being ~5 s of CI on 2 cores.

Its options are the union of what those tests need: file:// URLs from ``media`` (the
example images, plus the fuzz's ``ok.png`` and a ``link.png`` that points out of the
folder), a 1 MiB body limit, a 1,000,000-pixel limit, batch groups of 2 images slowed by
0.2 s each (so a batch is still running when a test cancels it or talks to the server
meanwhile)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.serving import IMAGES, Server


@pytest.fixture(scope="session")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The allowed local media folder: copies of the example images, ``ok.png``, and
    ``link.png``, a symlink to ``secret.png`` beside the folder (outside it)."""
    root = tmp_path_factory.mktemp("media")
    for p in IMAGES.glob("*.png"):
        shutil.copy(p, root / p.name)
    shutil.copy(IMAGES / "scene_00.png", root / "ok.png")
    shutil.copy(IMAGES / "scene_01.png", root.parent / "secret.png")
    os.symlink(root.parent / "secret.png", root / "link.png")
    return root


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, media: Path) -> Iterator[Server]:
    """The shared server (a module that needs its own defines ``server`` with
    ``serving.server_fixture``)."""
    s = Server(tmp_path_factory.mktemp("standard") / "data", "--allowed-local-media-path",
               str(media), "--max-body-mib", "1", "--max-pixels", "1000000",
               "--images-per-batch", "2", faults={"group_delay": 0.2}).wait_ready()
    yield s
    assert s.stop() in (0, 143), s.output()


@pytest.fixture
def client(server: Server):  # noqa: ANN201
    """The official ``openai`` client on the module's server."""
    return server.openai()
