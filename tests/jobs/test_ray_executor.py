"""The Ray executor: same results as in-process, a killed model worker, a hung decoder,
cancel and resume, Parquet export, joining a running cluster (`--address`, `ray://`). The
first test's run starts (and stops) a local Ray instance of its own, as a run without an
address does; the others join the session's Ray head (``ray_head`` in ``tests/conftest.py``)
by its address, each run a driver of its own in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import pytest

from tests.jobs.interrupting import recorded, resume, stop, stop_at, wait_recorded
from tests.jobs.ray_head import RayHead, ray_client_lock
from tests.jobs.test_job import ROOT, cli, make_manifest, submit_job
from tests.loopback import free_port
from tests.waiting import wait_until
from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.jobs.folder import STORE_FILE, cancel, status
from vlmbatch.jobs.store import JobStore
from vlmbatch.pipeline.records import Answer

pytest.importorskip("ray")

RAY = ["--executor", "ray", "--model-cpus", "1"]


def on(head: RayHead) -> list[str]:
    """The Ray options of a run joining ``head``."""
    return [*RAY, "--address", head.address]


def submit(tmp_path: Path, model: Path, n: int, broken: int = 0, per_batch: int = 2) -> Path:
    return submit_job(tmp_path, model, n, "--images-per-batch", str(per_batch), "--no-progress",
                      broken=broken)[1]


def results(job: Path) -> list[dict]:
    store = JobStore(job / STORE_FILE)
    try:
        return [a.line() for a in store.answers()]
    finally:
        store.close()


def assert_same_lines(got: list[dict], want: list[dict]) -> None:
    """Equal line for line; P(yes) and margin to float noise (the Ray actor runs torch with
    one thread, this process with its default, so reductions add up in another order)."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert {k: v for k, v in a.items() if k not in ("p_yes", "margin")} == \
            {k: v for k, v in b.items() if k not in ("p_yes", "margin")}
        if b["p_yes"] is not None:
            assert abs(a["p_yes"] - b["p_yes"]) <= 1e-5 and abs(a["margin"] - b["margin"]) <= 1e-3


def direct(tmp_path: Path, model: Path, m: Path) -> list[dict]:
    out = tmp_path / "direct.jsonl"
    main(["run", str(m), "-o", str(out), "--model", str(model), "--images-per-batch", "2",
          "--no-progress"])
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_ray_matches_in_process_and_exports_parquet(tmp_path: Path, random_model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The one CI run that starts its own local Ray instance (no --address, no
    $RAY_ADDRESS: ``init_ray``'s ``address="local"``), in this process."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    job = submit(tmp_path, random_model_dir, 7, broken=1)
    assert main(["run", str(job), *RAY, "--preprocess-workers", "2", "--no-progress"]) == 3
    got = results(job)
    want = direct(tmp_path, random_model_dir, tmp_path / "m.jsonl")
    assert_same_lines(got, want)  # same lines, same order, the broken item's error included
    st = status(job)
    assert (st.status, st.done, st.failed, st.pending) == ("done", 7, 1, 0)

    import pyarrow.parquet as pq

    out = tmp_path / "r.parquet"
    assert main(["results", str(job), "-o", str(out)]) == EXIT_OK
    table = pq.read_table(out).to_pylist()
    assert len(table) == len(got)
    assert [(r["id"], r["question_id"], r["answer"], r["p_yes"], r["error"]) for r in table] \
        == [(r["id"], r["question_id"], r["answer"], r["p_yes"], r["error"]) for r in got]


def test_model_worker_killed_mid_batch_job_completes(tmp_path: Path, random_model_dir: Path,
                                                     ray_head: RayHead) -> None:
    job = submit(tmp_path, random_model_dir, 8)
    marker = tmp_path / "killed"
    p = cli("run", str(job), *on(ray_head), "--no-progress", env=ray_head.env,
            faults={"kill_model_at": [2, str(marker)]})
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert marker.exists()  # the worker really died once
    lines = results(job)
    ids = [ln["id"] for ln in lines]
    assert sorted(set(ids)) == sorted(f"img{i}" for i in range(8))
    assert len(ids) == 16 and all(ln["error"] is None for ln in lines)  # once each


def test_hung_decoder_becomes_that_items_error(tmp_path: Path, random_model_dir: Path,
                                               ray_head: RayHead) -> None:
    """On Ray a deadline runs from the task's submission, so it includes starting a worker
    process, which took over 3 s on a loaded 2-core machine (the other items then timed out
    too): 6 s."""
    job = submit(tmp_path, random_model_dir, 5, per_batch=3)
    p = cli("run", str(job), *on(ray_head), "--decode-timeout", "6", "--no-progress",
            env=ray_head.env, faults={"hang_on": "3.png"})
    _, err = p.communicate(timeout=300)
    assert p.returncode == 3, err  # finished, one item failed
    by_id = {}
    for ln in results(job):
        by_id.setdefault(ln["id"], []).append(ln)
    assert set(by_id) == {f"img{i}" for i in range(5)}
    assert all("timed out after 6s" in ln["error"] for ln in by_id["img3"])
    assert all(ln["error"] is None for i in (0, 1, 2, 4) for ln in by_id[f"img{i}"])


def test_crashing_decoder_becomes_that_items_error(tmp_path: Path, random_model_dir: Path,
                                                   ray_head: RayHead) -> None:
    job = submit(tmp_path, random_model_dir, 4, per_batch=4)
    p = cli("run", str(job), *on(ray_head), "--no-progress", env=ray_head.env,
            faults={"crash_on": "2.png"})
    _, err = p.communicate(timeout=300)
    assert p.returncode == 3, err
    by_id = {}
    for ln in results(job):
        by_id.setdefault(ln["id"], []).append(ln)
    assert set(by_id) == {f"img{i}" for i in range(4)}
    assert all("preprocessing worker died" in ln["error"] for ln in by_id["img2"])
    assert all(ln["error"] is None for i in (0, 1, 3) for ln in by_id[f"img{i}"])


def test_cancel_then_resume_on_ray(tmp_path: Path, random_model_dir: Path,
                                   ray_head: RayHead) -> None:
    job = submit(tmp_path, random_model_dir, 12, per_batch=1)
    p = cli("run", str(job), *on(ray_head), "--no-progress", env=ray_head.env,
            faults={"slow_score": 0.5})
    wait_recorded(p, job, 1, timeout=120)
    cancel(job)
    t0 = time.time()
    p.communicate(timeout=120)
    assert time.time() - t0 < 30  # stops promptly
    st = status(job)
    assert st.status == "cancelled" and 0 < st.done < 12
    p = cli("resume", str(job), *on(ray_head), "--no-progress", env=ray_head.env)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    ids = [ln["id"] for ln in results(job)]
    assert sorted(ids) == sorted(f"img{i}" for i in range(12) for _ in range(2))
    assert os.path.exists(job / STORE_FILE)


def test_sigterm_on_ray_ends_the_run_as_ctrl_c_does(tmp_path: Path, random_model_dir: Path,
                                                    ray_head: RayHead) -> None:
    """ray.init installs its own SIGTERM handler (sys.exit(15)); ours is put back, so the
    driver exits 143 with the job marked interrupted, and the job resumes (here in-process)."""
    job = submit(tmp_path, random_model_dir, 12, per_batch=1)
    p = cli("run", str(job), *on(ray_head), "--no-progress", env=ray_head.env,
            faults={"slow_score": 0.5})
    err = stop_at(p, job, 1, signal.SIGTERM, timeout=120)
    assert p.returncode == 143 and "terminated (SIGTERM)" in err, err
    store = JobStore(job / STORE_FILE)
    assert store.get("status") == "interrupted" and 0 < store.counts().done < 12
    store.close()
    resume(job)
    assert status(job).done == 12


# slow: CI checks the same path (`run MANIFEST --executor ray`: a temporary job on Ray, its
# lines on --out equal the in-process run's) in tests/jobs/test_ray_tasks.py::
# test_qwen_vl_on_ray_gives_the_run_lines (a Qwen-VL checkpoint), and InternVL's lines on Ray
# in test_ray_matches_in_process_and_exports_parquet above: ~10 s of CI for one more driver
@pytest.mark.slow
def test_run_manifest_on_ray_writes_the_same_lines(tmp_path: Path, random_model_dir: Path,
                                                    ray_head: RayHead) -> None:
    m = make_manifest(tmp_path, 3)
    out = tmp_path / "ray.jsonl"
    p = cli("run", str(m), "-o", str(out), "--model", str(random_model_dir),
            "--images-per-batch", "2", "--no-progress", *on(ray_head), env=ray_head.env)
    _, err = p.communicate(timeout=300)
    assert p.returncode == EXIT_OK, err[-3000:]
    assert_same_lines([json.loads(x) for x in out.read_text().splitlines()],
                      direct(tmp_path, random_model_dir, m))


def temporary_job_recorded(t0: float) -> bool:
    """Whether ``run MANIFEST``'s temporary job, made since ``t0``, has recorded a group."""
    stores = [f for f in Path(tempfile.gettempdir()).glob(f"vlmbatch-job-*/job/{STORE_FILE}")
              if f.stat().st_mtime >= t0]
    return bool(stores) and recorded(stores[0].parent) > 0


def test_sigterm_on_a_ray_run_of_a_manifest_keeps_the_lines_answered(
        tmp_path: Path, random_model_dir: Path, ray_head: RayHead) -> None:
    """`run MANIFEST --executor ray` answers through a temporary job; on SIGTERM the lines
    answered so far still reach --out, whole, as in-process."""
    m = make_manifest(tmp_path, 12)
    out = tmp_path / "ray.jsonl"
    t0 = time.time()
    p = cli("run", str(m), "-o", str(out), "--model", str(random_model_dir),
            "--images-per-batch", "1", "--no-progress", *on(ray_head), env=ray_head.env,
            faults={"slow_score": 0.5})
    wait_until(lambda: temporary_job_recorded(t0) or p.poll() is not None, 120,
               "a group recorded by the run's temporary job")
    err = stop(p, signal.SIGTERM)
    assert p.returncode == 143 and "terminated (SIGTERM)" in err, err
    text = out.read_text()
    got = [json.loads(x) for x in text.splitlines()]
    assert text.endswith("\n") and 0 < len(got) < 24 and len(got) % 2 == 0


def test_a_sigterm_while_ray_starts_is_ours_not_rays(monkeypatch) -> None:  # noqa: ANN001
    """ray.init's own handler turns a SIGTERM into SystemExit(15) while it starts Ray;
    init_ray hands it to the CLI's handler instead (exit 143, 'terminated')."""
    from vlmbatch.cli.main import SIGTERMS, Terminated, _sigterm_as_interrupt
    from vlmbatch.jobs.config import RayOptions
    from vlmbatch.jobs.ray_cluster import init_ray

    class RayStartingWhenTerminated:
        class exceptions:  # noqa: N801
            RayError = RuntimeError

        @staticmethod
        def init(**_: object) -> None:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(signal.SIGTERM))  # as Ray does
            raise SystemExit(signal.SIGTERM)

    with _sigterm_as_interrupt(), pytest.raises(Terminated):
        init_ray(RayStartingWhenTerminated, RayOptions())
    assert SIGTERMS == [signal.SIGTERM]


@pytest.mark.parametrize("via", ["--address", "RAY_ADDRESS"])
def test_unreachable_address_fails_fast(tmp_path: Path, random_model_dir: Path, capsys,  # noqa: ANN001
                                        monkeypatch, via: str) -> None:  # noqa: ANN001
    job = submit(tmp_path, random_model_dir, 1)
    port = free_port()  # closed again: nothing listens there
    address = f"ray://127.0.0.1:{port}"
    args = ["--address", address] if via == "--address" else []
    if via == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", address)
    t0 = time.monotonic()
    rc = main(["run", str(job), *RAY, *args, "--no-progress"])
    assert rc == EXIT_BAD_INPUT and time.monotonic() - t0 < 30
    err = capsys.readouterr().err
    assert f"{via}{' ' if args else '='}{address}: cannot reach 127.0.0.1:{port}" in err, err
    assert "ray start --head" in err
    assert status(job).status == "submitted"


def test_missing_auth_token_is_named(tmp_path: Path, random_model_dir: Path) -> None:
    """Token auth on, no token anywhere: exit 2 saying so (Ray raises its own error type)."""
    job = submit(tmp_path, random_model_dir, 1)
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "token"}
    for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        env.pop(k, None)
    with socket.socket() as listener:  # something answers TCP there: the check passes
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "vlmbatch", "run", str(job), *RAY,
                            "--address", f"127.0.0.1:{port}", "--no-progress"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == EXIT_BAD_INPUT, p.stderr[-3000:]
    assert "token authentication failed" in p.stderr and "Traceback" not in p.stderr


def test_joins_a_running_cluster_by_address_and_by_ray_client(tmp_path: Path,
                                                              random_model_dir: Path,
                                                              ray_head: RayHead) -> None:
    """A head started apart (`ray start --head`, as on a cluster: the session's), joined
    through its GCS address and through Ray Client (ray://): each run is one more driver on
    that head, and its lines equal the in-process run's (the broken item's error
    included)."""
    head = ray_head
    m = make_manifest(tmp_path, 2, broken=1)
    want = direct(tmp_path, random_model_dir, m)
    for i, address in enumerate([head.address, head.client_address]):
        job = tmp_path / f"job{i}"
        main(["submit", str(m), "--job", str(job), "--model", str(random_model_dir),
              "--images-per-batch", "2", "--no-progress"])
        joined = head.drivers()
        with ray_client_lock() if address.startswith("ray://") else nullcontext():
            p = subprocess.run([sys.executable, "-m", "vlmbatch", "run", str(job), *RAY,
                                "--address", address, "--no-progress"], cwd=ROOT,
                               env=head.env, capture_output=True, text=True, timeout=300)
        # the broken item failed, as in-process
        assert p.returncode == 3, p.stderr[-3000:] + head.client_logs()
        assert head.drivers() == joined + 1, address  # it ran there, not on its own Ray
        assert_same_lines(results(job), want)


def test_without_an_address_a_run_starts_its_own_instance(monkeypatch) -> None:  # noqa: ANN001
    """No --address and no $RAY_ADDRESS: ray.init(address="local"), which always starts a new
    instance sized for the run (ray.init() alone would join the cluster `ray start` last made
    on this machine); with $RAY_ADDRESS, that address."""
    from vlmbatch.jobs.config import RayOptions
    from vlmbatch.jobs.ray_cluster import init_ray

    calls: list[dict] = []

    class Recorder:
        class exceptions:  # noqa: N801
            RayError = RuntimeError

        @staticmethod
        def init(**kw: object) -> None:
            calls.append(kw)

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    init_ray(Recorder, RayOptions(preprocess_workers=2, model_cpus=1.5))
    assert calls[-1]["address"] == "local" and calls[-1]["num_cpus"] == 4  # ceil(2 + 1.5)
    monkeypatch.setenv("RAY_ADDRESS", "auto")  # no port: no TCP check
    init_ray(Recorder, RayOptions())
    assert calls[-1]["address"] == "auto" and calls[-1]["num_cpus"] is None


def test_a_refused_ray_client_join_says_why_and_what_to_change() -> None:
    """Ray's "Initialization failure from server:" comes with the server's traceback; the
    message keeps its last line, and for a server process that did not start in time on the
    head, or died as it started (what made the join test flaky on a loaded machine), names
    the head's setting."""
    from vlmbatch.jobs.ray_cluster import CLIENT_WAIT_ENV, _join_hint

    tb = ("Initialization failure from server:\nTraceback (most recent call last):\n  File "
          '"proxier.py", line 777, in Datapath\nRuntimeError: Proxy failed to Connect to '
          "backend! Check `ray_client_server.err` on the head node\n")
    hint = _join_hint(ConnectionAbortedError(tb))
    assert "RuntimeError: Proxy failed to Connect to backend! Check" in hint
    assert f"{CLIENT_WAIT_ENV}=120 ray start --head" in hint and "30 s" in hint
    died = _join_hint(ConnectionAbortedError(
        "Initialization failure from server:\nTraceback (most recent call last):\n"
        "RuntimeError: Starting Ray client server failed. See ray_client_server_23000.err\n"))
    assert "Starting Ray client server failed" in died
    assert "GRPC_ENABLE_FORK_SUPPORT=0 ray start --head" in died
    other = _join_hint(ConnectionAbortedError(
        "Initialization failure from server:\nTraceback (most recent call last):\n"
        "ValueError: Runtime environment doesn't match\n"))
    assert other.endswith("ValueError: Runtime environment doesn't match")
    assert CLIENT_WAIT_ENV not in other and "GRPC" not in other


class _Ref:
    def __init__(self, value: object = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error


class _FakeRay:
    """Just enough of Ray for ``RayStages``: calls run at once; ``run`` loses its images
    (as when the node that prepared them dies) the first ``lose`` times it sees a group."""

    import ray.exceptions as exceptions  # noqa: PLC0415

    def __init__(self, lose: int) -> None:
        self.lose, self.losses = lose, 0

    def remote(self, **_: object):  # noqa: ANN201
        def wrap(fn):  # noqa: ANN001, ANN202
            class Task:
                @staticmethod
                def remote(*args: object) -> tuple[_Ref, _Ref]:
                    n, tiles = fn(*args)
                    return _Ref(n), _Ref(tiles)
            return Task
        return wrap

    def get(self, ref: _Ref) -> object:
        if ref.error is not None:
            raise ref.error
        return ref.value

    def wait(self, refs: list, num_returns: int = 1, timeout: float | None = None
             ) -> tuple[list, list]:
        return list(refs), []  # every call has already run

    def cancel(self, ref: _Ref, force: bool = False) -> None:
        pass

    def run(self, prepared: _Ref) -> _Ref:
        if self.losses < self.lose:
            self.losses += 1
            lost = self.exceptions.ObjectReconstructionFailedError("images")
            return _Ref(error=self.exceptions.RayTaskError("run", "", lost))
        return _Ref([[Answer(it.id, q.id, q.text, "yes", 1.0, 1.0, 1) for q in it.questions]
                     for it in prepared.value.items])


@pytest.mark.parametrize("lose,ok", [(2, True), (4, False)])
def test_tiles_lost_with_their_node_are_prepared_again(tmp_path: Path, random_model_dir: Path,
                                                       lose: int, ok: bool) -> None:
    from vlmbatch.jobs.folder import load_config
    from vlmbatch.jobs.job import drive_job
    from vlmbatch.jobs.ray_executor import RayStages
    from vlmbatch.jobs.tasks import job_task
    from vlmbatch.pipeline.hooks import NO_HOOKS
    from vlmbatch.preprocessing.prepare import TilingConfig

    job = submit(tmp_path, random_model_dir, 4, per_batch=2)
    fake = _FakeRay(lose)
    worker = type("W", (), {"run": type("S", (), {"remote": staticmethod(fake.run)}),
                            # the engine's clip plan, bound by RayStages (none: no clips here)
                            "video_plan": type("V", (), {"remote": staticmethod(
                                lambda: _Ref(None))})})
    store = JobStore(job / STORE_FILE)
    cfg = load_config(job)
    jt = job_task(cfg, "vlmbatch")
    stages = RayStages(fake, cfg, jt.task, [worker], TilingConfig(tile_size=56), NO_HOOKS)

    def drive() -> None:
        for _ in drive_job(store, cfg, jt, stages):
            pass

    if ok:  # lost twice, prepared again each time: every item recorded once
        drive()
        assert store.counts().done == 4 and store.counts().pending == 0
    else:  # the first group lost 4 times: more than 3 retries, the error is raised
        with pytest.raises(fake.exceptions.RayTaskError):
            drive()
    store.close()
