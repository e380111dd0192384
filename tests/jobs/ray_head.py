"""A Ray head started apart (``ray start --head --block``, as on a cluster) for the tests that
join a running cluster by its GCS address or through Ray Client (``ray://``).

Token authentication with a token of its own (no ``~/.ray/auth_token`` read or written), its
own temp dir (short: Ray's socket paths must fit 107 bytes; and this head and another Ray on
the machine then share no "current cluster" file), in its own session, so that stopping it
stops this head only (``ray stop`` would stop every Ray instance on the machine).

Three things about Ray Client that made the join test flaky on a loaded machine (issue 26),
each reproduced (the figures in the issue's report):

- The head's Ray Client server starts one server process per driver (``python
  setup_worker.py -m ray.util.client.server``: two interpreters importing Ray) and gives up
  on it after ``RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S`` (30 s by default); the driver then
  sees "Initialization failure from server: ... Proxy failed to Connect to backend!". The
  head here waits ``CLIENT_WAIT_S`` instead, as ``docs/jobs.md`` tells a loaded cluster to.
- It starts that process with ``subprocess.Popen`` (fork, then Python code, then exec) from
  a thread of its own multi-threaded gRPC server, whose gRPC core runs fork handlers: now
  and then the child died before exec (SIGSEGV or SIGABRT within 12 ms, an empty log; the
  driver sees "Starting Ray client server failed" or "psutil.ZombieProcess"; Ray's issue
  63202). ``GRPC_ENABLE_FORK_SUPPORT=0`` on the head turns those handlers off: 4 such deaths
  in 32 ray:// joins before, 0 in 32 with it, two heads side by side on 2 loaded cores.
- That server process takes the first port from 23000 up that binds at the moment it is
  chosen, and binds it a second or two later with SO_REUSEPORT (gRPC's default). Two heads
  on one machine (other worktrees' suites run this test too) can both choose 23000: then a
  driver's channel lands on the other head's server, which refuses its token
  (UNAUTHENTICATED: "the Ray client has already been disconnected"). ``ray_client_lock``
  keeps two ray:// joins of these tests on one machine from starting at once.
"""

from __future__ import annotations

import fcntl
import functools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.loopback import free_port
from tests.waiting import wait_until
from vlmbatch.jobs.ray_cluster import CLIENT_WAIT_ENV

ROOT = Path(__file__).resolve().parents[2]  # holds tests/ and vlmbatch/: the drivers' imports
CLIENT_WAIT_S = 120  # measured: the server process listened 0.6-2.2 s after its start
# the head's environment for Ray Client (both documented in docs/jobs.md)
HEAD_ENV = {CLIENT_WAIT_ENV: str(CLIENT_WAIT_S), "GRPC_ENABLE_FORK_SUPPORT": "0"}
LOCK = Path(tempfile.gettempdir()) / "vlmbatch-tests-ray-client.lock"


def wait_listening(*ports: int, timeout_s: float = 60) -> None:
    """Until each of ``ports`` on 127.0.0.1 accepts a connection (``timeout_s`` in all)."""
    deadline = time.monotonic() + timeout_s
    for port in ports:
        wait_until(functools.partial(_listens, port), max(0.0, deadline - time.monotonic()),
                   f"a listener on {port}", interval=0.2, retry_on=(OSError,))


def _listens(port: int) -> bool:
    socket.create_connection(("127.0.0.1", port), timeout=1).close()
    return True


@contextmanager
def ray_client_lock() -> Iterator[None]:
    """Held while a ray:// driver joins: one at a time on this machine (see above)."""
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class RayHead:
    """A head with ``cpus`` CPUs; ``env``: what a driver needs to join it (the token)."""

    def __init__(self, tmp: Path, cpus: int = 3) -> None:
        ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
        assert ray_cli, "the ray command comes with the ray package"
        self.gcs, self.client = free_port(), free_port()
        (tmp / "home").mkdir(exist_ok=True)
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN":
                    secrets.token_hex(32), "PYTHONPATH": str(ROOT), "HOME": str(tmp / "home")}
        self.env.pop("RAY_ADDRESS", None)
        self.temp = tempfile.mkdtemp(prefix="vr", dir="/tmp")
        self.proc = subprocess.Popen(
            [ray_cli, "start", "--head", "--block", f"--port={self.gcs}",
             f"--ray-client-server-port={self.client}", f"--num-cpus={cpus}",
             f"--temp-dir={self.temp}", "--include-dashboard=false", "--disable-usage-stats"],
            env={**self.env, **HEAD_ENV}, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            # the Ray Client port opens only once the head's node is registered (its server
            # asks the GCS for the node before it listens): both ports answer = ready
            wait_listening(self.gcs, self.client)
        except BaseException:
            self.stop()
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs}"

    @property
    def client_address(self) -> str:
        return f"ray://127.0.0.1:{self.client}"

    def drivers(self) -> int:
        """How many drivers have joined this head: one core-worker log each in its session
        (a ray:// driver's is its server process on the head)."""
        return len(list(Path(self.temp).glob("session_latest/logs/python-core-driver-*.log")))

    def client_logs(self, chars: int = 3000) -> str:
        """The end of each Ray Client server log of this head (for a failed join's message)."""
        logs = sorted(Path(self.temp).glob("session_latest/logs/ray_client_server*.err"))
        return "\n".join(f"== {f.name}\n{f.read_text(errors='replace')[-chars:]}" for f in logs)

    def stop(self) -> None:
        """SIGKILL to the head's process group (raylet, GCS, workers, Ray Client servers):
        SIGTERM took 33-36 s, the GCS waiting on its shut-down; nothing of it is kept."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)
        shutil.rmtree(self.temp, ignore_errors=True)
