"""``/v1/files`` as OpenAI has them, on a stand-in engine (``fakes.py``), through the
official client: listing newest first (or oldest with ``order``), filtered by ``purpose``,
paged by ``limit``/``after`` (the client's auto-pagination iterator follows it);
``expires_after`` sets ``expires_at`` and a file past it is gone; a file a batch in
progress reads cannot be deleted (409) until the batch ends."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.loopback import free_port
from tests.server.fakes import fake_server
from tests.server.serving import IMAGES, batch_lines, data_url, upload, wait_batch
from vlmbatch.server.config import ServerConfig

HELD = "Is the batch held?"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    cfg = ServerConfig(data_dir=tmp_path_factory.mktemp("files"), port=free_port(),
                       allowed_local_media_path=IMAGES, embeddings=False, images_per_batch=1)
    with fake_server(cfg) as (url, engine):
        yield url, engine, cfg
        engine.hold.set()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(api_key="none", base_url=served[0] + "/v1", max_retries=0)


def line(cid: str, q: str = "Is there a red shape?") -> str:
    return batch_lines([(cid, data_url(IMAGES / "scene_00.png"), q)])


def test_list_orders_pages_and_filters(client: openai.OpenAI) -> None:
    made = [upload(client, line(f"l{i}")).id for i in range(5)]
    listed = [f.id for f in client.files.list(purpose="batch")]
    assert listed[:5] == made[::-1]  # newest first
    paged = [f.id for f in client.files.list(limit=2, purpose="batch")]  # follows `after`
    assert paged == listed and len(set(paged)) == len(paged)
    page = client.files.list(limit=2, order="asc")
    assert page.has_more and len(page.data) == 2
    oldest = [f.id for f in client.files.list(limit=3, order="asc")]
    assert oldest == listed[::-1]
    nxt = client.files.list(limit=2, after=made[3])  # desc: the ones made before it
    assert [f.id for f in nxt.data] == [made[2], made[1]]
    assert not [f for f in client.files.list(purpose="batch_output") if f.id in made]
    with pytest.raises(openai.BadRequestError):
        client.files.list(after="file-" + "0" * 32)
    with pytest.raises(openai.BadRequestError):
        client.files.list(order="sideways")  # type: ignore[arg-type]


def test_expires_after_then_gone(client: openai.OpenAI, served) -> None:  # noqa: ANN001
    f = upload(client, line("e0"), expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.expires_at == f.created_at + 3600
    assert client.files.retrieve(f.id).expires_at == f.expires_at
    assert upload(client, line("e1")).expires_at is None
    meta = Path(served[2].files_dir) / f"{f.id}.json"
    rec = json.loads(meta.read_text())
    meta.write_text(json.dumps({**rec, "expires_at": int(time.time()) - 1}))  # its time came
    assert f.id not in [x.id for x in client.files.list()]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    assert not (Path(served[2].files_dir) / f.id).exists()  # its bytes removed
    for bad in ({"anchor": "created_at", "seconds": 10}, {"anchor": "last_active_at",
                                                         "seconds": 3600}):
        with pytest.raises(openai.BadRequestError):
            upload(client, line("e2"), expires_after=bad)


def test_a_file_a_running_batch_reads_cannot_be_deleted(client: openai.OpenAI,
                                                        served) -> None:  # noqa: ANN001
    engine = served[1]
    engine.hold_on = HELD
    f = upload(client, line("h0", HELD))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    assert engine.entered.wait(30)  # the batch's group is in the engine
    with pytest.raises(openai.ConflictError):
        client.files.delete(f.id)
    assert client.files.retrieve(f.id).id == f.id
    engine.hold.set()
    assert wait_batch(client, b.id, timeout=30).status == "completed"
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.delete(f.id)
    out = client.batches.retrieve(b.id).output_file_id
    assert out in [x.id for x in client.files.list(purpose="batch_output")]
    r = httpx.get(served[0] + "/v1/files", params={"limit": 0}, timeout=30)
    assert r.status_code == 400
