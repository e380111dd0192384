"""Disks and files: a full disk while recording, submitting or exporting (a clear error naming
the file, the store consistent, `resume` finishing once space is back, nothing lost or
twice), and a read-only output or job folder (an error before any work; a read-only job is
still readable).

A real full disk is a small tmpfs, mounted where this process may mount (root); SQLite's
own ``max_page_count`` gives the same SQLITE_FULL without one, and a write that raises
ENOSPC stands in for a full export disk."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.jobs.interrupting import assert_each_once, resume
from tests.jobs.test_job import make_manifest, submit_job
from vlmbatch.cli.commands import EXIT_CRASH, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.jobs.folder import STORE_FILE, status
from vlmbatch.jobs.store import JobStore

FULL = "disk full (database or disk is full); nothing recorded is lost: free space, then " \
       "`vlmbatch resume"


def _mountable(where: Path) -> bool:
    where.mkdir(exist_ok=True)
    if os.geteuid() != 0:
        return False
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                        capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", str(where)], check=True)
    return ok


@contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``where`` (skips the test where this process cannot mount)."""
    if not _mountable(where):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                   check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)


def assert_consistent(job: Path, n: int, per_item: int = 2) -> None:
    """Every item either pending with no result or recorded with its lines, the totals equal
    to a recount, SQLite's own check passes."""
    db = sqlite3.connect(job / STORE_FILE)
    try:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        rows = db.execute("SELECT state, result, lines FROM items").fetchall()
        assert len(rows) == n
        for state, result, lines in rows:
            assert (result is None) == (state == "pending")
            assert state == "pending" or len(json.loads(result)) == lines == per_item
        recount = db.execute("SELECT state, COUNT(*), SUM(lines) FROM items GROUP BY state")
        totals = {s: (i, ln) for s, i, ln, _ in db.execute("SELECT * FROM totals")}
        assert all(totals[s] == (i, ln) for s, i, ln in recount), totals
    finally:
        db.close()


def _limited(monkeypatch: pytest.MonkeyPatch, extra_pages: int) -> None:
    """Stores opened from now on may grow ``extra_pages`` pages: SQLite then answers
    SQLITE_FULL, as on a full disk."""
    real = JobStore.__init__

    def init(self: JobStore, path: Path) -> None:
        real(self, path)
        pages = self.db.execute("PRAGMA page_count").fetchone()[0]
        self.db.execute(f"PRAGMA max_page_count = {pages + extra_pages}")

    monkeypatch.setattr(JobStore, "__init__", init)


def test_store_full_while_recording_then_resume_finishes(
        tmp_path: Path, random_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    _, job = submit_job(tmp_path, random_model_dir, 40, "--images-per-batch", "1",
                        "--no-progress")
    _limited(monkeypatch, extra_pages=2)
    capsys.readouterr()
    assert main(["run", str(job), "--no-progress"]) == EXIT_CRASH
    err = capsys.readouterr().err
    assert f"vlmbatch: error: {job / STORE_FILE}: {FULL} {job}`" in err and "Traceback" not in err
    monkeypatch.undo()
    st = status(job)
    assert st.status == "interrupted" and 0 < st.done < 40, st
    assert_consistent(job, 40)
    resume(job)
    assert_each_once(job, [f"img{i}" for i in range(40)])


def test_store_full_at_submit_leaves_no_job(tmp_path: Path, random_model_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture) -> None:
    m = make_manifest(tmp_path, 60)
    _limited(monkeypatch, extra_pages=1)
    job = tmp_path / "job"
    assert main(["submit", str(m), "--job", str(job), "--model", str(random_model_dir)]) \
        == EXIT_CRASH
    assert f"vlmbatch: error: {job / STORE_FILE}: disk full" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir() if not p.suffix == ".png") == ["m.jsonl"]


def test_a_full_tmpfs_while_recording_then_resume_once_space_is_back(
        tmp_path: Path, random_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """A real ENOSPC: the job on a 320 KiB tmpfs fills it (the store's write-ahead log grows
    with every group); the store then cannot be read there either (SQLite's WAL needs room
    for its index), which is a clear error too; resume after a remount at 8 MiB finishes."""
    m = make_manifest(tmp_path, 60)
    with tmpfs(tmp_path / "mnt", "320k") as mnt:
        job = mnt / "job"
        assert main(["submit", str(m), "--job", str(job), "--model", str(random_model_dir),
                     "--images-per-batch", "1", "--no-progress"]) == EXIT_OK
        capsys.readouterr()
        assert main(["run", str(job), "--no-progress"]) == EXIT_CRASH
        assert f"{job / STORE_FILE}: {FULL} {job}`" in capsys.readouterr().err
        remount(mnt, "size=8m")
        assert status(job).status == "interrupted"
        assert_consistent(job, 60)
        resume(job)
        assert_each_once(job, [f"img{i}" for i in range(60)])
        assert_consistent(job, 60)


@pytest.mark.parametrize("name", ["r.jsonl", "r.csv", "r.parquet"])
def test_an_export_to_a_full_tmpfs_names_the_file_and_keeps_the_old_one(
        tmp_path: Path, random_model_dir: Path, capsys: pytest.CaptureFixture,
        name: str) -> None:
    _, job = submit_job(tmp_path, random_model_dir, 4, "--wait", "--no-progress")
    with tmpfs(tmp_path / "mnt", "64k") as mnt:
        (mnt / name).write_text("old\n")
        fill(mnt / "fill")
        capsys.readouterr()
        assert main(["results", str(job), "-o", str(mnt / name)]) == EXIT_CRASH
        err = capsys.readouterr().err
        assert err.startswith(f"vlmbatch: error: {mnt / name}: ") and "No space left" in err
        assert sorted(p.name for p in mnt.iterdir()) == ["fill", name]
        assert (mnt / name).read_text() == "old\n"


def fill(path: Path) -> None:
    """Write ``path`` until its file system is full."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_an_export_whose_write_fails_names_the_file(tmp_path: Path, random_model_dir: Path,
                                                    capsys: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The same without a mount: the store's answers stop with ENOSPC, as a write would."""
    _, job = submit_job(tmp_path, random_model_dir, 3, "--wait", "--no-progress")
    real = JobStore.answers

    def full(self: JobStore) -> Iterator:
        it = real(self)
        yield next(it)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(JobStore, "answers", full)
    out = tmp_path / "o" / "r.jsonl"
    out.parent.mkdir()
    out.write_text("old\n")
    capsys.readouterr()
    assert main(["results", str(job), "-o", str(out)]) == EXIT_CRASH
    assert capsys.readouterr().err == f"vlmbatch: error: {out}: No space left on device\n"
    assert out.read_text() == "old\n" and [p.name for p in out.parent.iterdir()] == ["r.jsonl"]


@pytest.mark.parametrize("name", ["run.jsonl", "run.csv"])
def test_a_run_onto_a_full_tmpfs_keeps_whole_lines(tmp_path: Path, random_model_dir: Path,
                                                   capsys: pytest.CaptureFixture,
                                                   name: str) -> None:
    m = make_manifest(tmp_path, 60)
    with tmpfs(tmp_path / "mnt", "8k") as mnt:
        (mnt / "other").write_bytes(b"\0" * 4096)  # 4 KiB left: a few groups' lines
        capsys.readouterr()
        assert main(["run", str(m), "--model", str(random_model_dir), "-o", str(mnt / name),
                     "--images-per-batch", "2", "--no-progress"]) == EXIT_CRASH
        assert f"vlmbatch: error: {mnt / name}: No space left" in capsys.readouterr().err
        text = (mnt / name).read_text()
    lines = text.splitlines()
    assert not text or text.endswith("\n")  # cut back to its last whole group
    if name.endswith(".jsonl"):
        assert lines and len(lines) % 4 == 0 and all(json.loads(x) for x in lines)


class Sealable:
    """A folder, writable until ``seal()`` makes it read-only: a tmpfs remounted read-only
    where we may mount (root ignores permissions), else by its permissions."""

    def __init__(self, path: Path, mounted: bool) -> None:
        self.path, self.mounted = path, mounted

    def seal(self, inner: Path | None = None) -> None:
        if self.mounted:
            remount(self.path, "ro")
        else:
            (inner or self.path).chmod(0o555)


@pytest.fixture()
def sealable(tmp_path: Path) -> Iterator[Sealable]:
    where = tmp_path / "ro"
    if _mountable(where):
        with tmpfs(where, "1m"):
            yield Sealable(where, True)
    elif os.geteuid() != 0:
        yield Sealable(where, False)
        for p in (where, *where.iterdir()):
            p.chmod(0o755)
    else:
        pytest.skip("root that cannot mount: nothing here is read-only to it")


def _no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise AssertionError("work started")

    monkeypatch.setattr("vlmbatch.cli.run.build_engine", fail)
    monkeypatch.setattr(JobStore, "answers", fail)


def test_a_read_only_out_or_job_folder_is_an_error_before_any_work(
        tmp_path: Path, random_model_dir: Path, sealable: Sealable,
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    m, job = submit_job(tmp_path, random_model_dir, 2, "--wait", "--no-progress")
    ro = sealable.path
    sealable.seal()
    _no_work(monkeypatch)
    capsys.readouterr()
    for argv, named in ((["run", str(m), "-o", str(ro / "x.jsonl")], "x.jsonl"),
                        (["results", str(job), "-o", str(ro / "x.csv")], "x.csv"),
                        (["submit", str(m), "--job", str(ro / "j")], "j")):
        assert main([*argv, "--model", str(random_model_dir)] if argv[0] != "results"
                    else argv) == EXIT_CRASH
        err = capsys.readouterr().err
        assert err.startswith(f"vlmbatch: error: {ro / named}: "), err
        assert "Read-only file system" in err or "Permission denied" in err
    assert not any(ro.iterdir())


def test_a_job_on_a_read_only_file_system_is_readable_not_runnable(
        tmp_path: Path, random_model_dir: Path, sealable: Sealable,
        capsys: pytest.CaptureFixture) -> None:
    """An archived job: status and results work; resume says the folder is read-only."""
    _, job = submit_job(sealable.path, random_model_dir, 2, "--wait", "--no-progress")
    sealable.seal(job)
    capsys.readouterr()
    assert main(["status", str(job)]) == EXIT_OK
    assert capsys.readouterr().out.startswith("done: 2/2 images")
    assert main(["results", str(job), "-o", str(tmp_path / "r.jsonl")]) == EXIT_OK
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 4
    capsys.readouterr()
    assert main(["resume", str(job), "--no-progress"]) == EXIT_CRASH
    err = capsys.readouterr().err
    assert err.startswith(f"vlmbatch: error: {job}/run.lock: "), err
