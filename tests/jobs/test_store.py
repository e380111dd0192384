"""The job store's transactions: an interrupt (Ctrl-C, SIGTERM) inside one leaves nothing
half-written and nothing open for later writes to fall into. A damaged store file, or one
from a newer version, is a message, never a traceback."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.jobs.test_job import submit_job
from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_ITEM_ERRORS, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.jobs.folder import STORE_FILE
from vlmbatch.jobs.store import JobStore
from vlmbatch.jobs.store_schema import STORE_VERSION
from vlmbatch.pipeline.questions import Question
from vlmbatch.pipeline.records import Answer, ImageItem


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


def _damaged(data: bytes) -> list[tuple[str, bytes]]:
    """A store file's bytes cut short, with bytes flipped, pages zeroed or overwritten."""
    page, size = 4096, len(data)
    rng = np.random.default_rng(0)
    out = [(f"cut to {n} bytes", data[:n]) for n in
           (0, 50, 99, page, size // 2, size - page, size - 1)]
    for at in (0, 18, 28, 60, 100, page + 3, size // 2, size - 100):
        flipped = bytearray(data)
        flipped[at:at + 8] = bytes(b ^ 0xFF for b in flipped[at:at + 8])
        out.append((f"8 bytes flipped at {at}", bytes(flipped)))
    for n in (1, size // page // 2, size // page - 1):
        zeroed = bytearray(data)
        zeroed[n * page:(n + 1) * page] = bytes(page)
        out.append((f"page {n + 1} zeroed", bytes(zeroed)))
        noise = bytearray(data)
        noise[n * page:(n + 1) * page] = rng.integers(0, 256, page, dtype=np.uint8).tobytes()
        out.append((f"page {n + 1} noise", bytes(noise)))
    return out


def test_a_damaged_store_is_a_message_never_a_traceback(tmp_path: Path, random_model_dir: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """Each damage through status, results and resume: it is noticed (exit 2, the message
    says the store is damaged and what to do) or, where SQLite cannot tell (it keeps no
    checksums: a flipped byte inside a value), the command works on what is there. Never
    another exception."""
    _, job = submit_job(tmp_path, random_model_dir, 30, "--wait", "--no-progress",
                        broken=3, rc=EXIT_ITEM_ERRORS)
    data = (job / STORE_FILE).read_bytes()
    outcomes: dict[str, int] = {}
    for i, (what, damaged) in enumerate(_damaged(data)):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(job, copy)
        (copy / STORE_FILE).write_bytes(damaged)
        for cmd in (["status"], ["results", "-o", str(tmp_path / "r.jsonl")],
                    ["resume", "--no-progress"]):
            capsys.readouterr()
            rc = main([cmd[0], str(copy), *cmd[1:]])
            err = capsys.readouterr().err
            assert rc in (EXIT_OK, EXIT_BAD_INPUT, EXIT_ITEM_ERRORS), (what, cmd, rc, err)
            if rc == EXIT_BAD_INPUT:
                assert ("is damaged" in err and "submit the job again" in err) or \
                    "holds no job store" in err, (what, err)
            key = "noticed" if rc == EXIT_BAD_INPUT else "worked"
            outcomes[key] = outcomes.get(key, 0) + 1
    assert outcomes["noticed"] >= 30 and sum(outcomes.values()) == 3 * len(_damaged(data))


def test_a_store_from_a_newer_version_is_refused_with_both_numbers(
        tmp_path: Path, random_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    _, job = submit_job(tmp_path, random_model_dir, 2)
    store = JobStore(job / STORE_FILE)
    assert store.get("schema") == str(STORE_VERSION)  # written at creation
    store.set("schema", str(STORE_VERSION + 1))
    store.close()
    for cmd in (["status"], ["results"], ["resume", "--no-progress"], ["cancel"]):
        capsys.readouterr()
        assert main([cmd[0], str(job), *cmd[1:]]) == EXIT_BAD_INPUT
        assert (f"{job / STORE_FILE} was written by a newer vlmbatch (job store version "
                f"{STORE_VERSION + 1}; this one reads up to {STORE_VERSION})"
                in capsys.readouterr().err)


def test_labels_are_kept_and_a_version_2_store_is_upgraded(tmp_path: Path) -> None:
    """Version 3 keeps each question's label in the item (the report marks answers right or
    wrong; before, a job's store dropped it). A version-2 store is the same tables: opened,
    it reads as it was and says version 3; read-only (an archive), it is read unchanged."""
    import sqlite3

    from vlmbatch.jobs.store import image_item_from_json, image_item_to_json
    from vlmbatch.jobs.store_schema import upgrade, version_of

    qs = (Question("red", "Red?", 0.3, expected="no"), Question("q1", "Blue?"),
          Question("c", "Colour?", choices=("a", "b"), expected="b"))
    item = ImageItem("i", "a.png", qs, tmp_path)
    assert image_item_from_json(image_item_to_json(item)) == item
    assert '"expected": "no"' in image_item_to_json(item) and '["q1", "Blue?", 0.5]' in \
        image_item_to_json(item)  # an unlabelled question keeps its short form
    path = tmp_path / "store.sqlite"
    store = store_of(path, 3)
    store.set("schema", "2")  # what a version-2 vlmbatch wrote
    store.close()
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    upgrade(db, path, read_only=True)
    assert version_of(db) == 2
    db.close()
    store = JobStore(path)
    assert store.get("schema") == "3" == str(STORE_VERSION)
    assert [it.id for group in store.pending(10)
            for it in group] == ["img0", "img1", "img2"]
    store.close()
