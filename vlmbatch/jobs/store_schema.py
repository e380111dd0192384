"""The job store's SQLite layout and version (``jobs/store.py`` reads and writes it), the
migration of older stores, and SQLite's errors as messages that say what to do.

Version 1 is every store without a ``schema`` key in ``meta`` (before the version was
written). Version 2 writes it at creation and keeps ``totals``: per state, its items and
their result lines and answered lines, kept in the same transaction as every change to
``items``, so ``status`` reads three rows instead of scanning a million: by triggers for
updates and deletes (whoever makes them), and by ``JobStore.add_items`` for its inserts
(the only ones; a trigger there would add ~12 us to each of a million inserts, doubling
their time). A version-1 store is migrated when first opened; a store of a later version than
``STORE_VERSION`` is refused, with both numbers.

Version 3 keeps each question's label (``expected``) in the item's ``spec`` (its JSON object
form), so ``vlmbatch report`` can mark answers right or wrong. The tables are those of
version 2: migrating is writing the number, and what it guards is the other direction: a
vlmbatch of version 2 that predates labels would read such a spec as damage, so it is told
instead that a newer vlmbatch wrote the store. Stores submitted before keep no labels (their
manifests' were dropped): their reports mark nothing.
"""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

from vlmbatch.pipeline.questions import ManifestError

STORE_VERSION = 3

TABLES = """
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
_MOVE = ("UPDATE totals SET items = items {op} 1, lines = lines {op} {row}.lines, "
         "answered = answered {op} {row}.answered WHERE state = {row}.state;")
TOTALS = f"""
CREATE TABLE totals (state TEXT PRIMARY KEY, items INTEGER NOT NULL DEFAULT 0,
                     lines INTEGER NOT NULL DEFAULT 0, answered INTEGER NOT NULL DEFAULT 0);
INSERT INTO totals (state) VALUES ('pending'), ('done'), ('failed');
CREATE TRIGGER items_changed AFTER UPDATE OF state, lines, answered ON items BEGIN
    {_MOVE.format(op="-", row="old")}
    {_MOVE.format(op="+", row="new")}
END;
CREATE TRIGGER items_removed AFTER DELETE ON items BEGIN
    {_MOVE.format(op="-", row="old")}
END;
"""
# An item's answered lines, parsed from its stored result (record() counts them in Python
# with the same rule: no error, or an empty one); for stores from before the column.
ANSWERED_OF_RESULT = ("(SELECT COUNT(*) FROM json_each(items.result) "
                      "WHERE COALESCE(json_extract(value, '$.error'), '') = '')")


class StoreDamaged(ManifestError):
    """The store file is not a readable job store (truncated, overwritten, corrupted)."""


class StoreTooNew(ManifestError):
    """The store was written by a later vlmbatch, in a layout this one does not know."""


def version_of(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
    return int(row[0]) if row else 1


def create(db: sqlite3.Connection) -> None:
    """A new store's tables, at ``STORE_VERSION``; a creation cut short reads as version 1
    and is migrated when next opened."""
    db.executescript(TABLES)
    db.execute("BEGIN IMMEDIATE")
    for stmt in _statements(TOTALS):
        db.execute(stmt)
    db.execute("INSERT INTO meta (key, value) VALUES ('schema', ?)", (str(STORE_VERSION),))
    db.execute("COMMIT")


def upgrade(db: sqlite3.Connection, path: Path, read_only: bool = False) -> None:
    """Refuse a store of a later version; migrate an older one (1 -> 2 -> 3), in one
    transaction (re-checked inside it: another process may have migrated it meanwhile). A
    read-only version-2 store (an archive) is read as it is: its tables are version 3's."""
    v = version_of(db)
    if v > STORE_VERSION:
        raise StoreTooNew(f"{path} was written by a newer vlmbatch (job store version {v}; "
                          f"this one reads up to {STORE_VERSION}): run the job with that "
                          "version")
    if v == STORE_VERSION or (read_only and v == 2):
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        if version_of(db) == 1:
            _from_v1(db)
        if version_of(db) == 2:  # the same tables; specs may now hold labels
            db.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (str(STORE_VERSION),))
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _from_v1(db: sqlite3.Connection) -> None:
    cols = {row[1] for row in db.execute("PRAGMA table_info(items)")}
    if "answered" not in cols:  # stores from before the per-item counts
        db.execute("ALTER TABLE items ADD COLUMN lines INTEGER NOT NULL DEFAULT 0")
        db.execute("ALTER TABLE items ADD COLUMN answered INTEGER NOT NULL DEFAULT 0")
        db.execute(f"UPDATE items SET lines = json_array_length(result), "
                   f"answered = {ANSWERED_OF_RESULT} WHERE state != 'pending'")
    for stmt in _statements(TOTALS):
        db.execute(stmt)
    db.execute("UPDATE totals SET (items, lines, answered) = (SELECT COUNT(*), "
               "COALESCE(SUM(lines), 0), COALESCE(SUM(answered), 0) FROM items "
               "WHERE items.state = totals.state)")
    db.execute("INSERT INTO meta (key, value) VALUES ('schema', '2')")


def _statements(script: str) -> list[str]:
    """``script``'s statements, for ``execute`` one by one inside a transaction (a trigger's
    body holds semicolons too, so each is split where SQLite says it is complete)."""
    out, part = [], ""
    for line in script.strip().splitlines(keepends=True):
        part += line
        if sqlite3.complete_statement(part):
            out.append(part.strip())
            part = ""
    return out


def store_error(path: Path, e: sqlite3.Error) -> Exception:
    """What SQLite's ``e`` on the store at ``path`` means: ``StoreDamaged`` (exit 2), or an
    ``OSError`` naming the file and what to do (exit 1); other errors (our own bugs) as
    they are."""
    name = getattr(e, "sqlite_errorname", "") or ""
    resume = f"`vlmbatch resume {path.parent}`"
    # no SQLite code: the sqlite3 module's own (a text value that is not UTF-8)
    ours = isinstance(e, sqlite3.OperationalError) and not name
    if (name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or ours
            or "no such table" in str(e) or "no such column" in str(e)):
        return StoreDamaged(
            f"{path} is damaged ({e}): it is not a readable job store. What it still holds "
            f"may be saved with `sqlite3 {path} .recover`; otherwise submit the job again")
    if name == "SQLITE_FULL":
        return OSError(errno.ENOSPC, f"disk full ({e}); nothing recorded is lost: free "
                       f"space, then {resume} continues the job", str(path))
    if name.startswith("SQLITE_READONLY"):
        return OSError(errno.EROFS, f"cannot write the job store ({e}): the job folder "
                       "must be writable", str(path))
    if name.startswith("SQLITE_IOERR"):
        return OSError(errno.EIO, f"I/O error on the job store ({e}); check the disk and "
                       f"its free space, then {resume}", str(path))
    if name.startswith("SQLITE_CANTOPEN"):
        return OSError(errno.EACCES, f"cannot open the job store ({e}): check the folder's "
                       "permissions and free space", str(path))
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return OSError(errno.EBUSY, f"the job store is locked by another process ({e})",
                       str(path))
    return e
