"""The job store: one SQLite file per job holding every item, its state and its result.

Exactly once: an item's result lines and its state change are written in one transaction,
and only while the item is still ``pending`` (``UPDATE ... WHERE state = 'pending'``), so a
crash leaves each item either untouched or finished, never half-recorded, and an item answered
twice (a retried batch) is recorded once. A killed driver loses at most the group in flight;
``resume`` picks up the items still pending.

Tables (``jobs/store_schema.py``: the layout, its version, migrations)::

    meta(key, value)                          schema version, status, cancel flag, created
                                              time, the current run's start, pid and host
    items(idx, item_id, spec, state, result,  idx = manifest order; spec = the ImageItem as
          lines, answered)                    JSON, its labels too; state pending | done |
                                              failed; result = JSON list of result lines;
                                              lines and answered count them
    totals(state, items, lines, answered)     their sums per state, kept by triggers (what
                                              status reads)

Every SQLite error reaches callers as ``StoreDamaged`` (a truncated or corrupted file) or an
``OSError`` naming the file (disk full, read-only, I/O error), never as a bare
``sqlite3.Error``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from vlmbatch.jobs.store_schema import StoreDamaged, create, store_error, upgrade
from vlmbatch.pipeline.media_inputs import ImageList, SamplingKeys, VideoInput
from vlmbatch.pipeline.questions import ManifestError, Question
from vlmbatch.pipeline.records import Answer, ImageItem, ImageSource, ItemMedia
from vlmbatch.preprocessing.sources import MemberRef, RowRef


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


def image_item_to_json(item: ImageItem) -> str:
    """An item as the store keeps it: its image as the path or URL, or as the reference of
    a table's row (``{"row": {file, row, column}}``) or a shard's member (``{"member":
    {shard, name, offset, size}}``): where the image is, never its bytes. Several images:
    ``{"images": [each so]}`` (``"per_image": true`` when each is asked alone); a clip:
    ``{"video": path or URL, "fps", "num_frames", "max_frames", "max_video_tokens",
    "segment_seconds", "segment_stride"}`` (its sampling keys as given; null: the run's)."""
    image = item.image
    if isinstance(image, ImageList):
        stored: object = {"images": [_image_json(s, item) for s in image.images],
                          **({"per_image": True} if image.per_image else {})}
    elif isinstance(image, VideoInput):
        stored = {"video": _image_json(image.source, item),
                  **dataclasses.asdict(image.sampling)}
    else:
        stored = _image_json(image, item)
    return json.dumps({"id": item.id, "image": stored, "base_dir": str(item.base_dir),
                       "questions": [_question_json(q) for q in item.questions]})


def _image_json(image: object, item: ImageItem) -> object:
    if isinstance(image, RowRef):
        return {"row": dataclasses.asdict(image)}
    if isinstance(image, MemberRef):
        return {"member": dataclasses.asdict(image)}
    if not isinstance(image, str):
        raise ManifestError(f"item {item.id!r}: a job stores image paths or URLs, not "
                            f"{type(image).__name__}")
    return image


def _question_json(q: Question) -> list | dict:
    """[id, text, threshold], plus max_new_tokens when set (stores stay readable by
    versions that know three fields, unless a question uses the fourth); a question with a
    label set, a system turn, an instruction or a label (``expected``: the report marks its
    answers right or wrong) as an object of its set fields."""
    if q.choices or q.system is not None or q.prompt is not None or q.expected is not None:
        d = {"id": q.id, "text": q.text, "threshold": q.threshold,
             "max_new_tokens": q.max_new_tokens, "choices": list(q.choices),
             "system": q.system, "prompt": q.prompt, "expected": q.expected}
        return {k: v for k, v in d.items() if v not in (None, [])}
    fields = [q.id, q.text, q.threshold]
    return fields if q.max_new_tokens is None else [*fields, q.max_new_tokens]


def _question(q: list | dict) -> Question:
    if isinstance(q, list):
        return Question(*q)
    return Question(**{**q, "choices": tuple(q.get("choices", ()))})


def image_item_from_json(text: str) -> ImageItem:
    """Inverse of ``image_item_to_json`` (stores from before lists and clips read alike)."""
    d = json.loads(text)
    image = d["image"]
    media: ItemMedia
    if isinstance(image, dict) and "images" in image:
        media = ImageList(tuple(_image(s) for s in image["images"]),
                          bool(image.get("per_image")))
    elif isinstance(image, dict) and "video" in image:
        media = VideoInput(image["video"], SamplingKeys(
            image.get("fps"), image.get("num_frames"), image.get("max_frames"),
            image.get("max_video_tokens"), image.get("segment_seconds"),
            image.get("segment_stride")))
    else:
        media = _image(image)
    return ImageItem(d["id"], media, tuple(_question(q) for q in d["questions"]),
                     Path(d["base_dir"]))


def _image(image: str | dict) -> ImageSource:
    if isinstance(image, dict):
        return RowRef(**image["row"]) if "row" in image else MemberRef(**image["member"])
    return image


class JobStore:
    """One job's store. ``path`` is created (at the current schema version) when it does
    not exist; an existing file must hold a job store of this version or an older one."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        new = not self.path.exists()
        # a job on a read-only file system (an archive) can still be read: nothing can be
        # writing to it, so SQLite may skip the WAL's shared-memory file it cannot create
        read_only = not new and not os.access(self.path.parent, os.W_OK)
        where = (f"file:{quote(str(self.path.absolute()))}?mode=ro&immutable=1" if read_only
                 else str(self.path))
        # isolation_level=None: explicit BEGIN/COMMIT, so each record() is one transaction
        try:
            self.db = sqlite3.connect(where, isolation_level=None, timeout=30, uri=read_only)
        except sqlite3.Error as e:
            raise store_error(self.path, e) from None
        try:
            with self._sql():
                if not read_only:  # `status` reads while `run` writes
                    self.db.execute("PRAGMA journal_mode=WAL")
                    self.db.execute("PRAGMA synchronous=FULL")
                tables = {r[0] for r in self.db.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table'")}
                if new and not tables:
                    create(self.db)
                elif {"meta", "items"} <= tables:
                    upgrade(self.db, self.path, read_only)
                else:
                    raise StoreDamaged(f"{self.path} holds no job store (empty, truncated or "
                                       "another file); submit the job again")
        except BaseException:
            self.db.close()
            raise

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _sql(self) -> Iterator[None]:
        """SQLite's errors as ``StoreDamaged`` or an ``OSError`` naming the store."""
        try:
            yield
        except sqlite3.IntegrityError:
            raise
        except sqlite3.Error as e:
            raise store_error(self.path, e) from None

    @contextmanager
    def _transaction(self, begin: str = "BEGIN IMMEDIATE") -> Iterator[None]:
        """One transaction: committed if the block ends normally, rolled back on any
        exception, Ctrl-C and SIGTERM included (else later writes, such as the run's final
        status, would join the open transaction and be lost when the store closes). SQLite
        may have rolled it back itself (a full disk): then there is nothing to undo."""
        with self._sql():
            self.db.execute(begin)
            try:
                yield
                self.db.execute("COMMIT")
            except BaseException:
                if self.db.in_transaction:
                    try:
                        self.db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass  # the error that brought us here is the one to report
                raise

    def add_items(self, items: Iterable[tuple[str, Any]],
                  first: Callable[[str], str] | None = None,
                  to_json: Callable[[Any], str] = image_item_to_json,
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
            # inserted pending, with no lines (jobs/store_schema.py: no insert trigger)
            self.db.execute("UPDATE totals SET items = items + ? WHERE state = 'pending'", (n,))
        return n

    def pending(self, batch: int, from_json: Callable[[str], Any] = image_item_from_json
                ) -> Iterator[list[Any]]:
        """Pending items in manifest order, ``batch`` at a time (re-queried each time, so
        items recorded meanwhile are never handed out again); ``from_json`` reads a stored
        item (an ``ImageItem`` by default)."""
        last = 0
        while True:
            with self._sql():
                rows = self.db.execute(
                    "SELECT idx, spec FROM items WHERE state = 'pending' AND idx > ? "
                    "ORDER BY idx LIMIT ?", (last, batch)).fetchall()
            if not rows:
                return
            last = rows[-1][0]
            yield [self._item(idx, spec, from_json) for idx, spec in rows]

    def _item(self, idx: int, spec: str, from_json: Callable[[str], Any]) -> Any:
        try:
            return from_json(spec)
        except (ValueError, KeyError, TypeError) as e:
            raise self._damaged(idx, e) from None

    def _damaged(self, idx: int, e: Exception) -> StoreDamaged:
        return StoreDamaged(f"{self.path} is damaged: item {idx} is unreadable "
                            f"({type(e).__name__}: {str(e)[:200]}); submit the job again")

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

    def _totals(self) -> dict[str, tuple[int, int, int]]:
        """state -> (items, result lines, answered lines): three rows, whatever the job's
        size (``jobs/store_schema.py``)."""
        with self._sql():
            return {state: (items, lines, answered) for state, items, lines, answered
                    in self.db.execute("SELECT state, items, lines, answered FROM totals")}

    def counts(self) -> Counts:
        t = self._totals()
        return Counts(*(t.get(s, (0, 0, 0))[0] for s in ("pending", "done", "failed")))

    def questions_done(self) -> int:
        """Result lines recorded (answered or failed)."""
        t = self._totals()
        return sum(t.get(s, (0, 0, 0))[1] for s in ("done", "failed"))

    def questions_answered(self) -> int:
        """Result lines recorded without an error (what QPM counts)."""
        t = self._totals()
        return sum(t.get(s, (0, 0, 0))[2] for s in ("done", "failed"))

    def answers(self) -> Iterator[Answer]:
        """Every recorded answer, in manifest then question order."""
        return self.records(Answer.from_record)

    def records(self, parse: Callable[[dict[str, Any]], Any] = lambda d: d) -> Iterator[Any]:
        """Every recorded result object (what ``record()`` stored), in manifest order, as
        ``parse`` reads it; one it cannot read is ``StoreDamaged`` naming the item."""
        for idx, lines in self._results():
            yield from self._parsed(idx, lambda: [parse(d) for d in lines])

    def recorded_items(self, parse_spec: Callable[[str], Any] = lambda s: s,
                       parse: Callable[[dict[str, Any]], Any] = lambda d: d
                       ) -> Iterator[tuple[Any, list[Any]]]:
        """(stored item, its results) of each recorded item, in manifest order, as
        ``parse_spec``/``parse`` read them (damage as in ``records``)."""
        for idx, lines in self._results():
            with self._sql():
                (spec,) = self.db.execute("SELECT spec FROM items WHERE idx = ?",
                                          (idx,)).fetchone()
            yield self._parsed(idx, lambda: (parse_spec(spec), [parse(d) for d in lines]))

    def holds_clips(self) -> bool:
        """Whether any item is a clip (``{"video": ...}``: ``image_item_to_json``), so its
        results carry ``frames`` and ``seconds`` columns (``outputs/sinks.py``)."""
        with self._sql():
            return self.db.execute(
                "SELECT 1 FROM items WHERE json_type(spec, '$.image.video') IS NOT NULL "
                "LIMIT 1").fetchone() is not None

    def _parsed(self, idx: int, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # binascii.Error too
            raise self._damaged(idx, e) from None

    def _results(self) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """(idx, result objects) of each recorded item, in manifest order, read a row at a
        time (a million-item job is not held in memory)."""
        with self._sql():
            cur = self.db.execute(
                "SELECT idx, result FROM items WHERE state != 'pending' ORDER BY idx")
        while True:
            with self._sql():
                row = cur.fetchone()
            if row is None:
                return
            try:
                lines = json.loads(row[1])
                if not isinstance(lines, list) or not all(isinstance(d, dict) for d in lines):
                    raise TypeError("result is not a list of objects")
            except (ValueError, TypeError) as e:
                raise self._damaged(row[0], e) from None
            yield row[0], lines

    def get(self, key: str, default: str | None = None) -> str | None:
        with self._sql():
            row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def set(self, key: str, value: str) -> None:
        with self._sql():
            self._set(key, value)

    def _set(self, key: str, value: str) -> None:
        self.db.execute("INSERT INTO meta (key, value) VALUES (?, ?) "
                        "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))

    def begin_run(self, c: Counts, host: str) -> None:
        """Mark a run as started by this process on ``host`` (what ``status`` computes QPM,
        ETA and the runner from), in one transaction."""
        answered = self.questions_answered()
        with self._transaction():
            for key, value in (("cancel", "0"), ("status", "running"),
                               ("run_started", str(time.time())),
                               ("run_answered_at_start", str(answered)),
                               ("run_items_at_start", str(c.done + c.failed)),
                               ("run_pid", str(os.getpid())), ("run_host", host)):
                self._set(key, value)
            self.db.execute("DELETE FROM meta WHERE key = 'run_ended'")

    def end_run(self, final: str, failing: bool = False) -> None:
        """Mark the run ended: ``final`` (interrupted, cancelled), or done if nothing is
        pending. ``failing``: the run is ending on an error, which may be the store's own (a
        full disk): then a store that cannot take this write is said on stderr, not raised
        over that error; it still says ``running``, which ``status`` reads as interrupted
        once this process is gone."""
        try:
            status = final if self.counts().pending else "done"
            with self._transaction():
                self._set("status", status)
                self._set("run_ended", str(time.time()))
        except (OSError, StoreDamaged) as e:
            if not failing:
                raise
            print(f"vlmbatch: warning: could not mark the job {final}: {e}", file=sys.stderr)
