"""common/atomic.py: a file or folder appears whole at its destination, or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmbatch.common.atomic import replaced_on_success


def test_a_file_is_replaced_only_when_complete(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "r.csv"
    with replaced_on_success(out) as part:
        part.write_text("new\n")
        assert not out.exists()  # nothing at the destination while writing
    assert out.read_text() == "new\n"
    with pytest.raises(KeyboardInterrupt), replaced_on_success(out) as part:
        part.write_text("half")
        raise KeyboardInterrupt
    assert out.read_text() == "new\n" and [p.name for p in out.parent.iterdir()] == ["r.csv"]


def test_a_folder_is_replaced_only_when_complete(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()  # an existing empty folder may be replaced
    with pytest.raises(RuntimeError), replaced_on_success(out) as part:
        part.mkdir()
        (part / "config.json").write_text("{}")
        raise RuntimeError("disk full")
    assert out.is_dir() and not any(out.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    with replaced_on_success(out) as part:
        part.mkdir()
        (part / "config.json").write_text("{}")
    assert [p.name for p in out.iterdir()] == ["config.json"]


def test_a_part_left_by_a_killed_process_with_our_pid_is_replaced(tmp_path: Path) -> None:
    """A SIGKILLed command leaves its ``.NAME.PID.part``; a later process given the same pid
    (a restarted container) starts afresh instead of failing on it (a submit's mkdir)."""
    import os

    job = tmp_path / "job"
    stale = tmp_path / f".job.{os.getpid()}.part"
    stale.mkdir()
    (stale / "store.sqlite").write_text("half")
    with replaced_on_success(job) as part:
        part.mkdir()  # FileExistsError before the fix
        (part / "job.json").write_text("{}")
    assert [p.name for p in job.iterdir()] == ["job.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["job"]
    (tmp_path / f".r.csv.{os.getpid()}.part").write_text("half")
    with replaced_on_success(tmp_path / "r.csv") as part:
        with open(part, "x") as f:  # exclusive create: fails if the stale file were kept
            f.write("new\n")
    assert (tmp_path / "r.csv").read_text() == "new\n"
