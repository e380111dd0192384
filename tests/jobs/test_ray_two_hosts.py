"""Ray across two hosts, for real: two network namespaces on one veth pair
(``tests/jobs/netns.py``), a Ray head on host a (10.231.0.1, no CPUs), a worker node on host
b (10.231.0.2), and the job's driver on host a joining by the head's address. The head has
no CPUs, so every prepare task and model actor (each asks for CPUs, ``jobs/ray_executor.py``)
must run on host b; the fault hooks note each one's network namespace to show it did. The
images, the prepared tiles and the answers cross the veth pair; nothing else is reachable.

CI runs the job on the two hosts (answers equal ``vlmbatch run``'s on the same manifest).
``--run-slow`` adds host b's processes SIGKILLed mid-job and a new worker node started on
host b (the driver goes on: the lost groups are prepared again there), then the driver
SIGKILLed and the job resumed: every item answered exactly once, the answers still
``vlmbatch run``'s. Where namespaces cannot be made (not root, no ``ip``, EPERM) these skip
with the reason; the tests at the end check that.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jobs import netns
from tests.jobs.interrupting import wait_recorded
from tests.jobs.netns import ADDRESSES, Hosts, netns_pair
from tests.jobs.test_job import ROOT, make_manifest
from vlmbatch.cli.commands import EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.jobs.folder import STORE_FILE, status
from vlmbatch.jobs.store import JobStore

pytest.importorskip("ray")

PORT = 6379  # the head's GCS: each run has namespaces of its own, so no other Ray is there
HEAD = f"{ADDRESSES['a']}:{PORT}"
RAY = ["--executor", "ray", "--model-cpus", "1", "--preprocess-workers", "2",
       "--address", HEAD, "--no-progress"]
# the head notices a dead raylet after 3 missed 1 s health checks (Ray's default: 5 of 3 s)
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
               "RAY_health_check_failure_threshold": "3"}


class Cluster:
    """A head on host a, worker nodes on host b, drivers on host a, one token between them.
    Each node is a ``ray start --block`` in a session of its own (its process group)."""

    def __init__(self, hosts: Hosts, tmp: Path) -> None:
        self.hosts = hosts
        self.ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
        (tmp / "home").mkdir(exist_ok=True)
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN":
                    secrets.token_hex(32), "PYTHONPATH": str(ROOT), "HOME": str(tmp / "home")}
        self.env.pop("RAY_ADDRESS", None)
        self.temp = tempfile.mkdtemp(prefix="vn", dir="/tmp")  # short: Ray's socket paths
        self.procs: list[subprocess.Popen] = []
        self.worker: subprocess.Popen | None = None

    def start_head(self) -> None:
        """The head on host a with no CPUs: no task or actor of a job can run there."""
        self._start("a", {**self.env, **FAST_HEALTH}, "--head", f"--port={PORT}",
                    "--num-cpus=0", f"--temp-dir={self.temp}", "--include-dashboard=false")
        self._wait_head()

    def _start(self, host: str, env: dict, *args: str) -> subprocess.Popen:
        p = subprocess.Popen(self.hosts.cmd(host, [
            self.ray, "start", "--block", "--disable-usage-stats",
            f"--node-ip-address={ADDRESSES[host]}", *args]), env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(p)
        return p

    def _wait_head(self, timeout_s: float = 60) -> None:
        """Until the GCS port answers on host a (a probe run there: the port is not
        reachable from this machine's own namespace)."""
        probe = ("import socket\nfrom tests.waiting import wait_until\n"
                 "def up():\n"
                 f"    socket.create_connection({(ADDRESSES['a'], PORT)!r}, timeout=1).close()\n"
                 "    return True\n"
                 f"wait_until(up, {timeout_s!r}, 'the head', interval=0.2, retry_on=(OSError,))\n")
        subprocess.run(self.hosts.cmd("a", [sys.executable, "-c", probe]), check=True,
                       cwd=ROOT, timeout=timeout_s + 30)

    def start_worker(self, label: str) -> None:
        """A worker node on host b, 3 CPUs (a model actor and 2 prepare tasks); its
        processes see ``VLMBATCH_TEST_NODE=label`` (what the notes name)."""
        self.worker = self._start("b", {**self.env, "VLMBATCH_TEST_NODE": label},
                                  f"--address={HEAD}", "--num-cpus=3")

    def kill_worker_host(self) -> None:
        """SIGKILL to the worker node's process group, then to every process on host b."""
        assert self.worker is not None
        os.killpg(self.worker.pid, signal.SIGKILL)
        self.hosts.kill_all("b")
        self.worker.wait(timeout=30)

    def driver(self, args: list[str], faults: dict) -> subprocess.Popen:
        """``vlmbatch ARGS`` on host a with fault hooks (``tests/faults.py``)."""
        p = subprocess.Popen(self.hosts.cmd("a", [
            sys.executable, "-m", "tests.faults", json.dumps(faults), "--", *args]),
            cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, start_new_session=True)
        self.procs.append(p)
        return p

    def close(self) -> None:
        """After the namespaces' processes were killed (``netns_pair``'s exit)."""
        for p in self.procs:
            p.wait(timeout=30)
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = None
    try:
        with netns_pair() as hosts:
            c = Cluster(hosts, tmp_path)
            c.start_head()
            yield c
    finally:
        if c is not None:
            c.close()


def direct(tmp_path: Path, model: Path, m: Path, per_batch: int) -> list[dict]:
    out = tmp_path / "direct.jsonl"
    assert main(["run", str(m), "-o", str(out), "--model", str(model), "--images-per-batch",
                 str(per_batch), "--no-progress"]) == EXIT_OK
    return [json.loads(x) for x in out.read_text().splitlines()]


def assert_answered_once_as(job: Path, want: list[dict]) -> None:
    """Every item recorded once, no error; the lines ``want``'s: same answers, P(yes) within
    5e-6 (a line's P(yes) is rounded to 6 decimals; the actor runs one torch thread)."""
    store = JobStore(job / STORE_FILE)
    try:
        assert store.counts().pending == 0 and store.counts().failed == 0
        got = [a.line() for a in store.answers()]
    finally:
        store.close()
    assert [(g["id"], g["question_id"]) for g in got] == [(w["id"], w["question_id"])
                                                         for w in want]  # once each
    for g, w in zip(got, want):
        assert (g["answer"], g["error"]) == (w["answer"], None), (g, w)
        assert abs(g["p_yes"] - w["p_yes"]) <= 5e-6 and abs(g["margin"] - w["margin"]) <= 1e-3


def notes_on(notes: Path, hosts: Hosts) -> dict[str, set[str]]:
    """The prepare tasks' and model calls' notes by node label (``tests/fault_points.py``
    ``note_node``); each must have run in host b's network namespace."""
    by: dict[str, set[str]] = {}
    for n in notes.iterdir():
        assert n.read_text() == hosts.net_id("b"), f"{n.name} ran outside host b"
        label, _, what = n.name.split("-", 2)
        by.setdefault(label, set()).add(what)
    return by


def test_a_job_on_two_hosts_runs_on_the_worker_host(cluster: Cluster, tmp_path: Path,
                                                    random_model_dir: Path) -> None:
    cluster.start_worker("hostb")
    m = make_manifest(tmp_path, 4)
    notes, job = tmp_path / "notes", tmp_path / "job"
    notes.mkdir()
    p = cluster.driver(["submit", str(m), "--job", str(job), "--model", str(random_model_dir),
                        "--images-per-batch", "2", "--wait", *RAY],
                       {"note_node": [str(notes), 0], "note_model": [str(notes), 0]})
    want = direct(tmp_path, random_model_dir, m, 2)  # while the nodes and the driver start
    _, err = p.communicate(timeout=300)
    assert p.returncode == EXIT_OK, err[-3000:]
    by = notes_on(notes, cluster.hosts)
    assert set(by) == {"hostb"}
    assert {w for w in by["hostb"] if w.endswith(".png")} == {f"{i}.png" for i in range(4)}
    assert {w for w in by["hostb"] if "model-" in w}, "no model call noted"
    assert_answered_once_as(job, want)


def _wait_done(job: Path, p: subprocess.Popen, done: int) -> None:
    wait_recorded(p, job, done)  # from 0 while `submit --wait` has not made the job yet


@pytest.mark.slow
def test_worker_host_killed_mid_job_then_the_driver_then_resumed(
        cluster: Cluster, tmp_path: Path, random_model_dir: Path) -> None:
    """Prepare tasks take 1 s each. Host b killed once 2 items are recorded; a new node on
    host b; the driver goes on there; killed once 5 are; ``resume`` on host a finishes."""
    n = 10
    cluster.start_worker("hostb")
    m = make_manifest(tmp_path, n)
    want = direct(tmp_path, random_model_dir, m, 1)
    notes, job = tmp_path / "notes", tmp_path / "job"
    notes.mkdir()
    faults = {"note_node": [str(notes), 1.0], "note_model": [str(notes), 0]}
    p = cluster.driver(["submit", str(m), "--job", str(job), "--model", str(random_model_dir),
                        "--images-per-batch", "1", "--wait", *RAY], faults)
    _wait_done(job, p, 2)
    cluster.kill_worker_host()
    recorded = {a.image_id for a in _answers(job)}
    lost = {w for w in notes_on(notes, cluster.hosts)["hostb"] if w.endswith(".png")} \
        - {f"{i}.png" for i in range(n) if f"img{i}" in recorded}
    assert lost, "no prepare task was in flight on host b"
    cluster.start_worker("hostb2")
    _wait_done(job, p, 5)  # the same driver, on the new node
    os.killpg(p.pid, signal.SIGKILL)  # its whole session: `ip netns exec` and the driver
    p.wait()
    assert status(job).done < n
    r = cluster.driver(["resume", str(job), *RAY], faults)
    _, err = r.communicate(timeout=300)
    assert r.returncode == EXIT_OK, err[-3000:]
    by = notes_on(notes, cluster.hosts)
    assert lost <= by["hostb2"]  # the groups in flight on the killed node, prepared again
    assert_answered_once_as(job, want)


def _answers(job: Path) -> list:
    store = JobStore(job / STORE_FILE)
    try:
        return list(store.answers())
    finally:
        store.close()


def test_without_root_it_skips_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match="need root"), netns_pair():
        pass


def test_without_ip_it_skips_saying_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(pytest.skip.Exception, match="no `ip` command"), netns_pair():
        pass


def test_a_refused_netns_add_skips_with_ips_words(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """As in a container without CAP_SYS_ADMIN: ``ip netns add`` fails with EPERM."""
    fake = tmp_path / "ip"
    fake.write_text("#!/bin/sh\necho 'mount --make-shared /run/netns failed: Operation not "
                    "permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert netns.unavailable() is None
    with pytest.raises(pytest.skip.Exception, match="Operation not permitted"), netns_pair():
        pass
