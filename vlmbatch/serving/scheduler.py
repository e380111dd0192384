"""The engine thread: the one thread that calls the engine (which is not thread-safe), in the
engine process (``engine_process.py``; in the HTTP process itself with ``--engines 0``).

Interactive chat questions arrive prepared (decoded and tiled by the HTTP process, so a bad
image is that request's 400 before it is queued) in a bounded queue. The loop, each turn:

0. **Calls first.** Other interactive work that needs the engine (an embeddings request)
   is queued as a call (``call``) and run before anything else.
1. **Interactive next.** If a question is queued, take it and every other one queued,
   wait up to ``batch_wait_s`` for more while some are on their way (parsed, their image
   being prepared: ``arriving``, a count the HTTP process keeps; a lone client waits for
   nothing), at most ``max_batch_requests``, and answer them in one ``engine.score`` call,
   which cuts them into forwards under the engine's token budget
   (``EngineConfig.max_batch_tokens``) as it does offline; the images are deduplicated by
   their cache key, so questions about the same image share its prefix (one image-token
   prefill, the others reuse the cached blocks).
2. **Then batch jobs.** Only when no question is queued, one group (``images_per_batch``
   items) of the current batch's job is answered and recorded (``jobs.job``'s exactly-once
   transaction). An interactive request therefore waits at most for one group's engine
   call, never for a whole batch.

An engine failure on a call of several questions retries each alone, so one question that
breaks the engine fails alone (a 500 naming the engine error), never its neighbours.

The thread never touches a batch's record (the HTTP process owns ``batches/``): it tells
``BatchEvents`` when a batch's job is drained (or cancelled), failed (it cannot run here:
another model or engine settings, a task this server has no engine for, a damaged or busy
job folder; or it stopped on an error of its own), or let go unrun (the server stopped
first), and the HTTP side moves the record on: a batch never waits for a server that
might run it. ``on_turn`` runs after each turn (the engine process sends the answers
settled in it, in one message).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from vlmbatch.engine.base import Engine
from vlmbatch.engine.config import ConfigError
from vlmbatch.engine.records import Item, Score
from vlmbatch.jobs.config import RunConfig
from vlmbatch.jobs.folder import load_config
from vlmbatch.jobs.job import JobRun
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.questions import ManifestError, Question
from vlmbatch.pipeline.records import request_of
from vlmbatch.serving.config import ServingConfig, absolute
from vlmbatch.serving.errors import APIError, queue_full, shutting_down
from vlmbatch.serving.messages import Counters

log = logging.getLogger("vlmbatch.server")
# how often the engine thread looks again while requests are on their way
POLL_S = 0.002


class BatchEvents(Protocol):
    """What the engine thread tells the owner of the batch records (``BookEvents`` in the
    HTTP process; the channel in an engine process)."""

    def drained(self, batch_id: str, cancelled: bool) -> None:
        """The batch's job has nothing pending left, or was cancelled between groups."""

    def failed(self, batch_id: str, message: str) -> None:
        """The batch cannot run here, or its job stopped on an error of its own."""

    def released(self, batch_id: str) -> None:
        """The batch was let go unrun (the server is stopping): left as it is."""


@dataclass
class _Batch:
    batch_id: str
    run: JobRun  # its job, a group per step


# how a question's answer is handed back: (score, None) or (None, the error)
ScoreCallback = Callable[[Score | None, BaseException | None], None]


@dataclass
class ChatWork:
    question: Question
    image: Item  # a still image, or several parts (MediaItem)
    done: ScoreCallback  # called once, on the engine thread
    future: Future[Score] | None = None  # ``submit``'s (a client gone: cancelled)

    def cancelled(self) -> bool:
        return self.future is not None and self.future.cancelled()


def settle(f: Future, result: object = None, error: BaseException | None = None) -> None:
    """Hand a result (or an error) to a request's future; one whose client went away
    (cancelled meanwhile) is skipped."""
    try:
        if error is not None:
            f.set_exception(error)
        else:
            f.set_result(result)
    except InvalidStateError:
        pass


def mismatch(run: RunConfig, cfg: ServingConfig) -> str | None:
    """Why a batch's job cannot run on this server's engines (None: it can)."""
    want = cfg.model_of(run.task)
    if want is None:
        return (f"its job has task {run.task!r}, which this server does not run (started "
                "with --no-embeddings?); start it with embeddings to finish the batch")
    # dtypes compared as resolved: a job stores what `auto` resolved to when it was submitted
    got, have = (dataclasses.replace(absolute(m), dtype=m.resolved_dtype)
                 for m in (run.model, want))
    diff = [f"model.{f.name} {getattr(got, f.name)!r} (this server: "
            f"{getattr(have, f.name)!r})" for f in dataclasses.fields(got)
            if getattr(got, f.name) != getattr(have, f.name)]
    diff += [f"engine.{f.name} {getattr(run.engine, f.name)!r} (this server: "
             f"{getattr(cfg.engine, f.name)!r})" for f in dataclasses.fields(run.engine)
             if getattr(run.engine, f.name) != getattr(cfg.engine, f.name)]
    if not diff:
        return None
    return ("it was submitted with other model or engine settings than this server runs: "
            + "; ".join(diff) + "; submit it again, or start a server with its settings")


class Scheduler:
    def __init__(self, engine: Engine, cfg: ServingConfig, events: BatchEvents,
                 hooks: FaultHooks = NO_HOOKS, arriving: Callable[[], int] | None = None,
                 on_turn: Callable[[], None] | None = None,
                 embed_engine: Engine | None = None) -> None:
        self.engine, self.cfg, self.events, self.hooks = engine, cfg, events, hooks
        self.chat: queue.Queue[ChatWork] = queue.Queue(cfg.max_queue)
        # work other than chat that needs the engine thread (embeddings), with its result
        self.calls_q: queue.Queue[tuple[Callable[[], object], Future]] = queue.Queue(
            cfg.max_queue)
        self.batches: collections.deque[tuple[str, Path]] = collections.deque()  # in order
        self._owned: set[str] = set()  # queued or running here: this thread will end them
        self._cancel: set[str] = set()
        self._arriving = 0  # requests between arrival and submit (``arriving``)
        self._arriving_fn = arriving or (lambda: self._arriving)
        self.on_turn = on_turn or (lambda: None)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.interactive = self.batch_results = self.calls = 0
        # the engine of each job task: chat batches answer, embedding batches embed (none
        # without an embedding model: such a batch fails here)
        self.engines: dict[str, Engine] = {"answer": engine}
        if embed_engine is not None:
            self.engines["embed"] = embed_engine
        self.thread = threading.Thread(target=self._run, name="vlmbatch-engine", daemon=True)

    # --- called from other threads ---
    @contextmanager
    def arriving(self) -> Iterator[None]:
        """Around a request's parsing and image preparation (in this process): the engine
        thread waits for more requests only while some are on their way."""
        with self._lock:
            self._arriving += 1
        try:
            yield
        finally:
            with self._lock:
                self._arriving -= 1

    def depth(self) -> int:
        """Requests and calls queued, not yet taken."""
        return self.chat.qsize() + self.calls_q.qsize()

    def counters(self) -> Counters:
        engines = {id(e): e for e in self.engines.values()}.values()
        return Counters(self.interactive, self.batch_results, self.calls,
                        sum(e.stats.prompt_tokens for e in engines),
                        sum(e.stats.prefill_tokens for e in engines), self.depth())

    def submit(self, question: Question, image: Item) -> Future[Score]:
        """``question`` about ``image``, answered in the future."""
        f: Future[Score] = Future()
        self.ask(question, image, lambda s, e: settle(f, s, e), f)
        return f

    def ask(self, question: Question, image: Item, done: ScoreCallback,
            future: Future[Score] | None = None) -> None:
        """``question`` about ``image``, answered by calling ``done`` on the engine thread
        (the engine process hands answers on so, with no future per question)."""
        if self._stop.is_set():
            raise shutting_down()
        work = ChatWork(question, image, done, future)
        try:
            self.chat.put_nowait(work)
        except queue.Full:
            raise queue_full(self.cfg.max_queue) from None

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the engine thread, before the next chat batch; its result (or its
        exception) in the future."""
        if self._stop.is_set():
            raise shutting_down()
        f: Future = Future()
        try:
            self.calls_q.put_nowait((fn, f))
        except queue.Full:
            raise queue_full(self.cfg.max_queue) from None
        return f

    def enqueue_batch(self, batch_id: str, job: Path) -> None:
        """Run the batch's job (``job``: its folder) after those queued before it."""
        with self._lock:
            self.batches.append((batch_id, job))
            self._owned.add(batch_id)

    def cancel_batch(self, batch_id: str) -> bool:
        """Stop the batch's job between groups; False if this thread does not hold it (it
        was let go, or never queued): then the caller finalizes it."""
        with self._lock:
            self._cancel.add(batch_id)
            return batch_id in self._owned

    def owns(self, batch_id: str) -> bool:
        with self._lock:
            return batch_id in self._owned

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float) -> None:
        """Answer what is queued, finish the batch group in flight, leave the job
        resumable (``interrupted`` in its store, ``in_progress`` in its record)."""
        self._stop.set()
        self.thread.join(timeout)

    # --- the engine thread ---
    def _release(self, batch_id: str) -> None:
        with self._lock:
            self._owned.discard(batch_id)

    def _run(self) -> None:
        job: _Batch | None = None
        try:
            while not (self._stop.is_set() and self.chat.empty() and self.calls_q.empty()):
                self._run_calls()
                if job is None and not self._stop.is_set():
                    job = self._next_job()
                works = self._take(block=job is None and self.calls_q.empty())
                if works:
                    self._guarded(works)
                elif job is not None and not self._stop.is_set():
                    job = self._step(job)
                self.on_turn()
        except BaseException:
            log.exception("the engine thread stopped")
            raise
        finally:
            if job is not None:
                job.run.close()  # its run ends "interrupted": resumable
            self.on_turn()

    def _run_calls(self) -> None:
        while True:
            try:
                fn, f = self.calls_q.get_nowait()
            except queue.Empty:
                return
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn())
            except BaseException as e:  # noqa: BLE001  (handed to the request that asked)
                f.set_exception(e)

    def _take(self, block: bool) -> list[ChatWork]:
        """Up to ``max_batch_requests`` queued questions: the first (waiting up to 50 ms
        when there is nothing else to do), then those queued meanwhile and, while others are
        on their way (being parsed in the HTTP process: ``arriving``), those that come
        within ``batch_wait_s``: one engine call of many questions costs less per question
        than several small ones.

        Never for the clients the last call answered, though they may come back: waiting
        for them put every closed-loop client in one cohort, and the HTTP process (sending
        that cohort's answers, parsing its next questions) and this thread took turns
        instead of working at once. Taking what has come lets the clients fall into cohorts
        that overlap: one answered here while the HTTP process handles another
        (``bench/serve.py`` at 32 clients, before and after: docs/figures.md#serve-clients)."""
        try:
            first = self.chat.get(timeout=0.05) if block else self.chat.get_nowait()
        except queue.Empty:
            return []
        works = [first]
        deadline = time.monotonic() + self.cfg.batch_wait_s
        while len(works) < self.cfg.max_batch_requests:
            now = time.monotonic()
            coming = now < deadline and self._arriving_fn() > 0
            try:
                works.append(self.chat.get(timeout=min(deadline - now, POLL_S)) if coming
                             else self.chat.get_nowait())
            except queue.Empty:
                if not coming:
                    break
        return [w for w in works if not w.cancelled()]  # a client that went away

    def _guarded(self, works: list[ChatWork]) -> None:
        """``_answer``, and whatever goes wrong is these requests' 500, never a hang."""
        try:
            self._answer(works)
        except Exception as e:  # noqa: BLE001  (the thread must go on serving)
            log.exception("answering %d requests failed", len(works))
            for w in works:
                w.done(None, APIError(500, f"internal error: {type(e).__name__}",
                                      code="internal_error"))

    def _answer(self, works: list[ChatWork]) -> None:
        images: list[Item] = []
        index: dict[str, int] = {}
        requests = []
        for w in works:
            key = w.image.cache_key
            if key not in index:
                index[key] = len(images)
                images.append(w.image)
            requests.append(request_of(index[key], w.question))
        self.calls += 1
        try:
            self.hooks.score(self.calls)
            scores = self.engine.score(images, requests)
        except Exception as e:  # noqa: BLE001  (isolate the question that broke the engine)
            if len(works) > 1:
                for w in works:
                    self._answer([w])
                return
            log.exception("engine failed on a chat request")
            works[0].done(None, APIError(500, f"engine failed: {type(e).__name__}: {e}",
                                         code="engine_error"))
            return
        self.interactive += len(works)
        for w, s in zip(works, scores):
            w.done(s, None)

    def _next_job(self) -> _Batch | None:
        while True:
            with self._lock:
                if not self.batches:
                    return None
                batch_id, job = self.batches.popleft()
            if batch_id in self._cancel:
                self._release(batch_id)
                self.events.drained(batch_id, True)
                continue
            try:
                return _Batch(batch_id, self._open(job))
            except (ManifestError, ConfigError) as e:  # JobBusy too
                log.warning("batch %s cannot run: %s", batch_id, e)
                self._release(batch_id)
                self.events.failed(batch_id, f"the batch cannot run on this server: {e}")

    def _open(self, job: Path) -> JobRun:
        """The batch's job, run with this server's engine for its task (ConfigError: it was
        submitted with other model or engine settings, or embeds and this server has no
        embedding model). Pending items are prepared ahead in decoder processes under the
        job's --decode-timeout, as `vlmbatch run JOB`: a hung or crashing image fails that
        item, never the engine thread (or the server)."""
        run = load_config(job)
        why = mismatch(run, self.cfg)
        if why is not None:
            raise ConfigError(why)
        # the job's pixel limit and deadline, this server's decoder processes
        opts = dataclasses.replace(run.prepare, preprocess_threads=(
            self.cfg.preprocess_threads)).options(self.cfg.model.device)
        return JobRun(job, run, self.engines[run.task], opts, self.hooks)

    def _step(self, b: _Batch) -> _Batch | None:
        """One group of the batch's job; None once the job is drained, cancelled or
        broken."""
        cancelled = b.batch_id in self._cancel
        if cancelled:
            b.run.cancel()  # its run ends "cancelled" at this step, before any more work
        try:
            done = b.run.step()
        except Exception as e:  # noqa: BLE001  (e.g. a full disk: this batch fails, not all)
            log.exception("batch %s stopped", b.batch_id)
            b.run.close()
            self._release(b.batch_id)
            self.events.failed(b.batch_id, f"the job stopped: {type(e).__name__}: {e}")
            return None
        if done is not None:
            self.batch_results += sum(len(r) for r in done[1])
            self.hooks.group_done()
            return b
        b.run.close()
        self._release(b.batch_id)
        self.events.drained(b.batch_id, cancelled)
        return None
