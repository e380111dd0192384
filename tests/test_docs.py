"""The docs a newcomer reads stay true to the code.

- ``README.md`` is at most 16 KB (a two-minute read; the rest lives in ``docs/``).
- Every ``vlmbatch`` command README.md and ``docs/*.md`` show (in shell code blocks and in
  inline code) parses: its subcommand is one ``vlmbatch --help`` lists, and each option it
  uses is one ``vlmbatch SUBCOMMAND --help`` prints (the CLI run in this process, light).
- Every relative link of README.md and ``docs/*.md`` is a file of the tree, and its
  ``#anchor`` a heading of that file; every path they name under ``vlmbatch/``, ``docs/``,
  ``tests/``, ``bench/``, ``scripts/`` or ``examples/`` (or a package's ``pkg/module.py``) is
  there.
- ``docs/structure.md``'s layer table and its list of optional imports are the ones
  ``tests/test_layers.py`` enforces.
- Every YAML, TOML and JSON block of README.md and ``docs/*.md`` is read by the reader a
  user's file of its kind goes through: a policy by the policy reader, manifest lines and
  OpenAI batch requests by the manifest reader, result lines by ``calibrate``'s reader
  (any other JSON, a server's response shown, by ``json``), so an example a user copies
  parses.
- What the README's commands write in a clone (``-o``, ``--job``, ``--write-policy``, the
  server's data folder) is ignored by git: a newcomer's ``git status`` stays clean.
- Figures are stated once, in ``docs/figures.md``: each ``figures.md#row`` a page or a
  docstring of ``vlmbatch/``, ``bench/``, ``scripts/`` cites is a named row there, and the
  readers' fuzz count there (and per test in ``docs/reliability.md``) is what
  ``tests/inputs/test_fuzz_readers.py``'s ``fuzz(N)`` settings run.

Each check is a function of the text, and the last tests show each one failing on a broken
input (an unknown option, a misspelt subcommand, a dead link, a missing anchor, a stale path,
a long README, a fuzz count that is not the tests').
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import io
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.test_layers import LAYERS, OPTIONAL
from vlmbatch.cli.main import main
from vlmbatch.inputs.manifest import read_manifest, read_policy
from vlmbatch.labels.read import read_results
from vlmbatch.server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 16 * 1024  # bytes
SHELL = {"bash", "sh", "shell", "console", ""}
TOP_DIRS = ("vlmbatch", "docs", "tests", "bench", "scripts", "examples", ".ci")
PACKAGES = tuple(sorted({p.split(".")[1] for row in LAYERS for p in row if "." in p}))


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- commands --------------------------------------------------------------------------

def shell_lines(text: str) -> list[str]:
    """The logical lines of the markdown's shell code blocks (``\\``-continued lines joined)
    and its inline code spans that start with ``vlmbatch ``."""
    lines: list[str] = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S):
        if lang in SHELL:
            lines += body.replace("\\\n", " ").splitlines()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    lines += re.findall(r"`(vlmbatch [^`]+)`", prose)
    return lines


def commands(text: str) -> list[list[str]]:
    """Each ``vlmbatch`` command of the text as its words after ``vlmbatch`` (comments,
    pipes, ``&&``, ``;``, ``&``, leading ``VAR=value`` and ``[...]`` brackets of optional
    parts dropped)."""
    out = []
    for line in shell_lines(text):
        lex = shlex.shlex(line.replace("[", " ").replace("]", " "), posix=True,
                          punctuation_chars="|&;")
        lex.whitespace_split, lex.commenters = True, "#"
        try:
            words = list(lex)
        except ValueError:  # an unbalanced quote: not a shell line (a JSON fragment...)
            continue
        cmd: list[str] = []
        for w in [*words, ";"]:
            if w and set(w) <= set("|&;"):
                while cmd and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", cmd[0]):
                    cmd.pop(0)
                if cmd and cmd[0] == "vlmbatch":
                    out.append(cmd[1:])
                cmd = []
            else:
                cmd.append(w)
    return out


@functools.cache
def help_text(sub: str | None) -> str:
    """``vlmbatch [SUB] --help``, run in this process, unwrapped (a wide terminal)."""
    buf = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "10000"
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            with pytest.raises(SystemExit) as e:
                main([sub, "--help"] if sub else ["--help"])
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    assert e.value.code == 0, f"vlmbatch {sub or ''} --help exited {e.value.code}"
    return buf.getvalue()


def subcommands() -> set[str]:
    """The subcommands ``vlmbatch --help`` lists (its ``{run,submit,...}`` choices)."""
    usage = help_text(None)
    found = re.search(r"\{([a-z,-]+)\}", usage)
    if found:
        return set(found.group(1).split(","))
    block = usage.split("positional arguments:")[1].split("options:")[0]
    return set(re.findall(r"^    ([a-z][a-z-]*)", block, flags=re.M))


def command_problems(text: str) -> list[str]:
    """What in the text's ``vlmbatch`` commands ``--help`` does not know: a subcommand, or an
    option of its subcommand (``vlmbatch --help`` itself: the top level's)."""
    problems = []
    known = subcommands()
    for words in commands(text):
        if not words or words[0].startswith("-"):
            sub = None
        elif not words[0].islower():  # a placeholder: `vlmbatch COMMAND --help`
            continue
        elif words[0] not in known:
            problems.append(f"vlmbatch {' '.join(words)}: no subcommand {words[0]!r}")
            continue
        else:
            sub = words[0]
        shown = help_text(sub)
        for w in words:
            opt = w.split("=", 1)[0]
            if re.fullmatch(r"--?[A-Za-z][\w-]*", opt) and not re.search(
                    rf"(?<![\w-]){re.escape(opt)}(?![\w-])", shown):
                problems.append(f"vlmbatch {' '.join(words)}: `vlmbatch {sub or ''} --help` "
                                f"has no {opt}")
    return problems


def test_readme_is_at_most_16_kb() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes (at most {README_LIMIT})"


def test_the_readme_shows_commands() -> None:
    """The command check below has something to check: the README's set-up line, the three
    ways in and the moderation loop are all there."""
    subs = {w[0] for w in commands((ROOT / "README.md").read_text()) if w}
    assert {"run", "submit", "serve", "eval", "calibrate", "report"} <= subs, subs


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_command_shown_parses(doc: Path) -> None:
    problems = command_problems(doc.read_text())
    assert not problems, f"{rel(doc)}:\n" + "\n".join(problems)


# --- links and paths -------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"[`*]|<[^>]+>", "", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor (a repeated heading's ``-1``, ``-2``, ... too), and every
    ``<a id="NAME">`` (a named table row)."""
    out: set[str] = set(re.findall(r'<a id="([\w-]+)">', text))
    for h in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S),
                        flags=re.M):
        s = slug(h)
        n = 0
        while (s if n == 0 else f"{s}-{n}") in out:
            n += 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def link_problems(text: str, where: Path) -> list[str]:
    """Relative links of the markdown at ``where`` that lead nowhere: no such file, or no
    heading for the ``#anchor``."""
    problems = []
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (where.parent / path).resolve()
        if path and not dest.exists():
            problems.append(f"({target}): no {path}")
        elif anchor and (not path or dest.suffix == ".md") and anchor not in anchors(
                dest.read_text() if path else text):
            problems.append(f"({target}): no heading #{anchor} in {path or where.name}")
    return problems


def named_paths(text: str) -> set[str]:
    """Paths of the tree the text names: ``vlmbatch/...``, ``docs/...``, ... anywhere, and a
    package's ``engine/torch_engine.py`` (a path under ``vlmbatch/``)."""
    tops = "|".join(re.escape(d) for d in TOP_DIRS + PACKAGES)
    text = re.sub(r"/\n\s+(?=\w)", "/", text)  # a path broken across lines after a slash
    found = re.findall(rf"(?<![\w/.-])((?:{tops})/[\w./*{{}},-]*[\w/*}}])", text)
    return {p for p in found if not re.search(r"[{}*,]|\.\.", p)}  # not a glob or pattern


def in_tree(p: str) -> bool:
    """``p`` (from the root, or under ``vlmbatch/`` for a package's path) is a file or a
    folder, or names a module without its ``.py`` (``jobs/openai_embeddings``), or a module's
    attribute (``jobs/folder.load_config``)."""
    base = ROOT if p.split("/")[0] in TOP_DIRS else ROOT / "vlmbatch"
    module = p.rsplit(".", 1)[0] if "." in p.rsplit("/", 1)[-1] else p
    return any((base / q).exists() for q in (p, p + ".py", module + ".py"))


def path_problems(text: str) -> list[str]:
    return [f"{p}: not in the tree" for p in sorted(named_paths(text)) if not in_tree(p)]


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_link_resolves(doc: Path) -> None:
    problems = link_problems(doc.read_text(), doc)
    assert not problems, f"{rel(doc)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_path_named_is_in_the_tree(doc: Path) -> None:
    problems = path_problems(doc.read_text())
    assert not problems, f"{rel(doc)}:\n" + "\n".join(problems)


def test_the_readme_links_every_doc() -> None:
    """The README's table of where to read on leaves no page of ``docs/`` out."""
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)", (ROOT / "README.md").read_text()))
    pages = {p.name for p in DOCS[1:]}
    assert pages <= linked, f"docs/ pages the README does not link: {sorted(pages - linked)}"


# --- docs/structure.md against the layer test ------------------------------------------

def table_layers(text: str) -> list[set[str]]:
    """The packages of each numbered row of the layer table (``cli/`` -> ``vlmbatch.cli``;
    ``__init__.py`` -> ``vlmbatch``), in row order."""
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", text, flags=re.M)
    out = []
    for _, cell in sorted(rows, key=lambda r: int(r[0])):
        names = re.findall(r"`([\w/.]+)`", cell)
        out.append({"vlmbatch" if n == "__init__.py" else "vlmbatch." + n.strip("/")
                    for n in names})
    return out


def optional_named(text: str) -> set[str]:
    """The optional imports the layers paragraph lists (``optional dependency (a, b, c: ...``)."""
    flat = " ".join(text.split())
    found = re.search(r"optional dependency \(([^:)]*)", flat)
    return {n.strip() for n in found.group(1).split(",")} if found else set()


def test_structure_md_has_the_layer_tests_rows() -> None:
    text = (ROOT / "docs" / "structure.md").read_text()
    assert table_layers(text) == [set(row) for row in LAYERS]


def test_structure_md_lists_the_optional_imports_the_layer_test_allows() -> None:
    text = (ROOT / "docs" / "structure.md").read_text()
    assert optional_named(text) == OPTIONAL


# --- data blocks and what the commands write ---------------------------------------------

DATA = {"yaml", "yml", "toml", "json", "jsonl"}


def read_block(lang: str, body: str, folder: Path) -> None:
    """Read ``body`` as a user's file of its kind (module docstring); raises what the
    reader raises."""
    if lang in ("yaml", "yml", "toml"):
        path = folder / ("policy.toml" if lang == "toml" else "policy.yaml")
        path.write_text(body)
        if re.search(r"^questions", body, flags=re.M):
            read_policy(path)
        return
    try:
        recs = [json.loads(x) for x in body.splitlines() if x.strip()]
    except ValueError:
        json.loads(body)  # one JSON document over several lines (a response shown)
        return
    path = folder / "lines.jsonl"
    path.write_text(body)
    if all("question_id" in r for r in recs):
        list(read_results(path))
    elif all("image" in r or "custom_id" in r for r in recs):
        read_manifest(path)


def data_block_problems(text: str, folder: Path) -> list[str]:
    problems = []
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)
    for n, (lang, body) in enumerate(b for b in blocks if b[0] in DATA):
        try:
            read_block(lang, body, folder)
        except Exception as e:  # noqa: BLE001  (whatever the reader says is the problem)
            problems.append(f"{lang} block {n}: {type(e).__name__}: {e}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_data_block_reads_as_a_user_s_file(doc: Path, tmp_path: Path) -> None:
    assert data_block_problems(doc.read_text(), tmp_path) == []


def written_by(text: str) -> set[str]:
    """What the text's ``vlmbatch`` commands write: the values of ``-o``/``--out``,
    ``--job``, ``--write-policy``, and ``serve``'s data folder."""
    out = set()
    for words in commands(text):
        for flag, value in zip(words, words[1:]):
            if flag in ("-o", "--out", "--job", "--write-policy", "--data-dir"):
                out.add(value)
        if words[:1] == ["serve"] and "--data-dir" not in words:
            out.add(str(next(f.default for f in dataclasses.fields(ServerConfig)
                             if f.name == "data_dir")))
    return out


def test_the_readme_s_commands_leave_the_clone_clean() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git clone")
    written = written_by((ROOT / "README.md").read_text())
    assert {"results.csv", "runs/j1", "calibrated.yaml", "vlmbatch-server"} <= written
    kept = [p for p in sorted(written) if subprocess.run(
        ["git", "check-ignore", "-q", "--no-index", p], cwd=ROOT).returncode != 0]
    assert kept == [], f"not in .gitignore: {kept}"


# --- figures stated once ----------------------------------------------------------------

FIGURES = ROOT / "docs" / "figures.md"
FUZZ_TESTS = ROOT / "tests" / "inputs" / "test_fuzz_readers.py"


def figure_refs_in_code() -> dict[str, set[str]]:
    """``figures.md#ROW`` cited by each ``.py`` of ``vlmbatch/``, ``bench/``, ``scripts/``."""
    out = {}
    for top in ("vlmbatch", "bench", "scripts"):
        for f in sorted((ROOT / top).rglob("*.py")):
            if refs := set(re.findall(r"figures\.md#([\w-]+)", f.read_text())):
                out[rel(f)] = refs
    return out


def fuzz_settings(source: str) -> dict[str, int]:
    """Each test function's ``N``: the ``@fuzz(N)`` decorating a function inside it."""
    out = {}
    for test in ast.parse(source).body:
        if isinstance(test, ast.FunctionDef) and test.name.startswith("test_"):
            for d in (d for node in ast.walk(test) if isinstance(node, ast.FunctionDef)
                      for d in node.decorator_list):
                if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "fuzz":
                    out[test.name] = out.get(test.name, 0) + ast.literal_eval(d.args[0])
    return out


def fuzz_stated(figures: str, reliability: str) -> tuple[int, dict[str, int]]:
    """The total the ``reader-fuzz`` row of figures.md states (``**N** generated``), and the
    cases reliability.md's table gives each test (``| N ... | `test_x` |``)."""
    row = next(ln for ln in figures.splitlines() if '<a id="reader-fuzz">' in ln)
    found = re.search(r"\*\*([\d,]+)\*\* generated", row)
    per = re.findall(r"^\|[^|]+\| ([\d,]+)[^|]*\|[^|]+\| `(test_\w+)` \|$", reliability,
                     flags=re.M)
    return (int(found.group(1).replace(",", "")) if found else -1,
            {name: int(n.replace(",", "")) for n, name in per})


def fuzz_problems(source: str, figures: str, reliability: str) -> list[str]:
    run = fuzz_settings(source)
    total, per = fuzz_stated(figures, reliability)
    problems = [] if total == sum(run.values()) else [
        f"docs/figures.md#reader-fuzz: {total:,} generated, the tests run {sum(run.values()):,}"]
    return problems + [f"docs/reliability.md: {name} {per.get(name)}, the test runs {n:,}"
                       for name, n in sorted(run.items()) if per.get(name) != n]


def test_each_figure_cited_from_code_is_a_row_of_figures_md() -> None:
    rows = anchors(FIGURES.read_text())
    missing = {f: sorted(refs - rows) for f, refs in figure_refs_in_code().items()
               if refs - rows}
    assert not missing, f"figures.md rows cited but not there: {missing}"


def test_the_fuzz_counts_stated_are_the_tests_settings() -> None:
    assert fuzz_problems(FUZZ_TESTS.read_text(), FIGURES.read_text(),
                         (ROOT / "docs" / "reliability.md").read_text()) == []


# --- each check fails on a broken input ------------------------------------------------

def test_the_command_check_catches_an_unknown_option_and_subcommand() -> None:
    good = "```bash\nvlmbatch run m.jsonl --policy p.yaml -o out.csv  # ok\n```\n"
    assert command_problems(good) == []
    bad = ("```bash\nX=1 vlmbatch run m.jsonl --polcy p.yaml \\\n  --out o.jsonl\n"
           "printf 'a\\n' | vlmbatch embed -simm\nvlmbatch evals\n```\n"
           "and `vlmbatch serve --media-cache-gib 2`\n")
    problems = command_problems(bad)
    assert [p.rsplit(" ", 1)[-1] for p in problems] == ["--polcy", "-simm", "'evals'",
                                                         "--media-cache-gib"], problems


def test_the_link_check_catches_a_missing_file_and_anchor(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Two words (`x_y.py`)\n")
    text = ("[ok](docs/a.md) [ok](docs/a.md#two-words-x_ypy) [ok](#top) [web](https://x.org/y)"
            "\n[dead](docs/b.md) [anchor](docs/a.md#three-words) [here](#bottom)\n\n# Top\n")
    assert link_problems(text, tmp_path / "README.md") == [
        "(docs/b.md): no docs/b.md",
        "(docs/a.md#three-words): no heading #three-words in docs/a.md",
        "(#bottom): no heading #bottom in README.md"]


def test_the_path_check_catches_a_moved_module() -> None:
    assert path_problems("`vlmbatch/engine/base.py`, engine/build.py, docs/run.md, "
                         "jobs/folder.load_config, bench/*.py") == []
    assert path_problems("`vlmbatch/pipeline/torch_engine.py` and jobs/calibration.py, `tests/\n"
                         "  pipeline/test_fp8_model.py`") == [
        "jobs/calibration.py: not in the tree",
        "tests/pipeline/test_fp8_model.py: not in the tree",
        "vlmbatch/pipeline/torch_engine.py: not in the tree"]


def test_the_structure_checks_read_a_table_and_a_list() -> None:
    assert table_layers("| 0 | `__init__.py` | x |\n| 1 | `app/`, `jobs/` | y |\n") == [
        {"vlmbatch"}, {"vlmbatch.app", "vlmbatch.jobs"}]
    assert optional_named("a function imports only an optional\ndependency (ray, onnx: the"
                          ) == {"ray", "onnx"}


def test_the_data_block_check_catches_the_policy_that_did_not_parse(tmp_path: Path) -> None:
    good = '```yaml\nquestions:\n  - {id: red, text: "Is there a red shape?"}\n```\n'
    assert data_block_problems(good, tmp_path) == []
    bad = ("```yaml\nquestions:\n  - {id: red, text: Is there a red shape?}\n```\n"
           '```json\n{"id": "a", "image": "a.png", "questions": [{"text": "Red?", '
           '"treshold": 0.2}]}\n```\n')
    problems = data_block_problems(bad, tmp_path)
    assert [p.split(":")[0] for p in problems] == ["yaml block 0", "json block 1"], problems
    assert "cannot parse policy" in problems[0] and "did you mean 'threshold'" in problems[1]


def test_the_fuzz_check_catches_a_changed_setting() -> None:
    source = FUZZ_TESTS.read_text()
    figures, reliability = FIGURES.read_text(), (ROOT / "docs" / "reliability.md").read_text()
    total = sum(fuzz_settings(source).values())
    assert fuzz_settings(source)["test_whole_files"] == 800
    changed = source.replace("@fuzz(800)", "@fuzz(900)")
    assert fuzz_problems(changed, figures, reliability) == [
        f"docs/figures.md#reader-fuzz: {total:,} generated, the tests run {total + 100:,}",
        "docs/reliability.md: test_whole_files 800, the test runs 900"]
