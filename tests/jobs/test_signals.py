"""SIGINT and SIGTERM where nothing tested them before: during `submit` (the manifest half
read), during `results` (the export half written) and while a run loads its model. Each
window comes from a fault hook that writes a marker and waits, so the signal always lands
there: exit 130 or 143, nothing half-written, and what is left goes on."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.jobs.interrupting import stop
from tests.jobs.test_job import cli, make_manifest, submit_job
from tests.waiting import wait_until
from vlmbatch.cli.commands import EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.jobs.folder import status

RC = {signal.SIGINT: 130, signal.SIGTERM: 143}
SAYS = {signal.SIGINT: "vlmbatch: interrupted", signal.SIGTERM: "vlmbatch: terminated (SIGTERM)"}


def signalled(marker: Path, sig: signal.Signals, *args: str, where: str, n: int = 1) -> str:
    """``vlmbatch ARGS`` in a subprocess, sent ``sig`` once it waits in the window ``where``
    (its ``n``-th call); returns its stderr after checking the exit code."""
    p = cli(*args, faults={"pause_at": {where: [n, str(marker)]}})
    wait_until(lambda: marker.exists() or p.poll() is not None, 120, f"{marker} written")
    assert marker.exists(), p.communicate()[1]
    err = stop(p, sig)
    assert p.returncode == RC[sig] and SAYS[sig] in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_submit_leaves_no_job(tmp_path: Path, random_model_dir: Path,
                                              sig: signal.Signals) -> None:
    m = make_manifest(tmp_path, 40)
    job = tmp_path / "jobs" / "j1"
    err = signalled(tmp_path / "marker", sig, "submit", str(m), "--job", str(job), "--model",
                    str(random_model_dir), where="after_submit_line", n=20)
    assert "no job was created" in err
    assert list((tmp_path / "jobs").iterdir()) == []  # nor its temporary folder
    assert main(["submit", str(m), "--job", str(job), "--model", str(random_model_dir)]) == 0
    assert status(job).pending == 40


@pytest.mark.parametrize("sig,name", [(signal.SIGINT, "r.jsonl"), (signal.SIGTERM, "r.parquet")],
                         ids=["SIGINT-jsonl", "SIGTERM-parquet"])
def test_a_signal_during_results_leaves_out_as_it_was(tmp_path: Path, random_model_dir: Path,
                                                      sig: signal.Signals, name: str) -> None:
    _, job = submit_job(tmp_path, random_model_dir, 4, "--wait", "--no-progress")
    out = tmp_path / "o" / name
    out.parent.mkdir()
    out.write_text("old\n")
    err = signalled(tmp_path / "marker", sig, "results", str(job), "-o", str(out),
                    where="after_export_line", n=3)
    assert "--out is left as it was" in err
    assert [p.name for p in out.parent.iterdir()] == [name] and out.read_text() == "old\n"


@pytest.mark.parametrize("sig,of", [(signal.SIGINT, "run MANIFEST"), (signal.SIGTERM, "run JOB")],
                         ids=["SIGINT-run", "SIGTERM-job"])
def test_a_signal_while_the_model_loads(tmp_path: Path, random_model_dir: Path,
                                        sig: signal.Signals, of: str) -> None:
    """A plain run has not opened --out yet; a job is left as submitted (its lock freed)
    and runs to the end afterwards."""
    m, job = submit_job(tmp_path, random_model_dir, 3, "--no-progress")
    if of == "run MANIFEST":
        out = tmp_path / "out.jsonl"
        err = signalled(tmp_path / "m1", sig, "run", str(m), "-o", str(out), "--model",
                        str(random_model_dir), where="before_load")
        assert "vlmbatch submit" in err and not out.exists()
        return
    err = signalled(tmp_path / "m2", sig, "run", str(job), where="before_load")
    assert "`vlmbatch resume JOB` continues the job" in err
    assert status(job).status == "submitted"
    assert json.loads((job / "job.json").read_text())["version"] == 6  # untouched, whole
    assert main(["run", str(job), "--no-progress"]) == EXIT_OK
    assert status(job).done == 3
