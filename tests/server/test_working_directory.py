"""Every child interpreter imports its parent's ``vlmbatch`` whatever the working directory
(issue 38): ``vlmbatch serve`` (its engine process, its decoder processes) and ``vlmbatch
run`` (its decoder processes; on Ray, its workers) started from a folder holding another
``vlmbatch/`` (a clone's root; here a decoy that fails loudly when imported) answer as they
do from the repository's root. And a batch the server cannot run (submitted with other
engine settings) ends ``failed`` with ``errors`` saying why, as the official client's
polling sees it, instead of staying ``in_progress`` forever."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.serving import (
    IMAGES,
    ROOT,
    Server,
    chat_body,
    create_batch,
    data_url,
    engine_pids,
    wait_batch,
)
from vlmbatch.cli.commands import EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.engine.config import EngineConfig
from vlmbatch.jobs.job import submit
from vlmbatch.server.batch_worker import batch_run_config
from vlmbatch.server.batches import BatchBook
from vlmbatch.server.config import ServerConfig

MANIFEST, POLICY = ROOT / "examples" / "manifest.jsonl", ROOT / "examples" / "policy.yaml"
DECOY = 'raise ImportError(f"a decoy vlmbatch was imported from {__file__}")\n'


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding a ``vlmbatch/`` package other than ours."""
    folder = tmp_path_factory.mktemp("clone")
    (folder / "vlmbatch").mkdir()
    (folder / "vlmbatch" / "__init__.py").write_text(DECOY)
    (folder / "vlmbatch" / "__main__.py").write_text(DECOY)
    return folder


def vlmbatch_command() -> list[str]:
    """``vlmbatch`` as a user starts it: the console script (its own folder on ``sys.path``,
    not the working directory)."""
    script = Path(sys.executable).parent / "vlmbatch"
    return [str(script)] if script.is_file() else [sys.executable, "-P", "-m", "vlmbatch"]


@pytest.fixture(scope="module")
def run_lines(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """``vlmbatch run`` of the examples from the repository's root (in this process)."""
    out = tmp_path_factory.mktemp("run") / "root.jsonl"
    assert main(["run", str(MANIFEST), "--policy", str(POLICY), "-o", str(out),
                 "--no-progress"]) == EXIT_OK
    return out.read_text().splitlines()


def run_from(clone: Path, out: Path, *extra: str) -> list[str]:
    r = subprocess.run([*vlmbatch_command(), "run", str(MANIFEST), "--policy", str(POLICY),
                        "-o", str(out), "--no-progress", *extra], cwd=clone,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == EXIT_OK, r.stdout + r.stderr
    return out.read_text().splitlines()


def test_run_from_a_clone_answers_as_from_the_root(clone: Path, tmp_path: Path,
                                                   run_lines: list[str]) -> None:
    assert run_from(clone, tmp_path / "clone.jsonl") == run_lines


@pytest.mark.slow  # a local Ray instance: ~1 min on 2 cores
def test_run_on_ray_from_a_clone_answers_as_from_the_root(clone: Path, tmp_path: Path,
                                                         run_lines: list[str]) -> None:
    got = run_from(clone, tmp_path / "ray.jsonl", "--executor", "ray",
                   "--preprocess-workers", "1", "--model-workers", "1", "--model-cpus", "1")
    def key(line: dict) -> tuple[str, str]:
        return line["id"], line["question_id"]

    want = {key(json.loads(x)): json.loads(x) for x in run_lines}
    assert sorted(key(json.loads(x)) for x in got) == sorted(want)
    for line in map(json.loads, got):
        assert line["p_yes"] == pytest.approx(want[key(line)]["p_yes"], abs=1e-5)


def stranded_batch(data: Path, tmp: Path) -> str:
    """A batch in progress on ``data`` whose job was submitted with other engine settings
    (``--no-prefix-cache``): what a server started with other options finds."""
    (tmp / "in.jsonl").write_text(
        json.dumps({"id": "s0", "image": str(IMAGES / "scene_00.png"),
                    "questions": ["Is there a red shape?"]}) + "\n")
    book = BatchBook(data / "batches")
    rec = book.create("/v1/chat/completions", "file-" + "0" * 32, "24h", None)
    other = ServerConfig(data_dir=data, engine=EngineConfig(prefix_cache=False))
    submit(batch_run_config(tmp / "in.jsonl", other), book.job_of(rec.id))
    book.update(rec.id, lambda r: r.at("in_progress"))
    return rec.id


def test_serve_from_a_clone_answers_and_a_stranded_batch_fails(
        clone: Path, tmp_path: Path, run_lines: list[str]) -> None:
    data = tmp_path / "data"
    stranded = stranded_batch(data, tmp_path)
    s = Server(data, command=vlmbatch_command(), cwd=clone).wait_ready()
    try:
        assert len(engine_pids(s)) == 1
        client = s.openai()
        first = json.loads(run_lines[0])
        item = next(json.loads(x) for x in MANIFEST.read_text().splitlines()
                    if json.loads(x)["id"] == first["id"])
        image = (MANIFEST.parent / item["image"]).resolve()
        r = client.chat.completions.create(**chat_body(
            data_url(image), first["question"], max_tokens=1))
        assert r.model_extra["vlmbatch"]["p_yes"] == pytest.approx(first["p_yes"], abs=1e-6)
        # an embeddings batch on the built-in embedding model (its path: the same folder in
        # both processes, else the batch would be refused as another model's)
        line = json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                           "body": {"model": "vlmbatch", "input": "a red circle"}})
        b = wait_batch(client, create_batch(client, line + "\n", "/v1/embeddings").id,
                       timeout=120)
        assert b.status == "completed" and b.request_counts.completed == 1, b
        failed = wait_batch(client, stranded, timeout=60)  # polled as a user's loop would
    finally:
        assert s.stop() in (0, 143), s.output()
    assert failed.status == "failed", failed
    (err,) = failed.errors.data
    assert "cannot run on this server" in err.message
    assert "engine.prefix_cache False (this server: True)" in err.message
