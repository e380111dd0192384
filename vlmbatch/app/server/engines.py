"""The HTTP process's side of the engines: where a prepared request goes to be answered.

``Engines`` is what the routes call (``submit`` a chat question, ``embed`` a prepared
group, ``enqueue_batch``/``cancel_batch``), with two layouts behind it:

- ``EngineProcesses`` (``--engines N``, N >= 1; the default 1): N engine processes
  (``engine_process.py``), each with its own engine thread, reached over a channel
  (``channel.py``). The HTTP process keeps every request's future and arena region by
  request id; a reader thread per engine settles them from the engine's messages.
  A chat request goes to the engine its image's cache key hashes to (so questions about
  one image share that engine's prefix cache) unless that engine has ``SPREAD`` more
  requests outstanding than the least loaded one, which then takes it; each batch goes to
  the engine running the fewest batches.
  **An engine process that dies** (SIGKILL, the OOM killer, a crash in a kernel) is seen
  at once (its pipe closes): its queued and in-flight requests are answered 503 with
  ``Retry-After`` (the seconds its start took; OpenAI clients wait that long and retry),
  a new process is started in its place, and its batches are queued again (on another
  engine, or the new one): their jobs go on with the items still pending, so every item
  is recorded once (``jobs/store.py``). While no engine is up, requests are 503 too.
- ``LocalEngines`` (``--engines 0``): the engine thread in the HTTP process itself (the
  layout before the split; tests on stand-in engines use it).

``BookEvents`` turns what an engine thread reports about a batch into its record's next
state (the HTTP process alone writes ``batches/``).
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from vlmbatch.app.server.batches import BatchBook, BatchRecord
from vlmbatch.app.server.channel import Arena, Arriving, Link, region
from vlmbatch.app.server.config import ServerConfig
from vlmbatch.app.server.embeddings import EmbedRefused, embed_dims, embed_prepared
from vlmbatch.app.server.errors import APIError
from vlmbatch.app.server.scheduler import BatchEvents, Scheduler
from vlmbatch.engine.base import Engine
from vlmbatch.engine.records import Score
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.records import Embedding, ImageItem
from vlmbatch.pipeline.task import Prepared
from vlmbatch.preprocessing.prepare import ImagePlan, PreparedImage

log = logging.getLogger("vlmbatch.app.server")

SPREAD = 8  # outstanding requests an engine may have over the least loaded one
START_TIMEOUT_S = 600.0  # an engine process's start: an interpreter, imports, the model


class BookEvents:
    """``scheduler.BatchEvents`` on the batch records: drained -> ``finalizing`` and the
    output files written (``finalize``); failed -> ``failed``; let go -> as it is, unless it
    was cancelled meanwhile (then finalized)."""

    def __init__(self, book: BatchBook, finalize: Callable[[str], None]) -> None:
        self.book, self.finalize = book, finalize

    def drained(self, batch_id: str, cancelled: bool) -> None:
        if not cancelled:
            self.book.update(batch_id, lambda r: r.at("finalizing")
                             if r.status == "in_progress" else r)
        self.finalize(batch_id)

    def failed(self, batch_id: str, message: str) -> None:
        err = {"code": "server_error", "message": message, "param": None, "line": None}
        self.book.update(batch_id, lambda r: r.at("failed", errors=[err]))

    def released(self, batch_id: str) -> None:
        if self.book.get(batch_id).status == "cancelling":
            self.finalize(batch_id)


@dataclass
class EngineView:
    """One engine as ``/metrics`` shows it."""
    index: int
    up: bool
    outstanding: int  # requests sent, not answered
    batches: int  # batches it runs or has queued
    stats: dict[str, int] = field(default_factory=dict)  # its engine thread's counters


class Engines(ABC):
    image_plan: ImagePlan  # how the chat engine's images are prepared (the HTTP side does)
    embed_plan: ImagePlan | None = None  # the embedding engine's (None: no embeddings)
    embed_dims: int | None = None  # a pooled embedding's full size
    restarts: int = 0  # engine processes started again after one died
    base: dict[str, int]  # counters of engine processes that have died (metrics add them)

    def bind(self, book: BatchBook, events: BatchEvents) -> None:
        self.book, self.events = book, events

    @abstractmethod
    def arriving(self) -> Any:
        """A context manager around a request's parsing and image preparation."""

    @abstractmethod
    def submit(self, item: ImageItem, image: PreparedImage) -> Future[Score]:
        """The item's one question about ``image``, answered in the future (an ``APIError``
        there or here: 429 queue full, 503 no engine up)."""

    @abstractmethod
    def embed(self, dims: int | None, p: Prepared) -> Future[list[list[Embedding]]]:
        """A prepared group of embedding inputs, each item's results in the future."""

    @abstractmethod
    def enqueue_batch(self, batch_id: str) -> None: ...

    @abstractmethod
    def cancel_batch(self, batch_id: str) -> bool:
        """Stop the batch between groups; False when no engine holds it (the caller then
        finalizes it)."""

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self, timeout: float) -> None:
        """Answer what is queued, end each running job's group, leave the jobs resumable."""

    @abstractmethod
    def views(self) -> list[EngineView]: ...


class LocalEngines(Engines):
    """``--engines 0``: the engine thread in this process, on engines built here."""

    def __init__(self, engine: Engine, cfg: ServerConfig, hooks: FaultHooks = NO_HOOKS,
                 embed_engine: Engine | None = None) -> None:
        self.engine, self.cfg, self.hooks, self.embed_engine = engine, cfg, hooks, embed_engine
        self.image_plan = engine.image_plan
        self.base = {}
        if embed_engine is not None:
            self.embed_plan, self.embed_dims = embed_engine.image_plan, embed_dims(embed_engine)

    def bind(self, book: BatchBook, events: BatchEvents) -> None:
        super().bind(book, events)
        self.scheduler = Scheduler(self.engine, self.cfg, events, self.hooks)
        if self.embed_engine is not None:
            self.scheduler.engines["embed"] = self.embed_engine

    def arriving(self) -> Any:
        return self.scheduler.arriving()

    def submit(self, item: ImageItem, image: PreparedImage) -> Future[Score]:
        return self.scheduler.submit(item, image)

    def embed(self, dims: int | None, p: Prepared) -> Future[list[list[Embedding]]]:
        engine = self.embed_engine
        assert engine is not None
        return self.scheduler.call(lambda: embed_prepared(engine, dims, p))

    def enqueue_batch(self, batch_id: str) -> None:
        self.scheduler.enqueue_batch(batch_id, self.book.job_of(batch_id))

    def cancel_batch(self, batch_id: str) -> bool:
        return self.scheduler.cancel_batch(batch_id)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self, timeout: float) -> None:
        self.scheduler.stop(timeout)

    def views(self) -> list[EngineView]:
        s, c = self.scheduler, self.scheduler.counters
        engines = {id(e): e for e in s.engines.values()}.values()
        stats = {"interactive": c.interactive, "batch": c.batch, "calls": c.calls,
                 "prompt_tokens": sum(e.stats.prompt_tokens for e in engines),
                 "prefill_tokens": sum(e.stats.prefill_tokens for e in engines),
                 "depth": s.depth()}
        return [EngineView(0, s.thread.is_alive(), s.depth(), len(s._owned), stats)]


def raise_wire(value: tuple) -> BaseException:
    """The exception an engine process sent (``engine_process.failure``)."""
    if value[0] == "refused":
        return EmbedRefused(value[1], value[2], value[3])
    return APIError.from_wire(value[1])


class EngineProcess:
    """One engine process and its channel, from start to death (then the pool makes a new
    one). ``outstanding``: request id -> (future, arena region)."""

    def __init__(self, index: int, cfg: ServerConfig, hooks: FaultHooks, arriving: Arriving,
                 pool: EngineProcesses) -> None:
        self.index, self.cfg, self.hooks, self.arriving, self.pool = (
            index, cfg, hooks, arriving, pool)
        # request id -> its future and the arena regions of its images
        self.outstanding: dict[int, tuple[Future, list[tuple[int, int] | None]]] = {}
        self.lock = threading.Lock()
        self.up = False
        self.stopping = False
        self.stats: dict[str, int] = {}
        self.info: dict = {}
        self.batches: set[str] = set()
        self.started_s = 0.0  # how long its start took

    def launch(self) -> None:
        """Start the process (it loads the model meanwhile); ``wait_ready`` then."""
        t0 = time.monotonic()
        self.arena = Arena()
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        env.update(self.pool.device_env(self.index))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vlmbatch.app.server.engine_process", str(down_r),
                 str(up_w), str(self.arena.fd), str(self.arena.size), str(self.arriving.fd),
                 str(os.getpid())],
                pass_fds=(down_r, up_w, self.arena.fd, self.arriving.fd),
                stdin=subprocess.DEVNULL, stdout=2, env=env)
        finally:
            os.close(down_r)
            os.close(up_w)
        self.link = Link(up_r, down_w)
        self.link.send((self.cfg, self.hooks, self.index))
        self._t0 = t0

    def wait_ready(self, reader: bool = True) -> dict:
        """The engine's info once it has loaded its model; raises what its start raised.
        ``reader``: start a thread reading its messages (else the caller runs ``read``)."""
        if not self.link.rd.poll(START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"engine process {self.index} did not start in "
                               f"{START_TIMEOUT_S:g}s")
        try:
            msg = self.link.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"engine process {self.index} died while starting "
                               f"({self._exit_reason()}); see its message above") from None
        if msg[0] == "start_failed":
            self.proc.wait()
            raise msg[1]
        self.info = msg[1]
        self.started_s = time.monotonic() - self._t0
        self.up = True
        if reader:
            threading.Thread(target=self.read, name=f"vlmbatch-engine-{self.index}-reader",
                             daemon=True).start()
        return self.info

    def _exit_reason(self) -> str:
        try:
            rc = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"exit code {rc}" if rc >= 0 else f"killed by signal {-rc}"

    def send(self, rid: int, msg: tuple, future: Future, packed: list[tuple | None]) -> None:
        with self.lock:
            if not self.up:
                raise self.pool.unavailable()
            regions = [region(p) for p in packed]
            self.outstanding[rid] = (future, regions)
        try:
            self.link.send(msg)
        except OSError:  # it died just now: the reader answers the future
            pass

    def _settle(self, items: list[tuple[int, bool, Any]]) -> None:
        for rid, ok, value in items:
            with self.lock:
                entry = self.outstanding.pop(rid, None)
            if entry is None:
                continue
            future, regions = entry
            for r in regions:
                self.arena.free(r)
            _settle(future, value if ok else None, None if ok else raise_wire(value))

    def read(self) -> None:
        """Settle requests and pass batch events on until the process ends."""
        while True:
            try:
                msg = self.link.recv()
            except (EOFError, OSError):
                break
            try:
                if msg[0] == "done":
                    self._settle(msg[1])
                    self.stats = msg[2]
                elif msg[0] == "event":
                    self.pool.batch_event(self, msg[1], msg[2], msg[3])
            except Exception:  # noqa: BLE001  (a bug here must not stop the reader)
                log.exception("engine %d: handling %r failed", self.index, msg[0])
        self._gone()

    def _gone(self) -> None:
        """The pipe closed: the process ended (stopped, or died). Every request it held is
        answered 503, its arena dropped."""
        with self.lock:
            self.up = False
            held, self.outstanding = self.outstanding, {}
        for future, _ in held.values():
            _settle(future, error=self.pool.unavailable(died=True))
        self.link.close()
        self.proc.wait()
        self.arena.close()
        if not self.stopping:
            self.pool.died(self)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class EngineProcesses(Engines):
    """``--engines N``: N engine processes (module docstring)."""

    def __init__(self, cfg: ServerConfig, hooks: FaultHooks = NO_HOOKS) -> None:
        self.cfg, self.hooks = cfg, hooks
        self.arriving_count = Arriving()
        self.procs = [EngineProcess(i, cfg, hooks, self.arriving_count, self)
                      for i in range(cfg.engines)]
        self.lock = threading.Lock()
        self.rid = 0
        self.owner: dict[str, EngineProcess] = {}  # batch id -> the engine running it
        self.waiting: list[str] = []  # batches for when an engine is up again
        self.base = {}
        self.stopping = False
        self.retry_after = 5

    def device_env(self, index: int) -> dict[str, str]:
        """One GPU per engine process on a CUDA host with several engines."""
        if not self.cfg.model.device.startswith("cuda") or self.cfg.engines < 2:
            return {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(self.cfg.engines)]
        return {"CUDA_VISIBLE_DEVICES": devices[index % len(devices)]}

    def launch(self) -> None:
        """Start every engine process and wait for all to have loaded their model (raises
        the first one's error, having killed the others)."""
        for p in self.procs:
            p.launch()
        try:
            for p in self.procs:
                p.wait_ready()
        except BaseException:
            for p in self.procs:
                p.stopping = True
                p.kill()
            raise
        info = self.procs[0].info
        self.image_plan = info["image_plan"]
        self.embed_plan, self.embed_dims = info["embed_plan"], info["embed_dims"]
        self.retry_after = max(1, math.ceil(max(p.started_s for p in self.procs)))

    def start(self) -> None:
        pass  # launched before the app: the image plans come from the engines

    def unavailable(self, died: bool = False) -> APIError:
        what = ("the engine process answering this request died; it is being restarted"
                if died else "no engine process is up (one is being restarted)")
        if self.stopping:
            return APIError(503, "the server is shutting down", code="shutting_down")
        return APIError(503, f"{what}: retry in {self.retry_after} s", code="engine_restarting",
                        retry_after=self.retry_after)

    @contextmanager
    def arriving(self) -> Iterator[None]:
        self.arriving_count.add(1)
        try:
            yield
        finally:
            self.arriving_count.add(-1)

    def _pick(self, key: str) -> EngineProcess:
        up = [p for p in self.procs if p.up]
        if not up:
            raise self.unavailable()
        least = min(up, key=lambda p: len(p.outstanding))
        home = up[int(key.split(":", 1)[0][:8] or "0", 16) % len(up)] if len(up) > 1 else least
        if len(home.outstanding) > len(least.outstanding) + SPREAD:
            home = least
        if len(home.outstanding) >= self.cfg.max_queue:
            raise APIError(429, f"the server has {self.cfg.max_queue} requests queued; retry "
                           "shortly", code="queue_full")
        return home

    def _next_rid(self) -> int:
        with self.lock:
            self.rid += 1
            return self.rid

    def submit(self, item: ImageItem, image: PreparedImage) -> Future[Score]:
        p = self._pick(image.cache_key)
        q = item.questions[0]
        packed = p.arena.put(image)
        f: Future[Score] = Future()
        rid = self._next_rid()
        try:
            p.send(rid, ("chat", rid, q, packed), f, [packed])
        except APIError:
            p.arena.free(region(packed))
            raise
        return f

    def embed(self, dims: int | None, prepared: Prepared) -> Future[list[list[Embedding]]]:
        key = next((im.cache_key for im in prepared.images if im is not None), "0")
        p = self._pick(key)
        packed = [None if im is None else p.arena.put(im) for im in prepared.images]
        bare = Prepared(prepared.items, [None] * len(prepared.items), prepared.errors)
        f: Future = Future()
        rid = self._next_rid()
        try:
            p.send(rid, ("embed", rid, dims, bare, packed), f, packed)
        except APIError:
            for x in packed:
                p.arena.free(region(x))
            raise
        return f

    # --- batches ---
    def enqueue_batch(self, batch_id: str) -> None:
        with self.lock:
            up = [p for p in self.procs if p.up]
            if not up:
                self.waiting.append(batch_id)
                return
            p = min(up, key=lambda p: len(p.batches))
            p.batches.add(batch_id)
            self.owner[batch_id] = p
        p.link.send(("batch", batch_id, str(self.book.job_of(batch_id))))

    def cancel_batch(self, batch_id: str) -> bool:
        with self.lock:
            p = self.owner.get(batch_id)
            if p is None:
                if batch_id in self.waiting:
                    self.waiting.remove(batch_id)
                    return False
                return False
        try:
            p.link.send(("cancel", batch_id))
        except OSError:
            pass  # it died: its batches come back through ``died``
        return True

    def batch_event(self, p: EngineProcess, kind: str, batch_id: str, arg: object) -> None:
        with self.lock:
            if self.owner.get(batch_id) is p:
                del self.owner[batch_id]
            p.batches.discard(batch_id)
        if kind == "drained":
            self.events.drained(batch_id, bool(arg))
        elif kind == "failed":
            self.events.failed(batch_id, str(arg))
        else:
            self.events.released(batch_id)

    # --- death and restart ---
    def died(self, p: EngineProcess) -> None:
        """``p``'s process ended on its own: start another in its place; its batches go
        back in the queue (on an engine still up, else the new one)."""
        log.error("engine process %d died (%s); starting another", p.index, p._exit_reason())
        with self.lock:
            self.restarts += 1
            for k, v in p.stats.items():
                if k != "depth":
                    self.base[k] = self.base.get(k, 0) + v
            lost = [b for b, owner in self.owner.items() if owner is p]
            for b in lost:
                del self.owner[b]
        for b in lost:
            self._requeue(b)
        threading.Thread(target=self._restart, args=(p.index,), daemon=True).start()

    def _requeue(self, batch_id: str) -> None:
        rec: BatchRecord = self.book.get(batch_id)
        if rec.status == "in_progress":
            self.enqueue_batch(batch_id)
        elif rec.status == "cancelling":
            self.events.released(batch_id)  # finalized

    def _restart(self, index: int) -> None:
        """Start engine ``index`` again (retrying, with backoff), then read its messages on
        this same thread: its ``PR_SET_PDEATHSIG`` (set so that it dies with the server)
        fires when the thread that started it ends, so that thread lives as long as it."""
        delay = 1.0
        while not self.stopping:
            p = EngineProcess(index, self.cfg, self.hooks, self.arriving_count, self)
            try:
                p.launch()
                p.wait_ready(reader=False)
            except BaseException as e:  # noqa: BLE001  (try again, a little later each time)
                log.error("engine process %d could not be started again: %s", index, e)
                time.sleep(delay)
                delay = min(2 * delay, 30.0)
                continue
            with self.lock:
                self.procs[index] = p
                waiting, self.waiting = self.waiting, []
            if self.stopping:
                p.stopping = True
                p.link.send(("stop", 0.0))
            else:
                log.info("engine process %d started again in %.1f s", index, p.started_s)
                for b in waiting:
                    self.enqueue_batch(b)
            p.read()  # here: the kernel kills a child when the thread that made it ends
            return

    def stop(self, timeout: float) -> None:
        self.stopping = True
        procs = list(self.procs)
        for p in procs:
            p.stopping = True
            try:
                p.link.send(("stop", float(timeout)))
            except OSError:
                pass
        deadline = time.monotonic() + timeout + 5
        for p in procs:
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()

    def views(self) -> list[EngineView]:
        return [EngineView(p.index, p.up, len(p.outstanding), len(p.batches), dict(p.stats))
                for p in self.procs]

    def pids(self) -> list[int]:
        return [p.proc.pid for p in self.procs if p.up]


def _settle(f: Future, result: object = None, error: BaseException | None = None) -> None:
    try:
        if error is not None:
            f.set_exception(error)
        else:
            f.set_result(result)
    except InvalidStateError:  # cancelled meanwhile (the client went away)
        pass
