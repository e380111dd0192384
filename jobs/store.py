"""The job store: one SQLite file per job holding every item, its state and its result.

Exactly once: an item's result lines and its state change are written in one transaction,
and only while the item is still ``pending`` (``UPDATE ... WHERE state = 'pending'``), so a
crash leaves each item either untouched or finished, never half-recorded, and an item answered
twice (a retried batch) is recorded once. A killed driver loses at most the group in flight;
``resume`` picks up the items still pending.

Tables::

    meta(key, value)                          status, cancel flag, created time, the current
                                              run's start, pid and host
    items(idx, item_id, spec, state, result,  idx = manifest order; spec = the ImageItem as
          lines, answered)                    JSON; state pending | done | failed;
                                              result = JSON list of result lines; lines and
                                              answered count them (what status sums)
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from jobs.errors import ManifestError
from pipeline.records import Answer, ImageItem, Question

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS items (
    idx INTEGER PRIMARY KEY,
    item_id TEXT NOT NULL UNIQUE,
    spec TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'done', 'failed')),
    result TEXT,
    updated REAL,
    lines INTEGER NOT NULL DEFAULT 0,
    answered INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS items_state ON items (state, idx);
"""
# An item's answered lines, parsed from its stored result (record() counts them in Python
# with the same rule: no error, or an empty one); for stores from before the column.
ANSWERED_OF_RESULT = ("(SELECT COUNT(*) FROM json_each(items.result) "
                      "WHERE COALESCE(json_extract(value, '$.error'), '') = '')")


@dataclass(frozen=True)
class Counts:
    pending: int
    done: int
    failed: int

    @property
    def total(self) -> int:
        return self.pending + self.done + self.failed


class Recorded(Protocol):
    """A result the store keeps: an ``Answer`` or an ``Embedding`` (its ``record()`` is one
    JSON object of an item's ``result`` list; ``error`` is None when it succeeded)."""
    @property
    def error(self) -> str | None: ...

    def record(self) -> dict[str, Any]: ...


def by_item(answers: list[Answer]) -> dict[str, list[Answer]]:
    """A group's answers keyed by image id, in order (what ``JobStore.record`` takes)."""
    out: dict[str, list[Answer]] = {}
    for a in answers:
        out.setdefault(a.image_id, []).append(a)
    return out


def item_to_json(item: ImageItem) -> str:
    if not isinstance(item.image, str):
        raise ManifestError(f"item {item.id!r}: a job stores image paths or URLs, not "
                            f"{type(item.image).__name__}")
    return json.dumps({"id": item.id, "image": item.image, "base_dir": str(item.base_dir),
                       "questions": [_question_json(q) for q in item.questions]})


def _question_json(q: Question) -> list:
    """[id, text, threshold], plus max_new_tokens when set (stores stay readable by
    versions that know three fields, unless a question uses the fourth)."""
    fields = [q.id, q.text, q.threshold]
    return fields if q.max_new_tokens is None else [*fields, q.max_new_tokens]


def item_from_json(text: str) -> ImageItem:
    d = json.loads(text)
    return ImageItem(d["id"], d["image"], tuple(Question(*q) for q in d["questions"]),
                     Path(d["base_dir"]))


class JobStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        # isolation_level=None: explicit BEGIN/COMMIT, so each record() is one transaction
        self.db = sqlite3.connect(self.path, isolation_level=None, timeout=30)
        try:
            self.db.execute("PRAGMA journal_mode=WAL")  # `status` may read while `run` writes
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.executescript(SCHEMA)
            self._add_counts()
        except sqlite3.DatabaseError as e:
            self.db.close()
            if "not a database" in str(e) or "malformed" in str(e):
                raise ManifestError(f"{self.path} is not a readable job store ({e}); the job "
                                    "folder is damaged: submit the job again") from None
            raise ManifestError(f"cannot open the job store {self.path}: {e} (check the "
                                "folder's permissions and free space)") from None

    def _add_counts(self) -> None:
        """Stores written before the lines/answered columns get them, filled in."""
        cols = {row[1] for row in self.db.execute("PRAGMA table_info(items)")}
        if "answered" in cols:
            return
        with self._transaction():
            if "answered" in {row[1] for row in self.db.execute("PRAGMA table_info(items)")}:
                return  # another process added them meanwhile
            self.db.execute("ALTER TABLE items ADD COLUMN lines INTEGER NOT NULL DEFAULT 0")
            self.db.execute("ALTER TABLE items ADD COLUMN answered INTEGER NOT NULL DEFAULT 0")
            self.db.execute(f"UPDATE items SET lines = json_array_length(result), "
                            f"answered = {ANSWERED_OF_RESULT} WHERE state != 'pending'")

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _transaction(self, begin: str = "BEGIN IMMEDIATE") -> Iterator[None]:
        """One transaction: committed if the block ends normally, rolled back on any
        exception, Ctrl-C and SIGTERM included (else later writes, such as the run's final
        status, would join the open transaction and be lost when the store closes)."""
        self.db.execute(begin)
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def add_items(self, items: Iterable[tuple[str, Any]],
                  first: Callable[[str], str] | None = None,
                  to_json: Callable[[Any], str] = item_to_json,
                  key: Callable[[Any], str] = lambda item: item.id) -> int:
        """Insert (where, item) pairs in one transaction: all or nothing. A repeated id raises
        ManifestError naming ``where`` (e.g. ``manifest.jsonl:12``) and ``first(id)``, where
        the id came first (e.g. ``line 3``). ``to_json``/``key``: how an item is stored and
        keyed (an ``ImageItem`` by default; ``jobs/tasks.py`` gives an embedding job's)."""
        n = 0
        with self._transaction("BEGIN"):
            for n, (where, item) in enumerate(items, 1):
                item_id = key(item)
                try:
                    self.db.execute("INSERT INTO items (item_id, spec) VALUES (?, ?)",
                                    (item_id, to_json(item)))
                except sqlite3.IntegrityError:
                    also = f" (first on {first(item_id)})" if first else ""
                    raise ManifestError(f"{where}: id {item_id!r} appears twice{also}") from None
        return n

    def pending(self, batch: int, from_json: Callable[[str], Any] = item_from_json
                ) -> Iterator[list[Any]]:
        """Pending items in manifest order, ``batch`` at a time (re-queried each time, so
        items recorded meanwhile are never handed out again); ``from_json`` reads a stored
        item (an ``ImageItem`` by default)."""
        last = 0
        while True:
            rows = self.db.execute(
                "SELECT idx, spec FROM items WHERE state = 'pending' AND idx > ? "
                "ORDER BY idx LIMIT ?", (last, batch)).fetchall()
            if not rows:
                return
            last = rows[-1][0]
            yield [from_json(spec) for _, spec in rows]

    def record(self, results: Mapping[str, Sequence[Recorded]]) -> int:
        """Store each item's answers (or embedding) and mark it done/failed, in one
        transaction. Returns how many items were recorded (items no longer pending are
        skipped)."""
        now = time.time()
        n = 0
        with self._transaction():
            for item_id, answers in results.items():
                answered = sum(1 for a in answers if not a.error)
                state = "done" if answered == len(answers) else "failed"
                text = json.dumps([a.record() for a in answers], ensure_ascii=False)
                cur = self.db.execute(
                    "UPDATE items SET state = ?, result = ?, updated = ?, lines = ?, "
                    "answered = ? WHERE item_id = ? AND state = 'pending'",
                    (state, text, now, len(answers), answered, item_id))
                n += cur.rowcount
        return n

    def requeue_failed(self) -> int:
        """Mark every failed item pending again (its old lines are dropped when it is
        recorded anew); returns how many."""
        with self._transaction():
            return self.db.execute(
                "UPDATE items SET state = 'pending' WHERE state = 'failed'").rowcount

    def counts(self) -> Counts:
        rows = dict(self.db.execute("SELECT state, COUNT(*) FROM items GROUP BY state"))
        return Counts(rows.get("pending", 0), rows.get("done", 0), rows.get("failed", 0))

    def questions_done(self) -> int:
        """Result lines recorded (answered or failed)."""
        row = self.db.execute("SELECT COALESCE(SUM(lines), 0) FROM items "
                              "WHERE state != 'pending'").fetchone()
        return int(row[0])

    def questions_answered(self) -> int:
        """Result lines recorded without an error (what QPM counts)."""
        row = self.db.execute("SELECT COALESCE(SUM(answered), 0) FROM items "
                              "WHERE state != 'pending'").fetchone()
        return int(row[0])

    def answers(self) -> Iterator[Answer]:
        """Every recorded answer, in manifest then question order."""
        return (Answer.from_record(d) for d in self.records())

    def records(self) -> Iterator[dict[str, Any]]:
        """Every recorded result object (what ``record()`` stored), in manifest order."""
        for (text,) in self.db.execute(
                "SELECT result FROM items WHERE state != 'pending' ORDER BY idx"):
            yield from json.loads(text)

    def get(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def set(self, key: str, value: str) -> None:
        self.db.execute("INSERT INTO meta (key, value) VALUES (?, ?) "
                        "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))

    def begin_run(self, c: Counts, host: str) -> None:
        """Mark a run as started by this process on ``host`` (what ``status`` computes QPM,
        ETA and the runner from)."""
        self.set("cancel", "0")
        self.set("status", "running")
        self.set("run_started", str(time.time()))
        self.set("run_answered_at_start", str(self.questions_answered()))
        self.set("run_items_at_start", str(c.done + c.failed))
        self.set("run_pid", str(os.getpid()))
        self.set("run_host", host)
        self.db.execute("DELETE FROM meta WHERE key = 'run_ended'")

    def end_run(self, final: str) -> None:
        """Mark the run ended: ``final`` (interrupted, cancelled), or done if nothing is
        pending."""
        self.set("status", final if self.counts().pending else "done")
        self.set("run_ended", str(time.time()))
