"""Jobs over remote and tabular inputs: exactly once through kill -9 over a Parquet table and
over WebDataset shards; http(s) failures as each item's ``source`` error (status, timeout,
not found), retried by ``resume --retry-failed``; ``s3://`` images through a moto server;
the drive loop keeping many fetches in flight across groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.inputs.datasets_helpers import (
    answers,
    make_images,
    same,
    write_manifest,
    write_parquet,
    write_policy,
    write_shards,
)
from tests.jobs.interrupting import assert_each_once, resume, stop_at
from tests.jobs.test_job import cli
from tests.loopback import LoopbackServer
from tests.s3_server import s3_server
from vlmbatch.cli.commands import EXIT_ITEM_ERRORS, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.jobs.folder import STORE_FILE, status
from vlmbatch.jobs.store import JobStore

ROOT = Path(__file__).resolve().parents[2]


def model_opts(tmp_path: Path, model: Path, per_batch: int = 3) -> list[str]:
    return ["--model", str(model), "--policy", str(write_policy(tmp_path)),
            "--images-per-batch", str(per_batch), "--no-progress"]


def kill_mid_run(job: Path) -> None:
    """``vlmbatch run JOB`` in a subprocess, slowed per group, SIGKILLed after 3 items."""
    p = cli("run", str(job), "--no-progress", faults={"group_delay": 0.2})
    stop_at(p, job, 3, timeout=120)
    left = status(job)
    assert 0 < left.pending < left.done + left.failed + left.pending, left


# shards: slow (~30 s on 2 loaded cores; CI time): the same job store path as a table's rows
@pytest.mark.parametrize("form", ["parquet", pytest.param("shards", marks=pytest.mark.slow)])
def test_kill_minus_9_then_resume_answers_each_row_or_member_once(
        tmp_path: Path, random_model_dir: Path, form: str) -> None:
    n = 24
    images = make_images(tmp_path / "img", n)
    if form == "parquet":
        text = str(write_parquet(tmp_path / "t.parquet", {"image": [p.read_bytes()
                                                                     for p in images]}))
        ids = [f"t.parquet:{i}" for i in range(n)]
    else:
        write_shards(tmp_path / "s", images, per_shard=10)
        text = str(tmp_path / "s" / "{0000..0002}.tar")
        ids = [f"{i // 10:04d}.tar:sample{i:04d}" for i in range(n)]
    job = tmp_path / "job"
    opts = model_opts(tmp_path, random_model_dir, per_batch=1)
    assert main(["submit", text, "--job", str(job), *opts]) == EXIT_OK
    spec = (job / STORE_FILE).stat().st_size
    assert spec < 200_000  # references, not images (the images alone are larger)
    kill_mid_run(job)
    assert status(job).status == "interrupted"
    resume(job)
    lines = assert_each_once(job, ids)
    assert all(ln["error"] is None for ln in lines)
    direct = tmp_path / "direct.jsonl"
    assert main(["run", text, "-o", str(direct), *opts]) == EXIT_OK
    out = tmp_path / "r.jsonl"
    assert main(["results", str(job), "-o", str(out)]) == EXIT_OK
    assert answers(out) == answers(direct)


def test_http_failures_are_item_errors_and_retry_failed_fetches_again(
        tmp_path: Path, random_model_dir: Path) -> None:
    images = make_images(tmp_path / "img", 6)
    files = {p.name: p.read_bytes() for p in images}
    opts = model_opts(tmp_path, random_model_dir)
    local = write_manifest(tmp_path, images, [f"i{i}" for i in range(6)])
    assert main(["run", str(local), "-o", str(tmp_path / "want.jsonl"), *opts]) == EXIT_OK
    with LoopbackServer(files) as server:
        server.failing = {images[1].name, images[4].name}
        urls = [server.url(f"/flaky/{p.name}") for p in images]
        m = write_manifest(tmp_path, images, [f"i{i}" for i in range(6)], urls)
        job = tmp_path / "job"
        assert main(["submit", str(m), "--job", str(job), *opts, "--fetch-retries", "1",
                     "--wait"]) == EXIT_ITEM_ERRORS
        store = JobStore(job / STORE_FILE)
        failed = {d["id"]: d for (r,) in store.db.execute(
            "SELECT result FROM items WHERE state = 'failed'") for d in json.loads(r)}
        store.close()
        assert sorted(failed) == ["i1", "i4"]
        assert all(d["error_kind"] == "source" and "HTTP 503" in d["error"]
                   for d in failed.values())
        assert server.requests[f"/flaky/{images[1].name}"] == 2  # retried once
        server.failing = set()
        assert main(["resume", str(job), "--retry-failed", "--no-progress"]) == EXIT_OK
        out = tmp_path / "r.jsonl"
        assert main(["results", str(job), "-o", str(out)]) == EXIT_OK
        assert same(answers(out), answers(tmp_path / "want.jsonl"))
        bad = write_manifest(tmp_path, images[:3], ["slow", "gone", "denied"], [
            server.url(f"/slow/3000/{images[0].name}"), server.url("/img/none.png"),
            server.url("/status/403/x")])
        assert main(["run", str(bad), "-o", str(out), *opts, "--fetch-timeout", "0.5"]) \
            == EXIT_ITEM_ERRORS
    errors = {d["id"]: d["error"] for d in map(json.loads, out.read_text().splitlines())}
    assert "timed out after 0.5s" in errors["slow"]
    assert "HTTP 404" in errors["gone"] and "not found" in errors["gone"]
    assert "HTTP 403" in errors["denied"] and "access denied" in errors["denied"]


def test_s3_images_answer_as_local_files(tmp_path: Path, random_model_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("s3fs")
    images = make_images(tmp_path / "img", 4)
    opts = model_opts(tmp_path, random_model_dir)
    ids = [f"i{i}" for i in range(4)]
    local = write_manifest(tmp_path, images, ids)
    assert main(["run", str(local), "-o", str(tmp_path / "want.jsonl"), *opts]) == EXIT_OK
    with s3_server(monkeypatch, {f"x/{p.name}": p.read_bytes() for p in images}):
        m = write_manifest(tmp_path, images, ids + ["none"],
                           [f"s3://images/x/{p.name}" for p in images] + ["s3://images/no.png"])
        out = tmp_path / "s3.jsonl"
        assert main(["run", str(m), "-o", str(out), *opts]) == EXIT_ITEM_ERRORS
    got = answers(out)
    assert same({k: v for k, v in got.items() if k[0] != "none"}, answers(tmp_path / "want.jsonl"))
    assert all("not found" in v[2] for k, v in got.items() if k[0] == "none")


NO_CREDENTIALS = {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
                  "AWS_EC2_METADATA_DISABLED": "true"}


def test_an_object_store_without_credentials_fails_its_item_not_the_job(
        tmp_path: Path, random_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore's ``NoCredentialsError`` (no AWS credentials anywhere) is the s3 item's
    ``source`` error, the local items answered and the job done (exit 3); with the
    credentials back, ``resume --retry-failed`` answers it."""
    pytest.importorskip("s3fs")
    images = make_images(tmp_path / "img", 3)
    job = tmp_path / "job"
    with s3_server(monkeypatch, {"x/0.png": images[0].read_bytes()}):
        m = write_manifest(tmp_path, images, ["s3", "a", "b"],
                           ["s3://images/x/0.png", str(images[1]), str(images[2])])
        with monkeypatch.context() as bare:
            for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
                bare.delenv(k)
            for k, v in NO_CREDENTIALS.items():
                bare.setenv(k, v)
            assert main(["submit", str(m), "--job", str(job), "--wait",
                         *model_opts(tmp_path, random_model_dir)]) == EXIT_ITEM_ERRORS
            st = status(job)
            assert (st.status, st.done, st.failed, st.pending) == ("done", 2, 1, 0), st
            out = tmp_path / "r.jsonl"
            assert main(["results", str(job), "-o", str(out)]) == EXIT_OK
            lines = [json.loads(x) for x in out.read_text().splitlines()]
            bad = [d for d in lines if d["id"] == "s3"]
            assert bad and all(d["error_kind"] == "source" and "NoCredentialsError" in d["error"]
                               for d in bad), bad
            assert all(d["error"] is None for d in lines if d["id"] != "s3")
            direct = tmp_path / "direct.jsonl"  # a plain run: the same lines, exit 3
            assert main(["run", str(m), "-o", str(direct),
                         *model_opts(tmp_path, random_model_dir)]) == EXIT_ITEM_ERRORS
            assert answers(direct) == answers(out)
        assert main(["resume", str(job), "--retry-failed", "--no-progress"]) == EXIT_OK
    assert (status(job).done, status(job).failed) == (3, 0)


def test_the_drive_loop_keeps_many_fetches_in_flight(tmp_path: Path,
                                                     random_model_dir: Path) -> None:
    """64 images that each take 200 ms to arrive, in groups of 4: with 32-way fetching the
    loop looks far enough ahead that about 32 requests wait at once (groups of 4 with the
    default 2 ahead would allow 12)."""
    images = make_images(tmp_path / "img", 8)
    with LoopbackServer({p.name: p.read_bytes() for p in images}) as server:
        urls = [server.url(f"/slow/200/{images[i % 8].name}?{i}") for i in range(64)]
        m = write_manifest(tmp_path, images * 8, [f"i{i}" for i in range(64)], urls)
        out = tmp_path / "r.jsonl"
        assert main(["run", str(m), "-o", str(out), *model_opts(tmp_path, random_model_dir, 4),
                     "--fetch-concurrency", "32"]) == EXIT_OK
        # >= 16: more than the 12 the default lookahead allows, with room for a loaded machine
        assert server.max_in_flight >= 16, server.max_in_flight
