"""The layers of ``docs/structure.md``: a package imports only from the rows below its own,
no two modules import each other (directly or round a cycle), an import inside a function
is only ever of an optional dependency, with a comment saying so, and the server's engine
side (``vlmbatch.serving``) imports nothing of the web stack.

Every module of the packages is parsed with ``ast`` (nothing imported), function-level
imports included, and ``if TYPE_CHECKING:`` imports too: they never run, but a type named
from a module above, or round a cycle, ties the modules together all the same (they are
module-level imports, so they need no ``optional`` comment). The checker runs on the real
tree and on copies with one bad import injected, so each rule is shown to fail when broken.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# top to bottom; a package imports only from packages on lower rows (or from itself). Row 0
# is the import root itself (``vlmbatch/__init__.py``: lazy names; ``__main__.py``)
LAYERS: list[tuple[str, ...]] = [
    ("vlmbatch",),
    ("vlmbatch.cli",),
    ("vlmbatch.api", "vlmbatch.server"),
    ("vlmbatch.labels", "vlmbatch.serving"),
    ("vlmbatch.outputs",),
    ("vlmbatch.jobs",),
    ("vlmbatch.inputs",),
    ("vlmbatch.pipeline",),
    ("vlmbatch.engine",),
    ("vlmbatch.vit_trt", "vlmbatch.quant"),
    ("vlmbatch.models",),
    ("vlmbatch.preprocessing", "vlmbatch.cudagraph_pool"),
    ("vlmbatch.common",),
]
ROW = {pkg: i for i, row in enumerate(LAYERS) for pkg in row}
# the only modules a function may import (extras or a separate env), each with a comment
OPTIONAL = {"onnxruntime", "onnx", "ray", "tensorrt", "lmdeploy", "pyarrow", "fsspec",
            "fla"}  # fla: flash-linear-attention, Qwen3.5's kernels on CUDA
# what the server's engine side (an engine process) must never load: the HTTP stack
WEB = {"fastapi", "starlette", "pydantic", "pydantic_core", "uvicorn", "multipart",
       "python_multipart"}
ENGINE_SIDE = "vlmbatch.serving"


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under the import root."""
    out = {}
    for f in sorted((root / "vlmbatch").rglob("*.py")):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def package(module: str) -> str:
    """The layered package a dotted module name belongs to (``vlmbatch.jobs.store`` ->
    ``vlmbatch.jobs``; the root's own modules -> ``vlmbatch``); other names as they are."""
    parts = module.split(".")
    if parts[0] != "vlmbatch":
        return parts[0]
    return ".".join(parts[:2]) if len(parts) > 1 and ".".join(parts[:2]) in ROW else "vlmbatch"


def imports(tree: ast.Module) -> list[tuple[ast.stmt, bool]]:
    """(import statement, at module level?), ``if TYPE_CHECKING:`` blocks included (at
    module level)."""
    found: list[tuple[ast.stmt, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, top))
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
            visit(child, inner)

    visit(tree, True)
    return found


def targets(stmt: ast.stmt, known: dict[str, Path]) -> list[str]:
    """The modules an import statement names (``from a import b`` names ``a.b`` when that
    is a module, else ``a``)."""
    if isinstance(stmt, ast.Import):
        return [a.name for a in stmt.names]
    assert isinstance(stmt, ast.ImportFrom)
    base = stmt.module or ""
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in stmt.names]


def _commented(lines: list[str], lineno: int) -> bool:
    """The import's line, or the nearest line above it that is not blank or another import
    (a ``try:`` around a few imports), says ``optional``."""
    i = lineno - 1
    if "optional" in lines[i]:
        return True
    j = i - 1
    while j >= 0 and (not lines[j].strip() or lines[j].split()[0] in ("import", "from")):
        j -= 1
    return j >= 0 and "optional" in lines[j]


def violations(root: Path) -> list[str]:
    known = modules(root)
    bad: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        text = path.read_text()
        lines = text.splitlines()
        for stmt, top in imports(ast.parse(text)):
            for target in targets(stmt, known):
                pkg, own = package(target), package(mod)
                where = f"{path.relative_to(root)}:{stmt.lineno}"
                if pkg in ROW and pkg != own and ROW[pkg] <= ROW[own]:
                    bad.append(f"{where}: {own} (row {ROW[own] + 1}) imports {target} "
                               f"(row {ROW[pkg] + 1}): not below it")
                if target in known:
                    graph[mod].add(target)
                if own == ENGINE_SIDE and target.split(".")[0] in WEB:
                    bad.append(f"{where}: the engine side ({own}) imports {target}: an "
                               "engine process must not load the web stack")
                if not top and (pkg not in OPTIONAL or not _commented(lines, stmt.lineno)):
                    bad.append(f"{where}: function-level import of {target} (only optional "
                               f"dependencies {sorted(OPTIONAL)}, with a comment)")
    bad += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing
    itself (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_tree_follows_the_layers() -> None:
    assert violations(ROOT) == []


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """A copy of the layered packages' sources, for injecting bad imports."""
    shutil.copytree(ROOT / "vlmbatch", tmp_path / "vlmbatch",
                    ignore=shutil.ignore_patterns("__pycache__", "default*model"))
    return tmp_path


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_an_upward_import_fails(tree: Path) -> None:
    _append(tree / "vlmbatch" / "models" / "config_io.py",
            "\nfrom vlmbatch.cli.main import main  # noqa\n")
    upward, cycle = violations(tree)  # vlmbatch.cli.main imports models.config_io: a cycle too
    assert upward.startswith("vlmbatch/models/config_io.py:")
    assert "imports vlmbatch.cli.main (row 2)" in upward
    assert cycle.startswith("import cycle: ") and "vlmbatch.models.config_io" in cycle


def test_a_sibling_import_fails(tree: Path) -> None:
    _append(tree / "vlmbatch" / "quant" / "int4.py", "\nimport vlmbatch.vit_trt.base  # noqa\n")
    assert any("vlmbatch.quant (row 10) imports vlmbatch.vit_trt.base (row 10)" in b
               for b in violations(tree))


def test_a_cycle_fails(tree: Path) -> None:
    engine = tree / "vlmbatch" / "engine"
    _append(engine / "scoring.py", "\nimport vlmbatch.engine.planner  # noqa\n")
    _append(engine / "planner.py", "\nimport vlmbatch.engine.scoring  # noqa\n")
    assert violations(tree) == [
        "import cycle: vlmbatch.engine.planner -> vlmbatch.engine.scoring"]


def test_a_type_only_cycle_fails(tree: Path) -> None:
    """A type named under ``if TYPE_CHECKING:`` closes a cycle as a real import does."""
    _append(tree / "vlmbatch" / "engine" / "prefix_cache.py",
            "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
            "    from vlmbatch.engine.planner import Plan  # noqa\n")
    (cycle,) = violations(tree)
    assert cycle.startswith("import cycle: ") and "vlmbatch.engine.planner" in cycle \
        and "vlmbatch.engine.prefix_cache" in cycle


def test_a_type_only_upward_import_fails(tree: Path) -> None:
    _append(tree / "vlmbatch" / "outputs" / "sinks.py",
            "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
            "    from vlmbatch.labels.read import Scored  # noqa\n")
    assert any("vlmbatch.outputs (row 5) imports vlmbatch.labels.read (row 4)" in b
               for b in violations(tree))


@pytest.mark.parametrize("web", ["fastapi", "starlette.types", "pydantic", "uvicorn"])
def test_the_engine_side_importing_the_web_stack_fails(tree: Path, web: str) -> None:
    _append(tree / "vlmbatch" / "serving" / "scheduler.py", f"\nimport {web}  # noqa\n")
    (bad,) = violations(tree)
    assert bad.startswith("vlmbatch/serving/scheduler.py:") and f"imports {web}" in bad


def test_a_hidden_function_level_import_fails(tree: Path) -> None:
    sinks = tree / "vlmbatch" / "outputs" / "sinks.py"
    _append(sinks, "\n\ndef f() -> None:\n    import yaml  # noqa\n")
    (bad,) = violations(tree)
    assert "vlmbatch/outputs/sinks.py" in bad and "function-level import of yaml" in bad


def test_an_optional_import_needs_its_comment(tree: Path) -> None:
    sinks = tree / "vlmbatch" / "outputs" / "sinks.py"
    _append(sinks, "\n\ndef f() -> None:\n    import pyarrow\n")
    assert len(violations(tree)) == 1
    _append(sinks, "\n\ndef g() -> None:\n    import ray  # optional: ray\n")
    assert len(violations(tree)) == 1  # only the first one, uncommented


def test_the_installed_distribution_has_one_top_level_name() -> None:
    """``pip install vlmbatch`` claims exactly one import name: a user's own ``models/`` or
    ``common/`` package cannot shadow one of ours, nor ours theirs."""
    import importlib.metadata as md

    dist = md.distribution("vlmbatch")
    top = (dist.read_text("top_level.txt") or "").split()
    names = sorted(k for k, v in md.packages_distributions().items() if "vlmbatch" in v)
    assert top == ["vlmbatch"] and names == ["vlmbatch"], (top, names)
    # and the sources agree: nothing importable sits beside vlmbatch/ in the repo root
    strays = [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()
              and p.name not in ("vlmbatch", "tests", "scripts")]
    assert strays == []


def test_the_lazy_public_names_are_all_listed() -> None:
    import vlmbatch

    assert sorted(vlmbatch.__all__) == sorted(vlmbatch._LAZY)
    for name in vlmbatch.__all__:
        assert getattr(vlmbatch, name) is not None
