"""One run per job: an exclusive flock on ``JOB/run.lock`` (``run_lock``), and whether the
run a store calls ``running`` is still alive (``run_alive``).

The holder writes ``PID HOST`` into the lock file, so a refused run and ``status`` can name
it. The kernel drops a flock when its process dies (kill -9 included), so a free lock means
no run, whatever the recorded pid has become since. Where the file system has no flock
(some NFS, CIFS, Lustre, FUSE mounts) runs go unlocked, with a warning, and liveness falls
back to the recorded pid.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vlmbatch.jobs.store import JobStore
from vlmbatch.pipeline.questions import ManifestError

LOCK_FILE = "run.lock"


class JobBusy(ManifestError):
    """Another process is running the job."""


NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}  # flock unsupported


@contextmanager
def run_lock(job: Path, wait_s: float = 2.0) -> Iterator[None]:
    """Hold ``JOB/run.lock`` (an exclusive flock) for a run, or raise ``JobBusy`` naming the
    process that holds it (the holder writes ``PID HOST`` into the file). ``wait_s`` covers a
    ``status`` probing the lock at that moment. The kernel drops the lock when its process
    dies, kill -9 included. Where the file system has no flock the run goes on unlocked,
    with a warning."""
    f = open(job / LOCK_FILE, "a+")  # noqa: SIM115 (held past this frame)
    try:
        if _take(f, job, wait_s):
            f.truncate(0)
            f.write(f"{os.getpid()} {host_id()}\n")
            f.flush()
        yield
    finally:
        f.close()  # releases the lock


def _take(f, job: Path, wait_s: float) -> bool:  # noqa: ANN001
    """Take the exclusive lock on ``f``: True once held, False where flock is unsupported."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise JobBusy(f"job {job} is already running{who(runner_of(job))}; `vlmbatch status "
                          f"{job}` follows it, `vlmbatch cancel {job}` stops it") from None
        except OSError as e:
            if e.errno not in NO_FLOCK:
                raise
            print(f"vlmbatch: warning: {job / LOCK_FILE}: no file locks here ({e.strerror}); "
                  "nothing stops a second run of this job meanwhile", file=sys.stderr)
            return False


def runner_of(job: Path) -> tuple[int, str] | None:
    """(pid, host) of the process holding the job's lock, as it wrote them."""
    try:
        pid, host = (job / LOCK_FILE).read_text().split(maxsplit=1)
        return _runner(pid, host)
    except (OSError, ValueError):
        return None


def recorded_runner(store: JobStore) -> tuple[int, str] | None:
    """The same as the run recorded them in the store (where the lock file holds none: a
    file system without flock)."""
    try:
        return _runner(store.get("run_pid"), store.get("run_host"))
    except ValueError:
        return None


def _runner(pid: str | None, host: str | None) -> tuple[int, str] | None:
    """The host without its pid namespace (``host_id``)."""
    return (int(pid), host.split("/")[0].strip()) if pid and host else None


def who(runner: tuple[int, str] | None) -> str:
    """' (pid N on HOST)', or '' for no runner."""
    return f" (pid {runner[0]} on {runner[1]})" if runner else ""


def _lock_held(lock: Path) -> bool | None:
    """Whether some process holds ``lock``, probed with a shared flock taken and dropped at
    once (a run starting meanwhile waits for it: ``run_lock``'s ``wait_s``); None when it
    cannot tell (unreadable file, no flock on this file system)."""
    try:
        with open(lock) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False
    except OSError:
        return None


def host_id() -> str:
    """This host and pid namespace: a pid means the same process only where both match
    (containers on one host share its name but not its pids)."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{socket.gethostname()}/{ns}"


def run_alive(store: JobStore) -> bool:
    """Whether the process that marked the job running still exists. A run on this host and
    pid namespace is alive while it holds the job's lock; elsewhere (where a shared file
    system may not carry flocks) it is unknown, which counts as alive. Jobs last run by a
    version without the lock, or where the lock cannot be probed, are checked by pid."""
    pid, host = store.get("run_pid"), store.get("run_host")
    if not pid or host != host_id():
        return True
    lock = store.path.parent / LOCK_FILE
    held = _lock_held(lock) if lock.exists() else None
    if held is not None:
        return held
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
