"""Jobs: submit, run, kill -9 and resume (exactly once), cancel, status, results."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.jobs.interrupting import assert_each_once, resume, stop, stop_at, wait_recorded
from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.jobs.config import ExecutorConfig
from vlmbatch.jobs.folder import STORE_FILE, status
from vlmbatch.jobs.store import JobStore

ROOT = Path(__file__).resolve().parents[2]


def make_manifest(folder: Path, n: int, broken: int = 0) -> Path:
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        img = rng.integers(0, 256, (40 + i % 30, 60, 3), dtype=np.uint8)
        cv2.imwrite(str(folder / f"{i}.png"), img)
        lines.append({"id": f"img{i}", "image": f"{i}.png", "questions": ["Red?", "A circle?"]})
    for i in range(broken):
        lines.append({"id": f"bad{i}", "image": "missing.png", "questions": ["Red?"]})
    (folder / "m.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder / "m.jsonl"


def submit_job(folder: Path, model: Path, n: int, *options: str, broken: int = 0,
               rc: int = EXIT_OK) -> tuple[Path, Path]:
    """``make_manifest(folder, n, broken)`` submitted as the job ``folder/job`` with ``model``
    and ``options`` (``--wait`` runs it: ``rc`` is then 3 when an item fails); returns
    (manifest, job)."""
    m = make_manifest(folder, n, broken)
    job = folder / "job"
    assert main(["submit", str(m), "--job", str(job), "--model", str(model), *options]) == rc
    return m, job


def cli(*args: str, env: dict | None = None, faults: dict | None = None,
        **kw) -> subprocess.Popen:  # noqa: ANN003
    """``vlmbatch ARGS`` in a subprocess; ``faults``: hooks for it (``tests/faults.py``)."""
    cmd = (["-m", "vlmbatch"] if faults is None
           else ["-m", "tests.faults", json.dumps(faults), "--"])
    return subprocess.Popen([sys.executable, *cmd, *args], cwd=ROOT,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_submit_run_results_match_direct_run(tmp_path: Path, random_model_dir: Path) -> None:
    m = make_manifest(tmp_path, 6, broken=1)
    job = tmp_path / "job"
    args = ["--model", str(random_model_dir), "--images-per-batch", "2", "--no-progress"]
    assert main(["submit", str(m), "--job", str(job), *args]) == EXIT_OK
    assert status(job).pending == 7 and status(job).status == "submitted"
    assert main(["run", str(job), "--no-progress"]) == 3  # one item failed
    out = tmp_path / "r.jsonl"
    assert main(["results", str(job), "-o", str(out)]) == EXIT_OK
    direct = tmp_path / "d.jsonl"
    main(["run", str(m), "-o", str(direct), *args])
    assert out.read_text() == direct.read_text()
    st = status(job)
    assert (st.status, st.done, st.failed, st.pending, st.questions) == ("done", 6, 1, 0, 13)


def test_kill_minus_9_then_resume_answers_each_item_once(tmp_path: Path,
                                                         random_model_dir: Path) -> None:
    _, job = submit_job(tmp_path, random_model_dir, 30, "--images-per-batch", "1", "--no-progress")
    p = cli("run", str(job), "--no-progress", faults={"group_delay": 0.2})
    wait_recorded(p, job, 3, timeout=60)
    seen = status(job)  # status from another process while the job runs
    assert seen.status == "running" and 3 <= seen.done < 30
    stop(p, signal.SIGKILL)
    assert status(job).status == "interrupted"  # its process is gone
    left = status(job)
    assert 0 < left.pending < 30, left
    resume(job)
    assert_each_once(job, [f"img{i}" for i in range(30)])
    assert status(job).status == "done"


def test_sigterm_marks_the_job_interrupted_and_resume_finishes_it(
        tmp_path: Path, random_model_dir: Path) -> None:
    """A scheduler's SIGTERM (preemption, `docker stop`): exit 143, the store itself says
    interrupted (not inferred from a dead pid), no item is half-recorded, resume finishes."""
    _, job = submit_job(tmp_path, random_model_dir, 30, "--images-per-batch", "1",
                        "--no-progress")
    p = cli("run", str(job), "--no-progress", faults={"group_delay": 0.2})
    err = stop_at(p, job, 2, signal.SIGTERM, timeout=60)
    assert p.returncode == 143 and "terminated (SIGTERM)" in err, err
    assert "vlmbatch resume JOB" in err
    store = JobStore(job / STORE_FILE)
    assert store.get("status") == "interrupted"
    left = store.counts()
    store.close()
    assert 0 < left.pending < 30 and left.done + left.pending == 30
    resume(job)
    assert status(job).done == 30


def test_cancel_stops_and_resume_continues(tmp_path: Path, random_model_dir: Path) -> None:
    _, job = submit_job(tmp_path, random_model_dir, 30, "--images-per-batch", "1", "--no-progress")
    p = cli("run", str(job), "--no-progress", faults={"group_delay": 0.2})
    wait_recorded(p, job, 2, timeout=60)
    assert main(["cancel", str(job)]) == EXIT_OK
    assert p.wait(timeout=30) == 3  # stopped with work left
    st = status(job)
    assert st.status == "cancelled" and st.pending > 0
    resume(job)
    assert status(job).pending == 0


def test_job_errors(tmp_path: Path, random_model_dir: Path, capsys) -> None:  # noqa: ANN001
    m, job = submit_job(tmp_path, random_model_dir, 1)
    assert main(["submit", str(m), "--job", str(job)]) == EXIT_BAD_INPUT
    assert "already exists" in capsys.readouterr().err
    assert main(["status", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "not a vlmbatch job" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["status"])


def test_bad_manifest_leaves_no_job(tmp_path: Path, random_model_dir: Path, capsys) -> None:  # noqa: ANN001
    m = make_manifest(tmp_path, 3)
    lines = m.read_text().splitlines()
    dup = tmp_path / "dup.jsonl"
    dup.write_text("\n".join(lines + [lines[1]]) + "\n")
    job = tmp_path / "job"
    assert main(["submit", str(dup), "--job", str(job), "--model",
                 str(random_model_dir)]) == EXIT_BAD_INPUT
    assert "dup.jsonl:4: id 'img1' appears twice (first on line 2)" in capsys.readouterr().err
    assert not job.exists()


def test_job_runs_from_another_directory(tmp_path: Path, random_model_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    make_manifest(tmp_path, 2)
    monkeypatch.chdir(tmp_path)
    model = os.path.relpath(random_model_dir, tmp_path)
    assert main(["submit", "m.jsonl", "--job", "job", "--model", model, "--no-progress"]) == 0
    saved = json.loads((tmp_path / "job" / "job.json").read_text())["config"]
    assert Path(saved["model"]["path"]).is_absolute()
    assert Path(saved["manifest"]).is_absolute()
    monkeypatch.chdir("/")
    assert main(["run", str(tmp_path / "job"), "--no-progress"]) == EXIT_OK
    assert status(tmp_path / "job").failed == 0


def test_resume_retry_failed(tmp_path: Path, random_model_dir: Path) -> None:
    _, job = submit_job(tmp_path, random_model_dir, 2, "--wait", "--no-progress", broken=1,
                        rc=3)  # bad0 -> missing.png
    (tmp_path / "missing.png").write_bytes((tmp_path / "0.png").read_bytes())
    assert main(["resume", str(job), "--no-progress"]) == 3  # failed items stay failed
    assert main(["resume", str(job), "--retry-failed", "--no-progress"]) == EXIT_OK
    st = status(job)
    assert (st.done, st.failed, st.pending, st.questions) == (3, 0, 0, 5)
    out = tmp_path / "r.jsonl"
    main(["results", str(job), "-o", str(out)])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [ln["id"] for ln in lines] == ["img0", "img0", "img1", "img1", "bad0"]
    assert all(ln["error"] is None for ln in lines)


def test_all_failed_job_reports_no_qpm(tmp_path: Path, random_model_dir: Path) -> None:
    _, job = submit_job(tmp_path, random_model_dir, 0, "--wait", "--no-progress", broken=2, rc=3)
    st = status(job)
    assert st.failed == 2 and st.qpm is None and "QPM n/a" in st.text()


def test_thread_counts_are_kept_with_the_job_and_a_run_may_change_them(
        tmp_path: Path, random_model_dir: Path, monkeypatch) -> None:  # noqa: ANN001
    """Submit stores --threads/--preprocess-threads; `run JOB` and `resume` may give others
    for that run only (threads change speed, not answers), and job.json is left as it was."""
    import vlmbatch.jobs.job as job_mod
    import vlmbatch.pipeline.drive as drive_mod  # the drive loop prepares the groups
    from vlmbatch.jobs.folder import load_config

    used: list[tuple[str, int]] = []  # calls to torch.set_num_threads and prepared_groups
    real = drive_mod.prepared_groups

    def spy(task, groups, plan, opts, *args):  # noqa: ANN001, ANN002, ANN202
        used.append(("prepare", opts.threads))
        return real(task, groups, plan, opts, *args)

    import torch

    monkeypatch.setattr(drive_mod, "prepared_groups", spy)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: used.append(("set", n)))
    _, job = submit_job(tmp_path, random_model_dir, 3, "--threads", "1",
                        "--preprocess-threads", "0", "--images-per-batch", "2", broken=1)
    saved = (job / "job.json").read_text()
    assert (load_config(job).threads, load_config(job).prepare.preprocess_threads) == (1, 0)
    assert main(["run", str(job), "--no-progress", "--threads", "2",
                 "--preprocess-threads", "3"]) == 3  # the missing image
    (tmp_path / "missing.png").write_bytes((tmp_path / "0.png").read_bytes())
    assert main(["resume", str(job), "--no-progress", "--retry-failed",
                 "--preprocess-threads", "1"]) == EXIT_OK
    # the second run: --threads as submitted
    assert used == [("set", 2), ("prepare", 3), ("set", 1), ("prepare", 1)]
    assert (job / "job.json").read_text() == saved
    assert status(job).done == 4
    with pytest.raises(job_mod.ConfigError, match="preprocess_threads must be >= 0"):
        load_config(job).for_run(None, -1)


def test_run_job_refuses_settings_fixed_at_submit(tmp_path: Path, random_model_dir: Path,
                                                  capsys) -> None:  # noqa: ANN001
    _, job = submit_job(tmp_path, random_model_dir, 1)
    rc = main(["run", str(job), "--dtype", "bfloat16", "-o", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err
    assert rc == EXIT_BAD_INPUT and "--dtype, --out would be ignored" in err
    assert status(job).pending == 1


def test_cancel_of_a_job_that_is_not_running(tmp_path: Path, random_model_dir: Path,
                                             capsys) -> None:  # noqa: ANN001
    _, job = submit_job(tmp_path, random_model_dir, 1)
    capsys.readouterr()
    assert main(["cancel", str(job)]) == EXIT_OK
    assert "not running (submitted); nothing to cancel" in capsys.readouterr().err
    assert main(["run", str(job), "--no-progress"]) == EXIT_OK  # not left cancelled


def test_submit_checks_the_model(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    m = make_manifest(tmp_path, 1)
    job = tmp_path / "job"
    rc = main(["submit", str(m), "--job", str(job), "--model", str(tmp_path / "nope")])
    assert rc == EXIT_BAD_INPUT and "nope" in capsys.readouterr().err and not job.exists()


@pytest.mark.parametrize("damage", ["store-garbage", "store-missing", "job-json"])
def test_damaged_job_folder_is_named(tmp_path: Path, random_model_dir: Path, capsys,  # noqa: ANN001
                                     damage: str) -> None:
    _, job = submit_job(tmp_path, random_model_dir, 1)
    if damage == "store-garbage":
        (job / STORE_FILE).write_bytes(b"not a database" * 100)
    elif damage == "store-missing":
        (job / STORE_FILE).unlink()
    else:
        (job / "job.json").write_text("{")
    capsys.readouterr()
    cmds = [["resume", "--no-progress"], ["results"]]
    if damage != "job-json":  # status reads only the store
        cmds.append(["status"])
    for cmd in cmds:
        assert main([cmd[0], str(job), *cmd[1:]]) == EXIT_BAD_INPUT
        assert "damaged" in capsys.readouterr().err
    assert damage != "store-missing" or not (job / STORE_FILE).exists()


def test_cancel_reaches_a_run_that_looks_interrupted(tmp_path: Path,
                                                     random_model_dir: Path) -> None:
    """A run in another pid namespace looks dead from here; cancel still sets the flag."""
    from vlmbatch.jobs.folder import cancel

    _, job = submit_job(tmp_path, random_model_dir, 1)
    store = JobStore(job / STORE_FILE)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store.set("status", "running")
    store.set("run_pid", str(dead.pid))
    store.set("run_host", __import__("vlmbatch.jobs.lock", fromlist=["host_id"]).host_id())
    assert cancel(job) == "interrupted" and store.get("cancel") == "1"
    store.close()


def test_run_job_options(tmp_path: Path, random_model_dir: Path, capsys) -> None:  # noqa: ANN001
    m, job = submit_job(tmp_path, random_model_dir, 1, "--images-per-batch", "1", broken=1)
    capsys.readouterr()
    # typed, even at the default value: refused, not silently ignored
    assert main(["run", str(job), "--images-per-batch", "16"]) == EXIT_BAD_INPUT
    assert "--images-per-batch would be ignored" in capsys.readouterr().err
    assert main(["run", str(job), "--no-progress"]) == 3
    (tmp_path / "missing.png").write_bytes((tmp_path / "0.png").read_bytes())
    assert main(["run", str(job), "--retry-failed", "--no-progress"]) == EXIT_OK
    assert main(["run", str(m), "--retry-failed"]) == EXIT_BAD_INPUT


def test_a_job_from_an_older_version_still_runs(tmp_path: Path, random_model_dir: Path) -> None:
    """Version-1 stores (no schema version, no totals, no per-item line counts) get them;
    a version-1 job.json (flat model,
    engine and source keys) loads: --ignore-eos without --max-new-tokens (once accepted, no
    effect) no longer stops it loading, and settings it lacks (preprocess_threads,
    vit_max_batch) take their defaults."""
    import sqlite3

    _, job = submit_job(tmp_path, random_model_dir, 2, "--wait", "--no-progress", broken=1, rc=3)
    before = status(job)
    db = sqlite3.connect(job / STORE_FILE)  # back to a version-1 store from before the counts
    for trigger in ("items_changed", "items_removed"):
        db.execute(f"DROP TRIGGER {trigger}")
    db.execute("DROP TABLE totals")
    db.execute("DELETE FROM meta WHERE key = 'schema'")
    db.execute("ALTER TABLE items DROP COLUMN lines")
    db.execute("ALTER TABLE items DROP COLUMN answered")
    db.commit()
    db.close()
    new = json.loads((job / "job.json").read_text())["config"]
    engine = {**new["engine"], "ignore_eos": True}
    del engine["vit_max_batch"]  # older than the option
    v1 = {"version": 1, "format": "vlmbatch", "model": new["model"], "engine": engine,
          "images_per_batch": new["images_per_batch"],
          "max_pixels": new["prepare"]["max_pixels"],
          "threads": None, "source": {"manifest": new["manifest"], "images": None,
                                      "policy": None}}  # and no preprocess_threads
    (job / "job.json").write_text(json.dumps(v1))
    from vlmbatch.jobs.folder import load_config

    old = load_config(job)
    assert old.prepare.preprocess_threads is None and old.engine.vit_max_batch == 32
    assert old.engine.ignore_eos is False and old.manifest == Path(new["manifest"])
    after = status(job)
    assert (after.questions, after.failed) == (before.questions, before.failed) == (5, 1)
    store = JobStore(job / STORE_FILE)
    assert store.questions_answered() == 4
    store.close()
    assert main(["resume", str(job), "--no-progress"]) == 3


def test_a_second_run_of_a_running_job_is_refused(tmp_path: Path, random_model_dir: Path,
                                                  capsys) -> None:  # noqa: ANN001
    _, job = submit_job(tmp_path, random_model_dir, 60, "--images-per-batch", "1", "--no-progress",
                        broken=1)  # 12 s at least: each refusal waits 2 s
    p = cli("run", str(job), "--no-progress", faults={"group_delay": 0.2})
    wait_recorded(p, job, 2, timeout=60)
    capsys.readouterr()
    for cmd in (["run", str(job)], ["resume", str(job), "--retry-failed"]):
        assert main([*cmd, "--no-progress"]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert "already running" in err and f"pid {p.pid}" in err, err
    assert status(job).status == "running"
    assert status(job).text().startswith(f"running (pid {p.pid} on ")
    assert main(["status", str(job), "--json"]) == EXIT_OK
    seen = json.loads(capsys.readouterr().out)
    assert seen["status"] == "running" and seen["runner"]["pid"] == p.pid
    assert seen["runner"]["host"] and seen["eta_s"] > 0 and seen["qpm"] > 0
    main(["cancel", str(job)])
    p.wait(timeout=60)
    assert status(job).status == "cancelled"
    capsys.readouterr()
    assert main(["status", str(job), "--json"]) == EXIT_OK
    seen = json.loads(capsys.readouterr().out)
    assert seen["job"] == str(job) and seen["status"] == "cancelled"
    assert seen["runner"] is None and seen["eta_s"] is None
    assert seen["items"] == 61 and seen["done"] + seen["failed"] + seen["pending"] == 61
    resume(job, rc=3)  # the lock went with its process
    assert status(job).pending == 0


def test_status_trusts_the_lock_over_a_reused_pid(tmp_path: Path, random_model_dir: Path) -> None:
    """A run killed with -9 whose pid now belongs to another live process (here: this one)
    shows as interrupted, because its lock is free; while the lock is held it is running."""
    from vlmbatch.jobs.lock import LOCK_FILE, host_id, run_lock

    _, job = submit_job(tmp_path, random_model_dir, 1)
    store = JobStore(job / STORE_FILE)
    store.set("status", "running")
    store.set("run_pid", str(os.getpid()))
    store.set("run_host", host_id())
    (job / LOCK_FILE).touch()
    assert status(job).status == "interrupted"
    with run_lock(job):
        assert status(job).status == "running"
    store.close()


def test_results_and_run_as_csv(tmp_path: Path, random_model_dir: Path, capsys) -> None:  # noqa: ANN001
    import csv
    import io

    m = make_manifest(tmp_path, 3, broken=1)
    (tmp_path / "m.jsonl").write_text((tmp_path / "m.jsonl").read_text().replace(
        '"Red?"', '"Red, \\"bright\\"?\\nor not"', 1))  # a comma, quotes and a newline
    job = tmp_path / "job"
    main(["submit", str(m), "--job", str(job), "--model", str(random_model_dir), "--wait",
          "--no-progress"])
    lines = [json.loads(x) for x in _export(job, capsys, []).splitlines()]
    out = tmp_path / "sub" / "r.csv"
    assert main(["results", str(job), "-o", str(out)]) == EXIT_OK
    with open(out, newline="") as f:
        from_file = f.read()
    for text in (from_file, _export(job, capsys, ["--format", "csv"])):
        rows = list(csv.DictReader(io.StringIO(text, newline="")))
        assert len(rows) == len(lines) == 7
        for row, line in zip(rows, lines, strict=True):
            for k in ("id", "question_id", "question", "answer", "error"):
                assert row[k] == (line[k] or "")  # None -> empty field
            if line["error"] is None:
                assert float(row["p_yes"]) == line["p_yes"]
                assert float(row["margin"]) == line["margin"]
            else:
                assert row["p_yes"] == row["margin"] == ""
    assert lines[0]["question"] == 'Red, "bright"?\nor not'
    direct = tmp_path / "direct.CSV"  # `run` streams the same CSV, group by group
    assert main(["run", str(m), "-o", str(direct), "--model", str(random_model_dir),
                 "--no-progress"]) == 3
    with open(direct, newline="") as f:
        assert f.read() == from_file
    capsys.readouterr()  # .npy holds an embedding job's vectors: refused, not JSONL in x.npy
    npy = tmp_path / "x.npy"
    assert main(["results", str(job), "-o", str(npy)]) == EXIT_BAD_INPUT
    assert f"--out {npy}: a yes/no job's results are lines" in capsys.readouterr().err
    assert not npy.exists()


def _export(job: Path, capsys, args: list[str]) -> str:  # noqa: ANN001
    capsys.readouterr()
    assert main(["results", str(job), *args]) == EXIT_OK
    return capsys.readouterr().out


def test_a_file_system_without_flock_runs_unlocked(tmp_path: Path, random_model_dir: Path,
                                                   capsys, monkeypatch) -> None:  # noqa: ANN001
    import errno
    import fcntl

    from vlmbatch.jobs.lock import host_id

    def no_flock(*_: object) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    _, job = submit_job(tmp_path, random_model_dir, 2)
    monkeypatch.setattr(fcntl, "flock", no_flock)
    capsys.readouterr()
    assert main(["run", str(job), "--no-progress"]) == EXIT_OK
    assert "no file locks here" in capsys.readouterr().err
    store = JobStore(job / STORE_FILE)
    store.set("status", "running")  # status falls back to the pid the run recorded
    store.set("run_host", host_id())
    store.set("run_pid", str(os.getpid()))
    assert status(job).text().startswith(f"running (pid {os.getpid()} on ")  # from the store
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store.set("run_pid", str(dead.pid))
    assert status(job).status == "interrupted"
    store.close()


def test_busy_names_the_lock_holder_not_the_last_run(tmp_path: Path, random_model_dir: Path,
                                                      capsys) -> None:  # noqa: ANN001
    """While a new run loads its model it holds the lock but has not yet marked the store,
    which still names the previous run: the message names the lock's holder."""
    from vlmbatch.jobs.lock import run_lock

    _, job = submit_job(tmp_path, random_model_dir, 1)
    store = JobStore(job / STORE_FILE)
    store.set("run_pid", "424242")
    store.close()
    capsys.readouterr()
    with run_lock(job):
        assert main(["run", str(job), "--no-progress"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"pid {os.getpid()} on" in err and "424242" not in err, err


@pytest.mark.parametrize("name", ["r.jsonl", "r.csv", "r.parquet"])
def test_an_interrupted_export_leaves_out_as_it_was(tmp_path: Path, random_model_dir: Path,
                                                    capsys, monkeypatch, name: str) -> None:  # noqa: ANN001
    """`results -o` writes a temporary file beside --out and renames it only when complete:
    interrupted (Ctrl-C; SIGTERM takes the same path), --out keeps its old content and no
    temporary file is left; a complete export then replaces it."""
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    _, job = submit_job(tmp_path, random_model_dir, 3, "--wait", "--no-progress")
    out = tmp_path / "o" / name
    out.parent.mkdir()
    out.write_text("old\n")
    real = JobStore.answers

    def interrupted(self):  # noqa: ANN001, ANN202
        it = real(self)
        yield next(it)
        yield next(it)
        raise KeyboardInterrupt

    monkeypatch.setattr(JobStore, "answers", interrupted)
    capsys.readouterr()
    assert main(["results", str(job), "-o", str(out)]) == 130
    assert "--out is left as it was" in capsys.readouterr().err
    assert out.read_text() == "old\n" and sorted(p.name for p in out.parent.iterdir()) == [name]
    monkeypatch.setattr(JobStore, "answers", real)
    assert main(["results", str(job), "-o", str(out)]) == EXIT_OK
    assert out.read_bytes() != b"old\n" and sorted(p.name for p in out.parent.iterdir()) == [name]


def test_thread_counts_are_refused_on_ray(tmp_path: Path, random_model_dir: Path) -> None:
    """On Ray each model actor runs --model-cpus threads (Ray's reservation): a run's
    --threads would be ignored or oversubscribe, so it is refused (no Ray needed to check)."""
    from vlmbatch.engine.config import ConfigError
    from vlmbatch.jobs.job import run_job

    _, job = submit_job(tmp_path, random_model_dir, 1)
    with pytest.raises(ConfigError, match="apply to in-process runs"):
        run_job(job, False, ExecutorConfig("ray"), threads=2)
    assert main(["run", str(job), "--executor", "ray", "--threads", "2"]) == EXIT_BAD_INPUT
    assert status(job).pending == 1


def test_a_questions_max_new_tokens_survives_the_store(tmp_path: Path, random_model_dir: Path,
                                                       capsys) -> None:  # noqa: ANN001
    """Per-question generation limits go through submit's store to the run: only that
    question's lines carry text."""
    m = make_manifest(tmp_path, 2)
    lines = [json.loads(x) for x in m.read_text().splitlines()]
    for ln in lines:
        ln["questions"] = [{"id": "why", "text": "Why?", "max_new_tokens": 3}, "Red?"]
    m.write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = tmp_path / "job"
    assert main(["submit", str(m), "--job", str(job), "--model", str(random_model_dir),
                 "--wait", "--no-progress"]) == EXIT_OK
    got = [json.loads(x) for x in _export(job, capsys, []).splitlines()]
    assert [("text" in ln) for ln in got] == [True, False, True, False]
    assert all(isinstance(ln["text"], str) for ln in got if ln["question_id"] == "why")


def test_a_question_over_a_length_limit_is_refused_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`run` and `submit`: a question over --max-prompt-chars (16,384 by default), or longer
    than the built-in model's 4,096-token context, is exit 2 naming its line (a policy's:
    the policy file) before the model loads; nothing written, no job made."""
    image = ROOT / "examples" / "images" / "scene_00.png"
    m, p = tmp_path / "m.jsonl", tmp_path / "p.yaml"
    out, job = tmp_path / "out.jsonl", tmp_path / "job"
    cases = [  # (line 2's question, extra options, what the error says)
        ("y" * 16_385, [], r"question 'q0' is 16,385 characters \(text, prompt and system\), "
                           r"over the limit of 16,384 \(--max-prompt-chars\)"),
        ("Is there a red shape in the image? " * 460, [],  # 16,100 characters
         r"question 'q0' is 4,\d\d\d tokens before its image's, over the model's context of "
         r"4,096 \(config.json max_position_embeddings\)"),
        ("Red?", ["--max-prompt-chars", "3"], r"question 'q0' is 4 characters"),
    ]
    for text, extra, says in cases:
        m.write_text("".join(json.dumps({"id": i, "image": str(image), "questions": [q]}) + "\n"
                             for i, q in ((1, "Red"), (2, text))))
        for cmd in (["run", str(m), "-o", str(out)], ["submit", str(m), "--job", str(job)]):
            capsys.readouterr()
            assert main([*cmd, *extra, "--no-progress"]) == EXIT_BAD_INPUT, (cmd, text[:20])
            err = capsys.readouterr().err
            assert re.search(re.escape(f"{m}:2: ") + says, err), err
            assert not out.exists() and not job.exists()
    p.write_text(f"questions:\n  - {{id: long, text: '{'z' * 16_400}'}}\n")
    m.write_text(json.dumps({"id": 1, "image": str(image)}) + "\n")
    assert main(["run", str(m), "--policy", str(p), "--no-progress"]) == EXIT_BAD_INPUT
    assert f"{p}: question 'long' is 16,400 characters" in capsys.readouterr().err
