"""A hung or crashing decoder in-process (the default executor): that item's error, of kind
``decode_timeout`` or ``decoder_crashed``, and the job goes on; no decoder process outlives
its run, kill -9 included."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.faults import hooks_from
from tests.jobs.interrupting import resume, stop, wait_recorded
from tests.jobs.test_job import cli, make_manifest, submit_job
from tests.waiting import wait_until
from vlmbatch.cli.commands import EXIT_ITEM_ERRORS, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.jobs.folder import STORE_FILE, status
from vlmbatch.jobs.store import JobStore
from vlmbatch.pipeline.records import ErrorKind


def by_item(job: Path) -> dict[str, list]:
    store = JobStore(job / STORE_FILE)
    try:
        out: dict[str, list] = {}
        for a in store.answers():
            out.setdefault(a.image_id, []).append(a)
        return out
    finally:
        store.close()


def decoders_of(pid: int) -> list[int]:
    """Decoder processes started by ``pid`` (its pid is their last argument), alive."""
    out = []
    for d in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vlmbatch.preprocessing.decoder_process" in argv and argv[-2:-1] == [str(pid).encode()]:
            out.append(int(d))
    return out


def test_a_hang_then_a_segfault_fail_that_item_and_retry_answers_it_once(
        tmp_path: Path, random_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """One job, three runs (in this process: the faults are in decoder processes):
    img3 hangs its decoder (killed after 2 s: decode_timeout), then, retried, segfaults it
    (decoder_crashed); the other seven are answered the first time and never again; a last
    retry answers img3. Every item's two lines exactly once."""
    _, job = submit_job(tmp_path, random_model_dir, 8, "--images-per-batch", "3",
                        "--no-progress")
    for fault, kind, says in (
            ({"hang_on": "3.png"}, ErrorKind.DECODE_TIMEOUT,
             "3.png: decoding timed out after 2s (worker killed)"),
            ({"segfault_on": "3.png"}, ErrorKind.DECODER_CRASHED,
             "3.png: preprocessing worker died (killed by SIGSEGV)")):
        capsys.readouterr()
        rc = main(["resume", str(job), "--retry-failed", "--decode-timeout", "2",
                   "--no-progress"], hooks=hooks_from(fault))
        err = capsys.readouterr().err
        assert rc == EXIT_ITEM_ERRORS, err
        got = by_item(job)
        assert sorted(got) == sorted(f"img{i}" for i in range(8))
        assert {a.error_kind for a in got["img3"]} == {kind}
        assert all(a.error.endswith(says) for a in got["img3"])
        assert all(a.error is None for i in (0, 1, 2, 4, 5, 6, 7) for a in got[f"img{i}"])
        assert "Traceback" not in err
    assert main(["resume", str(job), "--retry-failed", "--no-progress"]) == EXIT_OK
    lines = [a.image_id for answers in by_item(job).values() for a in answers]
    assert sorted(lines) == sorted(f"img{i}" for i in range(8) for _ in range(2))


def test_a_plain_run_survives_a_segfault_that_threads_do_not(
        tmp_path: Path, random_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """`vlmbatch run MANIFEST`: with decoder processes (the default) a segfault is one item's
    error line (the run in this process: the segfault is in a decoder process); with
    --decode-timeout 0 (threads) the same segfault ends the run (in a subprocess)."""
    m = make_manifest(tmp_path, 4)
    args = ["--model", str(random_model_dir), "--images-per-batch", "2", "--no-progress"]
    out = tmp_path / "out.jsonl"
    capsys.readouterr()
    rc = main(["run", str(m), "-o", str(out), *args], hooks=hooks_from({"segfault_on": "1.png"}))
    assert rc == EXIT_ITEM_ERRORS, capsys.readouterr().err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [ln["id"] for ln in lines] == [f"img{i}" for i in range(4) for _ in range(2)]
    assert [ln["error"] is None for ln in lines] == [True, True, False, False, True, True,
                                                     True, True]
    p = cli("run", str(m), "-o", str(tmp_path / "t.jsonl"), "--decode-timeout", "0", *args,
            faults={"segfault_on": "1.png"})
    p.communicate(timeout=300)
    assert p.returncode == -signal.SIGSEGV


def test_kill_minus_9_leaves_no_decoder_process_behind(tmp_path: Path,
                                                       random_model_dir: Path) -> None:
    _, job = submit_job(tmp_path, random_model_dir, 20, "--images-per-batch", "1",
                        "--no-progress")
    p = cli("run", str(job), "--no-progress", faults={"group_delay": 0.3})
    wait_recorded(p, job, 1, when=lambda: decoders_of(p.pid), timeout=120)
    assert decoders_of(p.pid), "the run decodes in decoder processes"
    stop(p, signal.SIGKILL)
    wait_until(lambda: not decoders_of(p.pid), 10,  # PR_SET_PDEATHSIG: they died with it
               f"the decoder processes of the killed pid {p.pid} gone")
    resume(job)
    assert status(job).done == 20
