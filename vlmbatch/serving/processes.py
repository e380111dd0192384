"""``EngineProcesses`` (``--engines N``, N >= 1; the default 1): N engine processes
(``engine_process.py``), each with its own engine thread, reached over a channel
(``channel.py``, ``messages.py``).

The HTTP process keeps every request's future and arena region by request id; a reader
thread per engine settles them from the engine's messages. A chat question goes to the
engine its image's cache key hashes to (so questions about one image share that engine's
prefix cache) unless that engine has ``SPREAD`` more requests outstanding than the least
loaded one, which then takes it; each batch goes to the engine running the fewest batches.

**An engine process that dies** (SIGKILL, the OOM killer, a crash in a kernel) is seen at
once (its pipe closes): its queued and in-flight requests are answered 503 with
``Retry-After`` (the seconds its start took; OpenAI clients wait that long and retry), a new
process is started in its place, and its batches are queued again (on another engine, or
the new one; a batch cancelled meanwhile is let go, and its record finalized): their jobs
go on with the items still pending, so every item is recorded once (``jobs/store.py``).
While no engine is up, requests are 503 too.

Engine processes are started as ``python -P -m vlmbatch.serving.engine_process`` with this
process's ``vlmbatch`` first on their path (``common/children.py``), whatever the working
directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

from vlmbatch.common.children import child_env, python_module
from vlmbatch.engine.records import Item, Score
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.questions import Question
from vlmbatch.pipeline.records import Embedding, EmbedItem
from vlmbatch.pipeline.task import Prepared, stills
from vlmbatch.serving.channel import Arena, Arriving, Link, Residents
from vlmbatch.serving.config import ServingConfig
from vlmbatch.serving.engines import Engines, EngineView
from vlmbatch.serving.errors import APIError, queue_full, shutting_down
from vlmbatch.serving.messages import (
    Ask,
    BatchDrained,
    BatchEvent,
    BatchFailed,
    CancelBatch,
    Counters,
    Embed,
    EngineInfo,
    Packed,
    Ready,
    Reply,
    RunBatch,
    Settled,
    Start,
    StartFailed,
    Stop,
)
from vlmbatch.serving.scheduler import BatchEvents, settle

log = logging.getLogger("vlmbatch.server")

SPREAD = 8  # outstanding requests an engine may have over the least loaded one
START_TIMEOUT_S = 600.0  # an engine process's start: an interpreter, imports, the model


def resolve_on_loops(done: list[tuple[asyncio.Future, object, BaseException | None]]
                     ) -> None:
    """Settle event-loop futures from this (another) thread: one call on each loop for all
    of its futures (a future cancelled meanwhile, its client gone, is skipped)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for item in done:
        by_loop.setdefault(item[0].get_loop(), []).append(item)
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve, items)
        except RuntimeError:  # the loop has closed: nobody waits
            pass


def _resolve(items: list[tuple[asyncio.Future, object, BaseException | None]]) -> None:
    for f, result, error in items:
        if f.done():
            continue
        if error is not None:
            f.set_exception(error)
        else:
            f.set_result(result)


def add(a: Counters, b: Counters) -> Counters:
    """Counters summed (the depth gauge left out)."""
    return Counters(*(getattr(a, f.name) + getattr(b, f.name)
                      for f in dataclasses.fields(Counters) if f.name != "depth"))


class EngineProcess:
    """One engine process and its channel, from start to death (then the pool makes a new
    one). ``outstanding``: request id -> (future, arena regions)."""

    def __init__(self, index: int, cfg: ServingConfig, hooks: FaultHooks, arriving: Arriving,
                 pool: EngineProcesses) -> None:
        self.index, self.cfg, self.hooks, self.arriving, self.pool = (
            index, cfg, hooks, arriving, pool)
        # request id -> its future and the images it holds in the arena
        self.outstanding: dict[int, tuple[Future | asyncio.Future, list[Packed | None]]] = {}
        self.lock = threading.Lock()
        self.up = False
        self.stopping = False
        self.stats = Counters()
        self.info: EngineInfo | None = None
        self.batches: set[str] = set()
        self.started_s = 0.0  # how long its start took

    def launch(self) -> None:
        """Start the process (it loads the model meanwhile); ``wait_ready`` then."""
        self._t0 = time.monotonic()
        self.arena = Arena()
        self.residents = Residents(self.arena)
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                python_module("vlmbatch.serving.engine_process", str(down_r), str(up_w),
                              str(self.arena.fd), str(self.arena.size),
                              str(self.arriving.fd), str(os.getpid())),
                pass_fds=(down_r, up_w, self.arena.fd, self.arriving.fd),
                stdin=subprocess.DEVNULL, stdout=2,
                env=child_env(**self.pool.device_env(self.index)))
        finally:
            os.close(down_r)
            os.close(up_w)
        self.link = Link(up_r, down_w)
        self.link.send(Start(self.cfg, self.hooks, self.index))

    def wait_ready(self, reader: bool = True) -> EngineInfo:
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
                               f"({self.exit_reason()}); see its message above") from None
        if isinstance(msg, StartFailed):
            self.proc.wait()
            raise msg.error
        assert isinstance(msg, Ready), msg
        self.info = msg.info
        self.started_s = time.monotonic() - self._t0
        self.up = True
        if reader:
            threading.Thread(target=self.read, name=f"vlmbatch-engine-{self.index}-reader",
                             daemon=True).start()
        return self.info

    def exit_reason(self) -> str:
        try:
            rc = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"exit code {rc}" if rc >= 0 else f"killed by signal {-rc}"

    def send(self, msg: Ask | Embed, future: Future | asyncio.Future,
             packed: list[Packed | None]) -> None:
        with self.lock:
            if not self.up:
                raise self.pool.unavailable()
            self.outstanding[msg.rid] = (future, packed)
        try:
            self.link.send(msg)
        except OSError:  # it died just now: the reader answers the future
            pass

    def _answered(self, answers: tuple[Reply, ...]) -> None:
        on_loop: list[tuple[asyncio.Future, object, BaseException | None]] = []
        for a in answers:
            with self.lock:
                entry = self.outstanding.pop(a.rid, None)
            if entry is None:
                continue
            future, held = entry
            for p in held:
                self.residents.release(p)
            error = None if a.failure is None else a.failure.exception()
            if isinstance(future, asyncio.Future):
                on_loop.append((future, a.result, error))
            else:
                settle(future, a.result, error)
        resolve_on_loops(on_loop)

    def read(self) -> None:
        """Settle requests and pass batch events on until the process ends."""
        while True:
            try:
                msg = self.link.recv()
            except (EOFError, OSError):
                break
            try:
                if isinstance(msg, Settled):
                    self._answered(msg.answers)
                    self.stats = msg.stats
                else:
                    self.pool.batch_event(self, msg)
            except Exception:  # noqa: BLE001  (a bug here must not stop the reader)
                log.exception("engine %d: handling %s failed", self.index, type(msg).__name__)
        self._gone()

    def _gone(self) -> None:
        """The pipe closed: the process ended (stopped, or died). Every request it held is
        answered 503, its arena dropped."""
        with self.lock:
            self.up = False
            held, self.outstanding = self.outstanding, {}
        on_loop: list[tuple[asyncio.Future, object, BaseException | None]] = []
        for future, _ in held.values():
            if isinstance(future, asyncio.Future):
                on_loop.append((future, None, self.pool.unavailable(died=True)))
            else:
                settle(future, error=self.pool.unavailable(died=True))
        resolve_on_loops(on_loop)
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

    def __init__(self, cfg: ServingConfig, hooks: FaultHooks = NO_HOOKS) -> None:
        self.cfg, self.hooks = cfg, hooks
        self.arriving_count = Arriving()
        self.procs = [EngineProcess(i, cfg, hooks, self.arriving_count, self)
                      for i in range(cfg.engines)]
        self.lock = threading.Lock()
        self.rid = 0
        self.owner: dict[str, EngineProcess] = {}  # batch id -> the engine running it
        self.jobs: dict[str, Path] = {}  # batch id -> its job folder, until it ends
        self.cancelled: set[str] = set()  # batches asked to stop
        self.waiting: list[str] = []  # batches for when an engine is up again
        self.base = Counters()
        self.stopping = False
        self.retry_after = 5

    def bind(self, events: BatchEvents) -> None:
        self.events = events

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
            infos = [p.wait_ready() for p in self.procs]
        except BaseException:
            for p in self.procs:
                p.stopping = True
                p.kill()
            raise
        self.image_plan, self.video_plan = infos[0].image_plan, infos[0].video_plan
        self.embed_plan, self.embed_dims = infos[0].embed_plan, infos[0].embed_dims
        self.retry_after = max(1, math.ceil(max(p.started_s for p in self.procs)))

    def start(self) -> None:
        pass  # launched before the app: the image plans come from the engines

    def unavailable(self, died: bool = False) -> APIError:
        what = ("the engine process answering this request died; it is being restarted"
                if died else "no engine process is up (one is being restarted)")
        if self.stopping:
            return shutting_down()
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
            raise queue_full(self.cfg.max_queue)
        return home

    def _next_rid(self) -> int:
        with self.lock:
            self.rid += 1
            return self.rid

    def submit(self, question: Question, image: Item) -> Future[Score]:
        f: Future[Score] = Future()
        self._ask(question, image, f)
        return f

    def ask(self, question: Question, image: Item) -> asyncio.Future[Score]:
        """The loop's own future, settled with the others of the same engine turn in one
        call on the loop (``resolve_on_loops``), not one wake-up per request."""
        f: asyncio.Future[Score] = asyncio.get_running_loop().create_future()
        self._ask(question, image, f)
        return f

    def _ask(self, question: Question, image: Item,
             f: Future | asyncio.Future) -> None:
        p = self._pick(image.cache_key)
        packed = p.residents.hold(image)
        try:
            p.send(Ask(self._next_rid(), question, packed), f, [packed])
        except APIError:
            p.residents.release(packed)
            raise

    def embed(self, dims: int | None, prepared: Prepared[EmbedItem]
              ) -> Future[list[list[Embedding]]]:
        key = next((im.cache_key for im in prepared.images if im is not None), "0")
        p = self._pick(key)
        packed = [None if im is None else p.residents.hold(stills([im])[0])
                  for im in prepared.images]
        bare = Prepared(prepared.items, [None] * len(prepared.items), prepared.errors)
        f: Future = Future()
        try:
            p.send(Embed(self._next_rid(), dims, bare, tuple(packed)), f, packed)
        except APIError:
            for x in packed:
                p.residents.release(x)
            raise
        return f

    # --- batches ---
    def enqueue_batch(self, batch_id: str, job: Path) -> None:
        with self.lock:
            self.jobs[batch_id] = job
            up = [p for p in self.procs if p.up]
            if not up:
                self.waiting.append(batch_id)
                return
            p = min(up, key=lambda p: len(p.batches))
            p.batches.add(batch_id)
            self.owner[batch_id] = p
        p.link.send(RunBatch(batch_id, job))

    def cancel_batch(self, batch_id: str) -> bool:
        with self.lock:
            self.cancelled.add(batch_id)
            p = self.owner.get(batch_id)
            if p is None:
                if batch_id in self.waiting:
                    self.waiting.remove(batch_id)
                return False
        try:
            p.link.send(CancelBatch(batch_id))
        except OSError:
            pass  # it died: its batches come back through ``died``
        return True

    def batch_event(self, p: EngineProcess, event: BatchEvent) -> None:
        b = event.batch_id
        with self.lock:
            if self.owner.get(b) is p:
                del self.owner[b]
            p.batches.discard(b)
            self.jobs.pop(b, None)
        if isinstance(event, BatchDrained):
            self.events.drained(b, event.cancelled)
        elif isinstance(event, BatchFailed):
            self.events.failed(b, event.message)
        else:
            self.events.released(b)

    # --- death and restart ---
    def died(self, p: EngineProcess) -> None:
        """``p``'s process ended on its own: start another in its place; its batches go
        back in the queue (on an engine still up, else the new one), those cancelled
        meanwhile let go (then finalized)."""
        log.error("engine process %d died (%s); starting another", p.index, p.exit_reason())
        with self.lock:
            self.restarts += 1
            self.base = add(self.base, p.stats)
            lost = [b for b, owner in self.owner.items() if owner is p]
            for b in lost:
                del self.owner[b]
        for b in lost:
            if b in self.cancelled:
                self.jobs.pop(b, None)
                self.events.released(b)
            else:
                self.enqueue_batch(b, self.jobs[b])
        threading.Thread(target=self._restart, args=(p.index,), daemon=True).start()

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
                p.link.send(Stop(0.0))
            else:
                log.info("engine process %d started again in %.1f s", index, p.started_s)
                for b in waiting:
                    self.enqueue_batch(b, self.jobs[b])
            p.read()  # here: the kernel kills a child when the thread that made it ends
            return

    def stop(self, timeout: float) -> None:
        self.stopping = True
        procs = list(self.procs)
        for p in procs:
            p.stopping = True
            try:
                p.link.send(Stop(float(timeout)))
            except OSError:
                pass
        deadline = time.monotonic() + timeout + 5
        for p in procs:
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()

    def views(self) -> list[EngineView]:
        return [EngineView(p.index, p.up, len(p.outstanding), len(p.batches), p.stats)
                for p in self.procs]

    def pids(self) -> list[int]:
        return [p.proc.pid for p in self.procs if p.up]
