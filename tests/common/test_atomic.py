"""pipeline/atomic.py: a file or folder appears whole at its destination, or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.atomic import replaced_on_success


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
