"""Embedding jobs (``submit --task embed``): the same vectors as ``vlmbatch embed``, every
item recorded exactly once across a kill -9 and a resume, status, results as JSONL / Parquet /
.npy, on the in-process and the Ray executors; yes/no jobs' files stay as they were."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.jobs.interrupting import assert_each_once, resume, stop_at
from tests.jobs.test_job import cli, make_manifest
from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_ITEM_ERRORS, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.jobs.folder import JOB_FILE, STORE_FILE, status
from vlmbatch.jobs.store import JobStore
from vlmbatch.pipeline.records import Embedding


def embed_manifest(folder: Path, n: int) -> Path:
    """``n`` items cycling image / text / image + text, and one missing image."""
    rng = np.random.default_rng(3)
    rows = []
    for i in range(n):
        cv2.imwrite(str(folder / f"{i}.png"), rng.integers(0, 256, (30 + 7 * i, 50, 3),
                                                            dtype=np.uint8))
        rows.append([{"id": f"i{i}", "image": f"{i}.png"}, {"id": f"t{i}", "text": f"shape {i}"},
                     {"id": f"b{i}", "image": f"{i}.png", "text": "a caption"}][i % 3])
    rows.append({"id": "gone", "image": "missing.png"})
    (folder / "e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "e.jsonl"


def stored(job: Path) -> list[Embedding]:
    store = JobStore(job / STORE_FILE)
    try:
        return [Embedding.from_record(d) for d in store.records()]
    finally:
        store.close()


def submit(tmp_path: Path, model: Path, n: int, *options: str) -> tuple[Path, Path]:
    m = embed_manifest(tmp_path, n)
    job = tmp_path / "job"
    assert main(["submit", str(m), "--task", "embed", "--job", str(job), "--model", str(model),
                 "--no-progress", *options]) == EXIT_OK
    return m, job


def test_embed_job_equals_direct_embed(tmp_path: Path, random_model_dir: Path,
                                       capsys) -> None:  # noqa: ANN001
    m, job = submit(tmp_path, random_model_dir, 7, "--images-per-batch", "3", "--pooling",
                    "last")
    assert json.loads((job / JOB_FILE).read_text())["version"] == 6
    assert main(["run", str(job), "--no-progress"]) == EXIT_ITEM_ERRORS  # the missing image
    st = status(job)
    assert (st.task, st.done, st.failed, st.pending, st.questions) == ("embed", 7, 1, 0, 8)
    assert "embeddings" in st.text() and "items" in st.text()
    direct = tmp_path / "d.jsonl"
    assert main(["embed", "--manifest", str(m), "-o", str(direct), "--pooling", "last",
                 "--images-per-batch", "3", "--model",
                 str(random_model_dir)]) == EXIT_ITEM_ERRORS  # batched as the job is
    out = tmp_path / "r.jsonl"
    assert main(["results", str(job), "-o", str(out)]) == EXIT_OK
    assert out.read_text() == direct.read_text()  # bit for bit, order included
    npy = tmp_path / "r.npy"
    assert main(["results", str(job), "-o", str(npy)]) == EXIT_OK
    arr = np.load(npy)
    assert arr.shape == (8, 32) and np.isnan(arr[7]).all() and not np.isnan(arr[:7]).any()
    pq = pytest.importorskip("pyarrow.parquet")
    assert main(["results", str(job), "-o", str(tmp_path / "r.parquet")]) == EXIT_OK
    rows = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert np.abs(np.array(rows[0]["embedding"], np.float32) - arr[0]).max() == 0
    assert main(["results", str(job), "-o", str(tmp_path / "r.csv")]) == EXIT_BAD_INPUT


@pytest.mark.slow
def test_kill_minus_9_then_resume_embeds_each_item_once(tmp_path: Path,
                                                        random_model_dir: Path) -> None:
    _, job = submit(tmp_path, random_model_dir, 24, "--images-per-batch", "1")
    p = cli("run", str(job), "--no-progress", faults={"group_delay": 0.2})
    stop_at(p, job, 3, timeout=60)
    assert status(job).status == "interrupted" and 0 < status(job).pending < 25
    resume(job, rc=EXIT_ITEM_ERRORS)
    # one embedding per item, no more
    assert_each_once(job, [f"{'itb'[i % 3]}{i}" for i in range(24)] + ["gone"], per_item=1,
                     failed=1)


def test_submit_checks_embedding_options(tmp_path: Path, random_model_dir: Path,
                                         capsys) -> None:  # noqa: ANN001
    m = embed_manifest(tmp_path, 2)
    rc = main(["submit", str(m), "--task", "embed", "--job", str(tmp_path / "j"), "--model",
               str(random_model_dir), "--dimensions", "4"])
    assert rc == EXIT_BAD_INPUT and not (tmp_path / "j").exists()
    assert "declares no Matryoshka sizes" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"id": "x", "questions": ["Red?"]}\n')
    assert main(["submit", str(tmp_path / "bad.jsonl"), "--task", "embed", "--job",
                 str(tmp_path / "j"), "--model", str(random_model_dir)]) == EXIT_BAD_INPUT
    assert "unknown key(s) ['questions']" in capsys.readouterr().err


def test_job_files_of_earlier_versions_load(tmp_path: Path, random_model_dir: Path) -> None:
    """A job is written at the current version (6: the engine's choice scoring; 5: the pixel
    limit, preprocessing threads and decode timeout in ``prepare``); version 5 (no choice
    scoring: exact), version 4 (those three apart: two at the top, the timeout the
    executor's), version 3 (the timeout among the Ray options) and version 2 (no task keys
    either) load as the same config, the task "answer"."""
    from vlmbatch.jobs.config import RunConfig
    from vlmbatch.jobs.folder import load_config

    m = make_manifest(tmp_path, 2)
    assert main(["submit", str(m), "--job", str(tmp_path / "j"), "--model",
                 str(random_model_dir), "--decode-timeout", "7", "--max-pixels", "12345",
                 "--preprocess-threads", "1"]) == EXIT_OK
    path = tmp_path / "j" / JOB_FILE
    d = json.loads(path.read_text())
    assert d["version"] == RunConfig.VERSION == 6 and d["config"]["task"] == "answer"
    assert d["config"]["engine"]["choice_scoring"] == "exact"
    prepare = d["config"]["prepare"]
    assert {k: prepare[k] for k in ("max_pixels", "preprocess_threads", "decode_timeout")} \
        == {"max_pixels": 12345, "preprocess_threads": 1, "decode_timeout": 7}
    current = load_config(tmp_path / "j")
    five = json.loads(json.dumps(d["config"]))
    del five["engine"]["choice_scoring"]
    path.write_text(json.dumps({**d, "version": 5, "config": five}))
    assert load_config(tmp_path / "j") == current
    for version in (4, 3, 2):
        body = json.loads(json.dumps(five))
        prepare = body.pop("prepare")
        body["max_pixels"], body["preprocess_threads"] = (prepare["max_pixels"],
                                                          prepare["preprocess_threads"])
        if version == 4:
            body["executor"]["decode_timeout"] = prepare["decode_timeout"]
        else:
            body["executor"]["ray"]["decode_timeout"] = prepare["decode_timeout"]
        if version == 2:
            del body["task"], body["embed"]
        path.write_text(json.dumps({**d, "version": version, "config": body}))
        old = load_config(tmp_path / "j")
        assert old == current and old.prepare.decode_timeout == 7, version
        assert (old.prepare.max_pixels, old.prepare.preprocess_threads) == (12345, 1), version
    assert status(tmp_path / "j").task == "answer"
    assert main(["run", str(tmp_path / "j"), "--no-progress"]) == EXIT_OK


@pytest.mark.slow
def test_embed_job_on_ray(tmp_path: Path, random_model_dir: Path) -> None:
    pytest.importorskip("ray")
    m, job = submit(tmp_path, random_model_dir, 6, "--images-per-batch", "2")
    assert main(["run", str(job), "--no-progress", "--executor", "ray", "--model-cpus",
                 "1"]) == EXIT_ITEM_ERRORS
    local = tmp_path / "local"
    local.mkdir()
    _, job2 = submit(local, random_model_dir, 6, "--images-per-batch", "2")
    main(["run", str(job2), "--no-progress"])
    got, want = stored(job), stored(job2)
    assert [e.id for e in got] == [e.id for e in want] and len(got) == 7
    for a, b in zip(got, want):
        assert a.error_kind == b.error_kind
        if b.vector is not None:
            assert a.vector is not None and np.abs(a.vector - b.vector).max() <= 1e-5


def test_a_damaged_embedding_record_is_a_message_not_a_traceback(
        tmp_path: Path, random_model_dir: Path, capsys) -> None:  # noqa: ANN001
    """A stored vector that no longer decodes (or a missing key) is ``StoreDamaged`` naming
    the item (exit 2), as a damaged answer is; the rest of the store stays readable."""
    import sqlite3

    _, job = submit(tmp_path, random_model_dir, 3)
    assert main(["run", str(job), "--no-progress"]) == EXIT_ITEM_ERRORS  # the missing image
    db = sqlite3.connect(job / STORE_FILE)
    (idx, result), = db.execute("SELECT idx, result FROM items ORDER BY idx LIMIT 1")
    for damaged in (json.dumps([{**d, "vector": "AAAA"} for d in json.loads(result)]),  # 3 bytes
                    json.dumps([{k: v for k, v in d.items() if k != "shape"}
                                for d in json.loads(result)])):
        db.execute("UPDATE items SET result = ? WHERE idx = ?", (damaged, idx))
        db.commit()
        capsys.readouterr()
        assert main(["results", str(job), "-o", str(tmp_path / "v.jsonl")]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert f"is damaged: item {idx} is unreadable" in err and "Traceback" not in err
        assert not (tmp_path / "v.jsonl").exists()
    db.close()
