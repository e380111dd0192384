"""The packages type-check: mypy over what ``[tool.mypy]`` in pyproject.toml names.

mypy is in the ``test`` extra (pinned there), so CI runs this; it takes about 20 s cold.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[1]


def test_packages_type_check(tmp_path: Path) -> None:
    cwd, limit = os.getcwd(), sys.getrecursionlimit()
    os.chdir(ROOT)  # the config's files are relative to the repository
    try:
        out, err, rc = api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                "--cache-dir", str(tmp_path / "mypy_cache")])
    finally:
        os.chdir(cwd)
        # mypy raises the process's recursion limit to 16,384: the readers' deep-nesting
        # tests, run after this one, would then overflow the C stack instead of refusing
        sys.setrecursionlimit(limit)
    assert rc == 0, out + err
