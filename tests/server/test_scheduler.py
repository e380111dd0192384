"""The engine thread with a stand-in engine: concurrent requests share engine calls (one
image per distinct picture), a request that breaks the engine fails alone, and a running
batch job yields to interactive requests between its groups."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from pathlib import Path

import cv2
import pytest

from tests.server.fakes import FakeEngine, picture
from tests.waiting import wait_until
from vlmbatch.engine.config import EngineConfig
from vlmbatch.jobs.folder import status
from vlmbatch.jobs.job import submit
from vlmbatch.pipeline.questions import Question
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.server.batch_worker import BookEvents, batch_run_config
from vlmbatch.server.batches import BatchBook
from vlmbatch.server.config import ServerConfig
from vlmbatch.serving.errors import APIError
from vlmbatch.serving.scheduler import Scheduler


def work(engine: FakeEngine, seed: int, question: str) -> tuple[Question, PreparedImage]:
    return Question("q0", question), engine.image_plan.prepare(picture(seed))


@pytest.fixture
def started(tmp_path: Path):  # noqa: ANN201
    engine = FakeEngine()
    cfg = ServerConfig(data_dir=tmp_path, batch_wait_s=0.05, images_per_batch=1)
    book = BatchBook(cfg.batches_dir)
    drained: list[str] = []
    s = Scheduler(engine, cfg.serving, BookEvents(book, drained.append))
    s.start()
    yield engine, s, book, cfg, drained
    engine.hold.set()
    s.stop(10)


def test_concurrent_requests_share_one_call_and_each_image_once(started) -> None:  # noqa: ANN001
    engine, s, *_ = started
    engine.hold_on = "first"
    first = s.submit(*work(engine, 0, "first"))
    assert engine.entered.wait(5)
    futures = [s.submit(*work(engine, i % 3, f"q{i}")) for i in range(9)]  # 3 pictures
    engine.hold.set()
    assert first.result(5).p_yes == 0.25
    assert [f.result(5).prompt_tokens for f in futures] == [7] * 9
    assert len(engine.calls) == 2
    keys, questions = engine.calls[1]
    assert questions == [f"q{i}" for i in range(9)] and len(keys) == len(set(keys)) == 3


def test_a_request_that_breaks_the_engine_fails_alone(started) -> None:  # noqa: ANN001
    engine, s, *_ = started
    engine.hold_on = "first"
    s.submit(*work(engine, 0, "first"))
    assert engine.entered.wait(5)
    futures: list[Future] = [s.submit(*work(engine, 1, q)) for q in ("a", "boom", "b")]
    engine.hold.set()
    assert futures[0].result(5).p_yes == futures[2].result(5).p_yes == 0.25
    with pytest.raises(APIError, match="engine failed: RuntimeError") as e:
        futures[1].result(5)
    assert e.value.status == 500
    assert [qs for _, qs in engine.calls[1:]] == [["a", "boom", "b"], ["a"], ["boom"], ["b"]]


def test_a_batch_job_yields_to_interactive_requests(started, tmp_path: Path) -> None:  # noqa: ANN001
    engine, s, book, cfg, drained = started
    for i in range(6):
        cv2.imwrite(str(tmp_path / f"{i}.png"), picture(10 + i))
    lines = "".join(f'{{"id": "i{i}", "image": "{i}.png", "questions": ["group {i}"]}}\n'
                    for i in range(6))
    (tmp_path / "m.jsonl").write_text(lines)
    rec = book.create("/v1/chat/completions", "file-x", "24h", None)
    submit(batch_run_config(tmp_path / "m.jsonl", cfg), book.job_of(rec.id))
    book.update(rec.id, lambda r: r.at("in_progress"))
    engine.hold_on = "group 1"
    s.enqueue_batch(rec.id, book.job_of(rec.id))
    assert engine.entered.wait(10)  # the job's second group is in the engine
    chat = s.submit(*work(engine, 0, "interactive"))
    engine.hold.set()
    assert chat.result(10).p_yes == 0.25
    wait_until(lambda: drained, 10, "the batch drained")
    order = [qs[0] for _, qs in engine.calls]
    assert order.index("interactive") == order.index("group 1") + 1  # next, not after all
    assert drained == [rec.id] and order[-1] == "group 5"
    assert book.get(rec.id).status == "finalizing"


def test_stopping_leaves_a_running_job_resumable(started, tmp_path: Path) -> None:  # noqa: ANN001
    engine, s, book, cfg, drained = started
    for i in range(4):
        cv2.imwrite(str(tmp_path / f"{i}.png"), picture(20 + i))
    (tmp_path / "m.jsonl").write_text("".join(
        f'{{"id": "i{i}", "image": "{i}.png", "questions": ["g{i}"]}}\n' for i in range(4)))
    rec = book.create("/v1/chat/completions", "file-x", "24h", None)
    job = book.job_of(rec.id)
    submit(batch_run_config(tmp_path / "m.jsonl", cfg), job)
    book.update(rec.id, lambda r: r.at("in_progress"))
    engine.hold_on = "g1"
    s.enqueue_batch(rec.id, book.job_of(rec.id))
    assert engine.entered.wait(10)
    threading.Timer(0.2, engine.hold.set).start()
    s.stop(10)  # finishes the group in flight, then stops
    st = status(job)
    assert (st.status, st.done, st.pending) == ("interrupted", 2, 2) and not drained
    assert book.get(rec.id).status == "in_progress"  # the next start resumes it


def test_a_job_of_other_settings_fails_naming_them(started, tmp_path: Path) -> None:  # noqa: ANN001
    """A batch whose job this server cannot run (submitted with other engine settings) is
    failed, its errors naming the settings, never left in progress for a server that may
    never come (issue 38): a cancelled one is drained before it is tried."""
    engine, s, book, cfg, drained = started
    cv2.imwrite(str(tmp_path / "0.png"), picture(30))
    (tmp_path / "m.jsonl").write_text('{"id": "i0", "image": "0.png", "questions": ["q"]}\n')
    rec = book.create("/v1/chat/completions", "file-x", "24h", None)
    other = dataclasses.replace(cfg, engine=EngineConfig(prefix_cache=False))
    submit(batch_run_config(tmp_path / "m.jsonl", other), book.job_of(rec.id))
    book.update(rec.id, lambda r: r.at("in_progress"))
    s.enqueue_batch(rec.id, book.job_of(rec.id))
    assert s.cancel_batch(rec.id) is True  # still queued: the engine thread will end it
    wait_until(lambda: drained, 5, "the cancelled batch drained")
    assert drained == [rec.id]  # cancelled before it was tried
    rec2 = book.create("/v1/chat/completions", "file-x", "24h", None)
    submit(batch_run_config(tmp_path / "m.jsonl", other), book.job_of(rec2.id))
    book.update(rec2.id, lambda r: r.at("in_progress"))
    s.enqueue_batch(rec2.id, book.job_of(rec2.id))
    wait_until(lambda: not s.owns(rec2.id), 5, "the batch let go")
    failed = book.get(rec2.id)
    assert drained == [rec.id] and failed.status == "failed" and failed.times["failed_at"]
    (err,) = failed.errors
    assert err["code"] == "server_error" and "cannot run on this server" in err["message"]
    assert "engine.prefix_cache False (this server: True)" in err["message"]
    assert status(book.job_of(rec2.id)).pending == 1 and not engine.calls  # never run
    assert s.cancel_batch(rec2.id) is False  # so the caller finalizes a cancel itself
