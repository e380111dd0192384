"""The CLI starts at once: ``vlmbatch --help``, ``COMMAND --help``, ``status``, ``cancel`` and
``results`` (JSONL, CSV) import neither torch, transformers nor fastapi (nor OpenCV, nor
matplotlib: only `calibrate --plots` needs it), with
their usual exit codes and outputs.

Each command runs as ``python -X importtime -m vlmbatch ...`` in a fresh interpreter: the
import-time lines on stderr name every module it imported, the rest is the command's own
output. The timing is ``bench/startup.py``'s (a benchmark, not a test).
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.pipeline.records import Answer

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "cv2", "matplotlib")
COMMANDS = ["run", "submit", "status", "cancel", "resume", "results", "eval", "calibrate",
            "report", "quantize", "export-vit", "embed", "serve", "bench"]


@dataclass
class Ran:
    rc: int
    out: str
    err: str  # the command's stderr, without the import-time lines
    modules: set[str]

    def heavy(self) -> list[str]:
        return [m for m in HEAVY if m in self.modules]


def cli(*args: str, env: dict[str, str] | None = None) -> Ran:
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "vlmbatch", *args],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, **(env or {})})
    modules, err = set(), []
    for line in p.stderr.splitlines(keepends=True):
        if line.startswith("import time:"):
            modules.add(line.rsplit("|", 1)[1].strip())
        else:
            err.append(line)
    return Ran(p.returncode, p.stdout, "".join(err), modules)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a job answered to the end, a job submitted and never run): two images, two
    questions each, the built-in model."""
    tmp = tmp_path_factory.mktemp("startup")
    lines = [json.dumps({"id": f"s{i}", "image": str(ROOT / f"examples/images/scene_0{i}.png"),
                         "questions": [{"id": "q0", "text": "Is there a red shape?"},
                                       {"id": "q1", "text": "Is there a circle?"}]})
             for i in range(2)]
    manifest = tmp / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    done, pending = tmp / "done", tmp / "pending"
    assert main(["submit", str(manifest), "--job", str(done), "--wait", "--no-progress"]) == 0
    assert main(["submit", str(manifest), "--job", str(pending)]) == 0
    return done, pending


def test_help_imports_nothing_heavy() -> None:
    r = cli("--help")
    assert r.rc == EXIT_OK and r.heavy() == [] and "vlmbatch.cli.main" in r.modules
    assert all(c in r.out for c in COMMANDS) and r.out.startswith("usage: vlmbatch")
    r = cli("run", "--help")
    assert r.rc == EXIT_OK and r.heavy() == []
    assert "--vit-backend {auto,compile,onnxruntime" in r.out
    assert "--engine {torch,lmdeploy}" in r.out


def test_every_command_help_imports_nothing_heavy() -> None:
    """Every subcommand's parser, choices and defaults included, in one interpreter: the
    parser is built whole whatever the command, so one process sees what each would."""
    code = ("import sys\nfrom vlmbatch.cli.main import main\n"
            f"for c in {COMMANDS!r}:\n"
            "    try:\n        main([c, '--help'])\n"
            "    except SystemExit as e:\n        assert e.code == 0, (c, e.code)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{HEAVY!r}))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("usage: vlmbatch ") == len(COMMANDS)
    assert p.stdout.splitlines()[-1] == "[]"


WEB = ("fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core", "multipart")
# a whole run in a fresh interpreter, then the web modules it left in ``sys.modules``
RUN_PROBE = """import json, runpy, sys
sys.argv = ["vlmbatch", *sys.argv[1:]]
try:
    runpy.run_module("vlmbatch", run_name="__main__", alter_sys=True)
except SystemExit as e:
    rc = e.code
print(json.dumps({"rc": rc, "web": sorted(m for m in sys.modules
                                          if m.split(".")[0] in %r)}))
"""


def test_run_imports_nothing_of_the_http_stack(tmp_path: Path) -> None:
    """``vlmbatch run`` answers the examples without loading FastAPI, Starlette, uvicorn or
    pydantic: only ``serve`` imports the server (``cli/serve_command.py``)."""
    p = subprocess.run([sys.executable, "-c", RUN_PROBE % (WEB,), "run",
                        "examples/manifest.jsonl", "--policy", "examples/policy.yaml",
                        "-o", str(tmp_path / "out.jsonl"), "--no-progress"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    got = json.loads(p.stdout.splitlines()[-1])
    assert got["rc"] == EXIT_OK and (tmp_path / "out.jsonl").stat().st_size > 0, p.stderr
    assert got["web"] == [], got["web"]


def test_status_and_cancel_import_nothing_heavy(jobs: tuple[Path, Path]) -> None:
    done, pending = jobs
    r = cli("status", str(done))
    assert (r.rc, r.heavy()) == (EXIT_OK, [])
    assert r.out.startswith("done: 2/2 images (0 failed, 0 pending), 4 questions")
    r = cli("status", str(pending), "--json")
    assert (r.rc, r.heavy()) == (EXIT_OK, [])
    st = json.loads(r.out)
    assert (st["status"], st["items"], st["pending"], st["job"]) == (
        "submitted", 2, 2, str(pending))
    r = cli("cancel", str(pending))
    assert (r.rc, r.heavy()) == (EXIT_OK, [])
    assert r.err == f"vlmbatch: job {pending} is not running (submitted); nothing to cancel\n"
    r = cli("status", str(done.parent / "nojob"))
    assert (r.rc, r.heavy()) == (EXIT_BAD_INPUT, [])
    assert r.err.startswith("vlmbatch: error: ") and "job.json" in r.err


def test_results_jsonl_and_csv_import_nothing_heavy(jobs: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    done, _ = jobs
    r = cli("results", str(done))
    assert (r.rc, r.heavy(), r.err) == (EXIT_OK, [], "vlmbatch: 4 result lines\n")
    lines = [json.loads(x) for x in r.out.splitlines()]
    assert [(x["id"], x["question_id"]) for x in lines] == [
        ("s0", "q0"), ("s0", "q1"), ("s1", "q0"), ("s1", "q1")]
    assert all(0 <= x["p_yes"] <= 1 and x["error"] is None for x in lines)
    r = cli("results", str(done), "--format", "csv")
    assert (r.rc, r.heavy()) == (EXIT_OK, [])
    rows = list(csv.reader(io.StringIO(r.out)))
    assert rows[0] == [name for name, _ in Answer.COLUMNS] and len(rows) == 5
    out = tmp_path / "r.csv"
    r = cli("results", str(done), "-o", str(out))
    assert (r.rc, r.heavy()) == (EXIT_OK, []) and out.read_text().splitlines() == [
        ",".join(row) for row in rows]


def test_opencv_stays_silent_about_a_broken_image(tmp_path: Path) -> None:
    """OpenCV logs lines of its own about a broken image (4.x: a ``[ WARN`` line for a PNG
    cut after its header; 5.x logs nothing for that one); decoded in this process
    (``--decode-timeout 0``), the run shows only the item's error line:
    ``cli._quiet_opencv`` sets OpenCV's log level to silent once the command's module
    (``model_commands``, which every image-decoding command lives in) has loaded it. The log
    level is checked directly, so the test holds whatever a given OpenCV release logs."""
    import cv2
    import numpy as np

    ok, png = cv2.imencode(".png", np.full((32, 32, 3), 200, np.uint8))
    broken = tmp_path / "broken.png"
    broken.write_bytes(png.tobytes()[:60])
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "b", "image": str(broken), "questions": [
        {"id": "q", "text": "Is there a circle?"}]}) + "\n")
    r = cli("run", str(manifest), "--decode-timeout", "0", "--no-progress")
    line = json.loads(r.out)
    assert r.rc == 3 and "not a decodable image" in line["error"]
    assert "WARN" not in r.err and "grfmt" not in r.err, r.err
    # the level the CLI leaves OpenCV at, in a fresh interpreter (as each command runs)
    probe = ("import cv2, sys\nfrom vlmbatch.cli import main as cli\nbefore = "
             "cv2.utils.logging.getLogLevel()\ncli._quiet_opencv()\n"
             "print(before, cv2.utils.logging.getLogLevel())")
    env = {k: v for k, v in os.environ.items() if k != "OPENCV_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, env=env).stdout.split()
    silent = cv2.utils.logging.LOG_LEVEL_SILENT
    assert int(out[0]) > silent and int(out[1]) == silent, out  # loud before, silent after
