"""The one kill-and-resume sequence of the job tests: a ``vlmbatch`` command in a subprocess
(``tests.jobs.test_job.cli``, slowed by a fault hook so that it is still going), stopped by a
signal once the job's store holds N items (``stop_at``: ``wait_recorded``, then ``stop``),
then resumed (``resume``), then the one check that every item's lines are recorded exactly
once (``assert_each_once``).

Every wait has a deadline (``tests.waiting.wait_until``); a command that ends before it is
stopped fails the test with the end of its stderr, not with a count that never came.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

from tests.waiting import wait_until
from vlmbatch.cli.commands import EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.jobs.folder import STORE_FILE, is_job, status
from vlmbatch.jobs.store import JobStore


def recorded(job: Path) -> int:
    """Items the job's store holds as done (0 before ``submit --wait`` has made the job)."""
    return status(job).done if is_job(job) else 0


def wait_recorded(p: subprocess.Popen, job: Path, done: int,
                  when: Callable[[], object] | None = None, timeout: float = 240) -> None:
    """Until ``job``'s store holds ``done`` items (and ``when()``, if given, holds too) while
    ``p`` still runs; ``p`` ending first fails the test with its stderr."""
    def ready() -> bool:
        return p.poll() is not None or (recorded(job) >= done and bool(when is None or when()))

    wait_until(ready, timeout, f"{done} items of {job} recorded by pid {p.pid}", interval=0.1)
    if p.poll() is not None:
        _, err = p.communicate()
        raise AssertionError(f"pid {p.pid} ended (exit {p.returncode}) before it was stopped, "
                             f"{recorded(job)} items recorded: {(err or '')[-3000:]}")


def stop(p: subprocess.Popen, sig: int = signal.SIGKILL) -> str:
    """Send ``sig`` to ``p``; return its stderr once it has ended. After a SIGKILL only ``p``
    is waited for (processes it started may still hold its pipes): no stderr."""
    p.send_signal(sig)
    if sig == signal.SIGKILL:
        p.wait(timeout=60)
        return ""
    _, err = p.communicate(timeout=120)
    return err or ""


def stop_at(p: subprocess.Popen, job: Path, done: int, sig: int = signal.SIGKILL,
            when: Callable[[], object] | None = None, timeout: float = 240) -> str:
    """``wait_recorded`` then ``stop``: the kill (or other signal) of the sequence."""
    wait_recorded(p, job, done, when, timeout)
    return stop(p, sig)


def resume(job: Path, *args: str, rc: int = EXIT_OK) -> None:
    """``vlmbatch resume JOB ARGS --no-progress`` in this process, exiting ``rc``."""
    assert main(["resume", str(job), *args, "--no-progress"]) == rc


def assert_each_once(job: Path, ids: Iterable[str], per_item: int = 2, failed: int = 0
                     ) -> list[dict]:
    """Nothing pending, ``failed`` items failed, and the store's result lines (answers or
    embeddings, errors included) are ``per_item`` lines for each of ``ids``, exactly once,
    each item's in one row; returns those lines (JSON objects, as the store keeps them)."""
    store = JobStore(job / STORE_FILE)
    try:
        counts = store.counts()
        assert (counts.pending, counts.failed) == (0, failed), counts
        rows = [json.loads(r) for (r,) in store.db.execute("SELECT result FROM items")]
    finally:
        store.close()
    assert all(len(row) == per_item for row in rows)  # an item's lines, recorded together
    lines = [ln for row in rows for ln in row]
    assert sorted(ln["id"] for ln in lines) == sorted(i for i in ids for _ in range(per_item))
    return lines
