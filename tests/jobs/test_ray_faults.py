"""Ray losing a process it cannot get back: the driver killed with SIGKILL mid-job (first
the driver of a local instance, which dies with it; resumed on the session's Ray head,
killed again, which leaves the head to end its actors; resumed in-process), and a worker
node (a second raylet on this machine, `ray start --address`) killed mid-job. Each job ends
with every item recorded exactly once. Load-sensitive on 2 cores: generous deadlines, and
each waits on the store or on a marker, never on a fixed sleep."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.jobs.interrupting import assert_each_once, stop_at
from tests.jobs.ray_head import RayHead, wait_listening
from tests.jobs.test_job import ROOT, cli, submit_job
from tests.loopback import free_port
from tests.waiting import wait_until
from vlmbatch.cli.commands import EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.jobs.folder import status

pytest.importorskip("ray")

RAY = ["--executor", "ray", "--model-cpus", "1"]


def lines_once(job: Path, n: int) -> None:
    assert_each_once(job, [f"img{i}" for i in range(n)])


def kill_when_done(p: subprocess.Popen, job: Path, done: int) -> None:
    """SIGKILL ``p`` once the job's store holds ``done`` items more than now."""
    stop_at(p, job, status(job).done + done)
    _end_leftovers(p.pid)


def _end_leftovers(driver: int) -> None:
    """Ray's processes die with a SIGKILLed driver, but its dashboard and runtime-env agents
    linger a minute or two; end those of this driver's session (named after its pid)."""
    for d in os.listdir("/proc"):
        try:
            links = [os.readlink(f"/proc/{d}/fd/{fd}") for fd in os.listdir(f"/proc/{d}/fd")]
        except OSError:
            continue
        if any(f"_{driver}/" in x and "/session_" in x for x in links):
            try:
                os.kill(int(d), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_driver_killed_twice_then_resumed_on_ray_and_in_process(
        tmp_path: Path, random_model_dir: Path, ray_head: RayHead) -> None:
    _, job = submit_job(tmp_path, random_model_dir, 14, "--images-per-batch", "1",
                        "--no-progress")
    kill_when_done(cli("run", str(job), *RAY, "--no-progress", faults={"slow_score": 0.5}),
                   job, 2)  # a local instance of its own
    assert status(job).status == "interrupted"
    kill_when_done(cli("resume", str(job), *RAY, "--address", ray_head.address,
                       "--no-progress", env=ray_head.env, faults={"slow_score": 0.5}), job, 2)
    assert 4 <= status(job).done < 14
    assert main(["resume", str(job), "--no-progress"]) == EXIT_OK
    lines_once(job, 14)


def _start(ray_cli: str, env: dict, *args: str) -> subprocess.Popen:
    # --block in its own session: stopping it stops this node only
    return subprocess.Popen([ray_cli, "start", "--block", "--disable-usage-stats", *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _stop(p: subprocess.Popen) -> None:
    """Kill a node: its `ray start --block` process group (raylet, workers, GCS on a head)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=60)


def _wait_for_nodes(address: str, env: dict, n: int) -> None:
    code = ("import ray\nfrom tests.waiting import wait_until\n"
            f"ray.init(address={address!r}, log_to_driver=False)\n"
            f"wait_until(lambda: sum(x['Alive'] for x in ray.nodes()) >= {n}, 120, "
            f"'{n} nodes alive', interval=0.5)\n"
            "print(sum(x['Alive'] for x in ray.nodes()))")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.stdout.strip().endswith(str(n)), p.stderr[-2000:]


def _images_on(notes: Path, node: str, p: subprocess.Popen) -> set[str]:
    """The images prepare tasks noted on ``node``, once there is one (or ``p`` ended)."""
    wait_until(lambda: p.poll() is not None or any(
        n.name.startswith(f"{node}-") for n in notes.iterdir()), 240, f"a note of {node}")
    return {n.name.split("-", 2)[2] for n in notes.iterdir() if n.name.startswith(f"{node}-")}


def test_a_worker_node_lost_mid_job_completes_exactly_once(tmp_path: Path,
                                                           random_model_dir: Path) -> None:
    """A head (2 CPUs) and a second raylet (2 CPUs, marked by its environment); prepare
    tasks note where they run and take 3 s. Once one runs on the second node, that node's
    processes are killed: its task's group is prepared again on the head (NodeDiedError
    is not the image's fault) and every item is answered once."""
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    assert ray_cli
    gcs = free_port()
    (tmp_path / "home").mkdir()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "PYTHONPATH": str(ROOT), "HOME": str(tmp_path / "home")}
    env.pop("RAY_ADDRESS", None)
    temp = tempfile.mkdtemp(prefix="vr", dir="/tmp")  # short: Ray's socket paths
    # the head notices a dead raylet after 3 missed 1 s health checks (Ray's default: 5 of
    # 3 s each, plus their timeouts), which is most of this test's wait
    fast = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
            "RAY_health_check_failure_threshold": "3"}
    head = _start(ray_cli, {**env, **fast}, "--head", f"--port={gcs}", "--num-cpus=2",
                  f"--temp-dir={temp}", "--include-dashboard=false")
    worker = None
    try:
        wait_listening(gcs)
        worker = _start(ray_cli, {**env, "VLMBATCH_TEST_NODE": "worker"},
                        f"--address=127.0.0.1:{gcs}", "--num-cpus=2")
        _wait_for_nodes(f"127.0.0.1:{gcs}", env, 2)
        _, job = submit_job(tmp_path, random_model_dir, 8, "--images-per-batch", "1",
                            "--no-progress")
        notes = tmp_path / "notes"
        notes.mkdir()
        p = subprocess.Popen(
            [sys.executable, "-m", "tests.faults",
             json.dumps({"note_node": [str(notes), 3.0]}), "--", "run", str(job), *RAY,
             "--address", f"127.0.0.1:{gcs}", "--preprocess-workers", "2", "--no-progress"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lost = _images_on(notes, "worker", p)
        assert lost, "no prepare task ran on the second node"
        _stop(worker)  # mid-task: it sleeps 3 s after its note
        _, err = p.communicate(timeout=400)
        assert p.returncode == EXIT_OK, err[-3000:]
        assert lost <= _images_on(notes, "head", p)  # prepared again on the head
        lines_once(job, 8)
    finally:
        if worker is not None:
            _stop(worker)
        _stop(head)
        shutil.rmtree(temp, ignore_errors=True)
