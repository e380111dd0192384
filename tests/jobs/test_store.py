"""The job store's transactions: an interrupt (Ctrl-C, SIGTERM) inside one leaves nothing
half-written and nothing open for later writes to fall into."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.store import JobStore
from pipeline.records import Answer, ImageItem, Question


class InterruptedAfterFirst(dict):
    """Results whose iteration is interrupted after the first item, as a signal would."""

    def items(self):  # noqa: ANN201
        it = iter(super().items())
        yield next(it)
        raise KeyboardInterrupt


def store_of(path: Path, n: int) -> JobStore:
    store = JobStore(path)
    q = (Question("q0", "Red?"),)
    store.add_items((f"m:{i}", ImageItem(f"img{i}", f"{i}.png", q, path.parent))
                    for i in range(n))
    return store


def line(item: str) -> Answer:
    return Answer(item, "q0", "Red?", "yes", 0.9, 2.0, 16)


def test_an_interrupted_record_is_rolled_back_and_later_writes_are_kept(tmp_path: Path) -> None:
    store = store_of(tmp_path / "s.sqlite", 3)
    store.set("status", "running")
    with pytest.raises(KeyboardInterrupt):
        store.record(InterruptedAfterFirst({"img0": [line("img0")], "img1": [line("img1")]}))
    assert not store.db.in_transaction
    store.set("status", "interrupted")  # what the run's cleanup writes next
    store.close()
    again = JobStore(tmp_path / "s.sqlite")
    assert again.get("status") == "interrupted"
    assert again.counts().pending == 3  # img0's half of the group is not kept either
    assert again.record({"img0": [line("img0")]}) == 1 and again.counts().done == 1
    again.close()


def test_an_interrupted_submit_adds_nothing(tmp_path: Path) -> None:
    store = store_of(tmp_path / "s.sqlite", 2)

    def items():  # noqa: ANN202
        yield "m:9", ImageItem("img9", "9.png", (Question("q0", "Red?"),), tmp_path)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.add_items(items())
    store.set("note", "kept")
    store.close()
    again = JobStore(tmp_path / "s.sqlite")
    assert again.counts().pending == 2 and again.get("note") == "kept"
    again.close()
