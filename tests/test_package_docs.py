"""Each package's docstring is its table of contents: it names every module and subpackage
the package holds, and names no module it does not hold (a file moved or merged without its
package's docstring following it fails here)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "vlmbatch"
PACKAGES = sorted(p.parent for p in ROOT.rglob("__init__.py") if "default_" not in str(p))


def contents(pkg: Path) -> set[str]:
    """The package's modules (``name.py``, not ``__init__``/``__main__``) and subpackages."""
    mods = {p.stem for p in pkg.glob("*.py") if p.stem not in ("__init__", "__main__")}
    subs = {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    return mods | subs


def named(doc: str, name: str) -> bool:
    """The docstring names ``name`` as ``name.py``, ``name/`` or a ``name`` literal."""
    return bool(re.search(rf"(?<![\w/.]){re.escape(name)}(\.py\b|/|``|`)", doc))


def mentioned_files(doc: str) -> set[str]:
    """``x.py`` names the docstring gives without a folder (another package's are
    qualified: ``pipeline/drive.py``)."""
    return {m for m in re.findall(r"(?<![\w/.])(\w+)\.py\b", doc)}


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_the_package_docstring_lists_its_modules(pkg: Path) -> None:
    doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
    have = contents(pkg)
    missing = sorted(n for n in have if not named(doc, n))
    stale = sorted(m for m in mentioned_files(doc) - have if m not in ("__init__", "__main__"))
    assert not missing and not stale, (f"{pkg.relative_to(ROOT.parent)}/__init__.py: "
                                       f"not named: {missing}; named but not here: {stale}")


def test_the_check_catches_a_missing_and_a_stale_name() -> None:
    doc = "The records (``records.py``) and ``drive``; see ``gone.py``, ``pipeline/x.py``."
    assert named(doc, "records") and named(doc, "drive") and not named(doc, "task")
    assert mentioned_files(doc) == {"records", "gone"}
