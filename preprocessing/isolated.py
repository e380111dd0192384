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
per worker (``bench/isolation.py`` compares fork and forkserver).
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from queue import SimpleQueue

from preprocessing.decode import ImageError
from preprocessing.decoder_process import unpack
from preprocessing.prepare import ImagePlan, PreparedImage

SLOT_BYTES = 64 << 20  # per worker, sparse: pages are allocated as tiles are written
START_TIMEOUT_S = 120.0  # a worker's start-up (an interpreter and its imports), generously


class DecodeTimeout(ImageError):
    """Preparing one image took longer than the pool's deadline; its worker was killed."""


class DecoderCrashed(ImageError):
    """The worker process preparing the image died (a crash in a decoder, the OOM killer)."""


class _Hung(Exception):
    pass


class _Died(Exception):
    pass


class _Worker:
    """One decoder process and the two pipes and the slot it shares with this one."""

    def __init__(self, setup: tuple, slot_bytes: int) -> None:
        memfd = os.memfd_create("vlmbatch-decoder")
        os.ftruncate(memfd, slot_bytes)
        down_r, down_w = os.pipe()  # to the worker
        up_r, up_w = os.pipe()  # from it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "preprocessing.decoder_process", str(down_r),
                 str(up_w), str(memfd), str(slot_bytes), str(os.getpid())],
                pass_fds=(down_r, up_w, memfd), stdin=subprocess.DEVNULL, stdout=2, env=env)
            self.slot = mmap.mmap(memfd, slot_bytes)
        finally:
            for fd in (down_r, up_w, memfd):
                os.close(fd)
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

    def prepare(self, source: str | bytes, base_dir: Path, timeout_s: float) -> PreparedImage:
        """The worker's answer for one item; raises _Hung past ``timeout_s`` and _Died when
        the worker dies (the caller then kills or drops it)."""
        try:
            self.down.send((source, str(base_dir)))
            if not self.up.poll(timeout_s):
                raise _Hung
            answer = self.up.recv()
        except (EOFError, OSError):
            raise _Died(self.exit_reason()) from None
        if answer[0] in ("error", "raise"):
            raise answer[1]
        return unpack(answer, self.slot)

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
        self.slot.close()


class DecoderPool:
    """``workers`` decoder processes preparing submitted items with ``plan``, FIFO; each
    item's ``Future`` holds its ``PreparedImage`` or raises ``SourceError``/``ImageError``
    (``DecodeTimeout``, ``DecoderCrashed`` included). ``before`` (fault injection, tests
    only) is called in the worker with the item's source before it is read. Workers start
    with the first item; ``stop`` kills them at once, whatever they are doing."""

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

    def submit(self, source: str | bytes, base_dir: Path) -> Future:
        f: Future = Future()
        self.jobs.put((f, source, base_dir))
        return f

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            live = list(self.live)
        for w in live:
            w.proc.kill()  # its thread, waiting on it, sees the pipe close and ends
        for _ in range(self.threads):
            self.jobs.put(None)

    def _serve(self) -> None:
        """One worker's thread: items in, answers out; a hung worker killed, a dead one
        replaced by the next item."""
        w: _Worker | None = None
        try:
            while (job := self.jobs.get()) is not None:
                f, source, base_dir = job
                if not f.set_running_or_notify_cancel():
                    continue  # cancelled before it started
                try:
                    w = w or self._start()
                    f.set_result(w.prepare(source, base_dir, self.timeout_s))
                except _Hung:
                    self._drop(w, kill=True)
                    w = None
                    f.set_exception(DecodeTimeout(
                        f"decoding timed out after {self.timeout_s:g}s (worker killed)"))
                except _Died as e:
                    self._drop(w)
                    w = None
                    f.set_exception(DecoderCrashed(f"preprocessing worker died ({e})"))
                except BaseException as e:  # noqa: BLE001  (handed to whoever waits on f)
                    f.set_exception(e)
        finally:
            self._drop(w, kill=True)

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
