"""Decoding where it can be abandoned: ``DecoderPool`` prepares images in worker processes
(``preprocessing/decoder_process.py``), one item at a time each, under a deadline.

A worker that passes ``timeout_s`` on one item is killed (SIGKILL) and that item fails with
``DecodeTimeout``; a worker that dies (a segfault in a decoder, the OOM killer) fails its
item with ``DecoderCrashed``; either way the next item gets a fresh worker and the caller
goes on. What crosses the boundary: the item's path or URL (or its bytes) in, pickled; the
tiles out through a shared-memory slot per worker (a memfd both map: one copy out of it in
this process, instead of pickling megabytes through a pipe, ``bench/isolation.py``), the
rest of the ``PreparedImage`` pickled.

Workers are started by exec, not fork: the parent holds torch's and OpenCV's thread pools,
our own threads and perhaps a CUDA context, none of which a forked child may safely touch,
and a fresh interpreter that imports only ``preprocessing`` costs ~0.25 s and ~50 MB once
per worker (``bench/isolation.py`` compares fork and forkserver). They import this process's
``vlmbatch`` whatever the working directory (``common/children.py``).
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from queue import Empty, SimpleQueue

from vlmbatch.common.children import child_env, python_module
from vlmbatch.preprocessing.decode import ImageError
from vlmbatch.preprocessing.decoder_process import unpack_media
from vlmbatch.preprocessing.media import MediaPart, WindowedClip
from vlmbatch.preprocessing.prepare import ImagePlan
from vlmbatch.preprocessing.video_source import VideoSource

SLOT_BYTES = 64 << 20  # per slot, two a worker, sparse: pages are allocated as written
DEPTH = 2  # items in a worker's pipe at once: it starts the next while this process copies
START_TIMEOUT_S = 120.0  # a worker's start-up (an interpreter and its imports), generously


class DecodeTimeout(ImageError):
    """Preparing one image took longer than the pool's deadline; its worker was killed."""


class DecoderCrashed(ImageError):
    """The worker process preparing the image died (a crash in a decoder, the OOM killer)."""


class _Hung(Exception):
    pass


@dataclass
class _Job:
    future: Future
    source: str | bytes | VideoSource
    base_dir: Path
    offset: int | None = None  # its slot, once sent to a worker
    since: float | None = None  # when that worker reached it


class _Died(Exception):
    pass


_START = object()  # in the jobs queue: start a worker now, without an item (DecoderPool.start)


class _Worker:
    """One decoder process, the two pipes and the two slots (one memfd) it shares with this
    one: item k's arrays go to slot k % 2, so the worker fills one while the other is
    copied out here."""

    def __init__(self, setup: tuple, slot_bytes: int) -> None:
        memfd = os.memfd_create("vlmbatch-decoder")
        os.ftruncate(memfd, 2 * slot_bytes)
        down_r, down_w = os.pipe()  # to the worker
        up_r, up_w = os.pipe()  # from it
        try:
            self.proc = subprocess.Popen(
                python_module("vlmbatch.preprocessing.decoder_process", str(down_r),
                              str(up_w), str(memfd), str(slot_bytes), str(os.getpid())),
                pass_fds=(down_r, up_w, memfd), stdin=subprocess.DEVNULL, stdout=2,
                env=child_env())
            self.slots = mmap.mmap(memfd, 2 * slot_bytes)
        finally:
            for fd in (down_r, up_w, memfd):
                os.close(fd)
        self.slot_bytes, self.sent = slot_bytes, 0
        self.down = Connection(down_w, readable=False)
        self.up = Connection(up_r, writable=False)
        try:
            self.down.send(setup)
            if not self.up.poll(START_TIMEOUT_S):
                raise _Hung
            self.up.recv()  # ("ready", pid)
        except (_Hung, EOFError, OSError):
            self.kill()
            raise RuntimeError(f"could not start a decoder process ({self.exit_reason()}); "
                               "see its message above") from None

    def send(self, source: str | bytes | VideoSource, base_dir: Path) -> int:
        """Queue an item in the worker's pipe; returns the offset of its slot."""
        offset = (self.sent % 2) * self.slot_bytes
        self.sent += 1
        try:
            self.down.send((source, str(base_dir), offset))
        except OSError:
            raise _Died(self.exit_reason()) from None
        return offset

    def receive(self, timeout_s: float, offset: int) -> MediaPart | WindowedClip:
        """The answer for the oldest item sent; raises _Hung past ``timeout_s`` and _Died
        when the worker dies (the caller then kills or drops it)."""
        try:
            if not self.up.poll(max(timeout_s, 0.0)):
                raise _Hung
            answer = self.up.recv()
        except (EOFError, OSError):
            raise _Died(self.exit_reason()) from None
        if answer[0] in ("error", "raise"):
            raise answer[1]
        return unpack_media(answer, self.slots, offset)

    def exit_reason(self) -> str:
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return "still running"
        if rc < 0:
            return f"killed by {signal.Signals(-rc).name}"
        return f"exit code {rc}"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.close()

    def close(self) -> None:
        for c in (self.down, self.up):
            c.close()
        self.slots.close()


class DecoderPool:
    """``workers`` decoder processes preparing submitted items with ``plan``, FIFO; each
    item's ``Future`` holds its ``PreparedImage`` (a clip's: ``PreparedVideo``) or raises
    ``SourceError``/``ImageError`` (``DecodeTimeout``, ``DecoderCrashed`` included).
    ``before`` (fault injection, tests only) is called in the worker with the item's source
    before it is read. Workers start with the first item; ``stop`` kills them at once,
    whatever they are doing."""

    def __init__(self, workers: int, plan: ImagePlan, max_pixels: int, timeout_s: float,
                 before: Callable[[str], None] | None = None,
                 slot_bytes: int = SLOT_BYTES) -> None:
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.setup = (plan, max_pixels, before)
        self.timeout_s, self.slot_bytes = timeout_s, slot_bytes
        self.jobs: SimpleQueue = SimpleQueue()
        self.live: set[_Worker] = set()
        self.lock = threading.Lock()
        self.stopped = False
        self.threads = workers
        for i in range(workers):
            threading.Thread(target=self._serve, name=f"vlmbatch-decoder-{i}",
                             daemon=True).start()

    def submit(self, source: str | bytes | VideoSource, base_dir: Path) -> Future:
        """Prepare ``source`` (an image's path, URL or bytes; a ``VideoSource``: a clip,
        whose future holds a ``PreparedVideo``) in a worker, under the deadline."""
        f: Future = Future()
        self.jobs.put(_Job(f, source, base_dir))
        return f

    def start(self) -> None:
        """Start the workers now instead of with the first item (a caller whose items are
        still being fetched: the interpreters start meanwhile). A hint: a thread busy with
        items starts its worker with them."""
        for _ in range(self.threads):
            self.jobs.put(_START)

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            live = list(self.live)
        for w in live:
            w.proc.kill()  # its thread, waiting on it, sees the pipe close and ends
        for _ in range(self.threads):
            self.jobs.put(None)

    def _serve(self) -> None:
        """One worker's thread: up to ``DEPTH`` items in its pipe (so it never waits for
        this process between two), answers out in order. Each item's deadline runs from
        when the worker reaches it (the previous answer, or its sending to an idle one); a
        worker past it is killed, a dead one dropped, and its other items go to the next."""
        w: _Worker | None = None
        queued: deque[_Job] = deque()  # taken from self.jobs, not answered; the first in work
        try:
            while self._take(queued):
                try:
                    w = w or self._start()
                except BaseException as e:  # noqa: BLE001  (handed to whoever waits)
                    for job in queued:
                        job.future.set_exception(e)
                    queued.clear()
                    continue
                if queued:  # else only asked to start (``start``)
                    w = self._step(w, queued)
        finally:
            self._drop(w, kill=True)

    def _take(self, queued: deque[_Job]) -> bool:
        """Top ``queued`` up to ``DEPTH`` (waiting only while it is empty); False once the
        pool stops."""
        while len(queued) < DEPTH:
            try:
                got = self.jobs.get(block=not queued)
            except Empty:
                return True
            if got is None:
                return False
            if got is _START:
                if not queued:
                    return True
                continue
            if got.future.set_running_or_notify_cancel():  # else cancelled before it started
                queued.append(got)
        return True

    def _step(self, w: _Worker, queued: deque[_Job]) -> _Worker | None:
        """Send what ``w`` has not got yet, then take one answer; returns the worker to go
        on with (None: it was killed or died, and the items it held are sent again)."""
        now = time.monotonic()
        for job in queued:
            if job.offset is None:
                job.offset = w.send(job.source, job.base_dir)
                job.since = job.since or now
        head = queued[0]
        assert head.since is not None and head.offset is not None  # sent above
        try:
            image = w.receive(head.since + self.timeout_s - time.monotonic(), head.offset)
        except _Hung:
            queued.popleft().future.set_exception(DecodeTimeout(
                f"decoding timed out after {self.timeout_s:g}s (worker killed)"))
            return self._replace(w, queued, kill=True)
        except _Died as e:
            queued.popleft().future.set_exception(
                DecoderCrashed(f"preprocessing worker died ({e})"))
            return self._replace(w, queued, kill=False)
        except BaseException as e:  # noqa: BLE001  (the item's error, or a bug: its caller's)
            queued.popleft().future.set_exception(e)
        else:
            queued.popleft().future.set_result(image)
        if queued:
            queued[0].since = time.monotonic()  # the worker is on it now
        return w

    def _replace(self, w: _Worker, queued: deque[_Job], kill: bool) -> _Worker | None:
        """None, once ``w`` is killed or dropped; the items it held but never reached go
        to the next worker."""
        self._drop(w, kill=kill)
        for job in queued:
            job.offset = job.since = None
        return None

    def _start(self) -> _Worker:
        with self.lock:
            if self.stopped:
                raise RuntimeError("the decoder pool is stopped")
        w = _Worker(self.setup, self.slot_bytes)
        with self.lock:
            self.live.add(w)
            if self.stopped:  # stop() ran while it started
                w.proc.kill()
        return w

    def _drop(self, w: _Worker | None, kill: bool = False) -> None:
        if w is None:
            return
        with self.lock:
            self.live.discard(w)
        if kill:
            w.kill()
        else:
            w.close()
