"""The engine process (``python -P -m vlmbatch.serving.engine_process ...``): the server's
model and its engine thread (``scheduler.py``), apart from the HTTP process and its GIL, as
vLLM v1 keeps its EngineCore apart from its API server. It imports no web framework
(``tests/test_layers.py`` checks the sources; ``tests/server/test_engines.py`` the
running process).

Started by the HTTP process (``processes.EngineProcess``, by exec, never fork: the parent
has threads, an event loop, decoder pools), it reads ``Start`` (``messages.py``), builds
the engines of the server's config (chat; embeddings, the same engine when the checkpoint
is the same), answers ``Ready`` and then serves the channel (``channel.py``) until told to
``Stop`` or until the HTTP process goes away (its pipe closes; ``PR_SET_PDEATHSIG`` kills
it when that process is killed): ``Ask`` and ``Embed`` queue work for the engine thread,
whose answers go back in one ``Settled`` per turn; ``RunBatch``/``CancelBatch`` run and
stop batch jobs, whose ends go back as ``BatchDrained``/``BatchFailed``/``BatchReleased``.

SIGINT and SIGTERM are ignored here: the HTTP process decides when the engine stops (a
Ctrl-C reaches the whole process group).
"""

from __future__ import annotations

import functools
import logging
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future

from vlmbatch.engine.base import Engine
from vlmbatch.engine.build import build_engine
from vlmbatch.engine.config import ConfigError
from vlmbatch.preprocessing.decoder_process import die_with_parent
from vlmbatch.serving.channel import Arena, Arriving, Link
from vlmbatch.serving.config import ServingConfig
from vlmbatch.serving.embed import embed_dims, embed_prepared
from vlmbatch.serving.errors import APIError
from vlmbatch.serving.messages import (
    Ask,
    BatchDrained,
    BatchFailed,
    BatchReleased,
    CancelBatch,
    Counters,
    Embed,
    EngineInfo,
    Ready,
    Reply,
    RunBatch,
    Settled,
    Start,
    StartFailed,
    Stop,
    failure_of,
)
from vlmbatch.serving.scheduler import Scheduler

log = logging.getLogger("vlmbatch.server")


def build_engines(cfg: ServingConfig) -> tuple[Engine, Engine | None]:
    """The chat engine and the embedding engine (the chat one when the checkpoint is the
    same; None without embeddings)."""
    engine = build_engine(cfg.model, cfg.engine, cfg.threads)
    if cfg.embed_model is None:
        return engine, None
    if cfg.shared_embed_engine:
        return engine, engine
    return engine, build_engine(cfg.embed_model, cfg.engine, cfg.threads)


def engine_info(engine: Engine, embed_engine: Engine | None) -> EngineInfo:
    return EngineInfo(engine.image_plan, embed_engine.image_plan if embed_engine else None,
                      embed_dims(embed_engine) if embed_engine else None, engine.video_plan)


class Outbox:
    """Answers settled on the engine thread, sent in one ``Settled`` per turn with the
    engine thread's counters."""

    def __init__(self, link: Link, stats: Callable[[], Counters]) -> None:
        self.link, self.stats = link, stats
        self.answers: list[Reply] = []
        self.lock = threading.Lock()
        self.sent_stats: Counters | None = None

    def settled(self, rid: int, f: Future) -> None:
        e = f.exception()
        self.answered(rid, None if e is not None else f.result(), e)

    def answered(self, rid: int, result: object, error: BaseException | None) -> None:
        a = Reply(rid, result) if error is None else Reply(rid, failure=failure_of(error))
        with self.lock:
            self.answers.append(a)

    def flush(self) -> None:
        with self.lock:
            answers, self.answers = self.answers, []
        stats = self.stats()
        if answers or stats != self.sent_stats:
            self.sent_stats = stats
            self.link.send(Settled(tuple(answers), stats))


class ChannelEvents:
    """``scheduler.BatchEvents`` over the channel (the HTTP process owns the records)."""

    def __init__(self, link: Link, outbox: Outbox) -> None:
        self.link, self.outbox = link, outbox

    def _send(self, event: BatchDrained | BatchFailed | BatchReleased) -> None:
        self.outbox.flush()  # the counters of the batch's last group first
        self.link.send(event)

    def drained(self, batch_id: str, cancelled: bool) -> None:
        self._send(BatchDrained(batch_id, cancelled))

    def failed(self, batch_id: str, message: str) -> None:
        self._send(BatchFailed(batch_id, message))

    def released(self, batch_id: str) -> None:
        self._send(BatchReleased(batch_id))


class EngineServer:
    """The engine side of one channel: the scheduler and the reader of requests."""

    def __init__(self, start: Start, link: Link, arena: Arena, arriving: Arriving) -> None:
        self.cfg, self.link, self.arena = start.config, link, arena
        self.engine, self.embed_engine = build_engines(self.cfg)
        self.outbox = Outbox(link, lambda: self.scheduler.counters())
        self.scheduler = Scheduler(self.engine, self.cfg, ChannelEvents(link, self.outbox),
                                   start.hooks, arriving, on_turn=self.outbox.flush,
                                   embed_engine=self.embed_engine)

    def serve(self) -> None:
        self.scheduler.start()
        while True:
            try:
                msg = self.link.recv()
            except (EOFError, OSError):  # the HTTP process is gone: stop, jobs resumable
                self.scheduler.stop(self.cfg.shutdown_timeout_s)
                return
            if isinstance(msg, Stop):
                self.scheduler.stop(msg.timeout_s)
                self.outbox.flush()
                return
            self.handle(msg)

    def handle(self, msg: object) -> None:
        if isinstance(msg, RunBatch):
            self.scheduler.enqueue_batch(msg.batch_id, msg.job)
        elif isinstance(msg, CancelBatch):
            self.scheduler.cancel_batch(msg.batch_id)
        elif isinstance(msg, (Ask, Embed)):
            try:
                if isinstance(msg, Ask):
                    self.scheduler.ask(msg.question, self.arena.view(msg.image),
                                       functools.partial(self.outbox.answered, msg.rid))
                else:
                    self._embed(msg).add_done_callback(
                        functools.partial(self.outbox.settled, msg.rid))
            except APIError as e:  # the queue is full, or the engine is stopping
                self.link.send(Settled((Reply(msg.rid, failure=failure_of(e)),),
                                       self.scheduler.counters()))
        else:
            log.error("engine process: unknown message %s", type(msg).__name__)

    def _embed(self, msg: Embed) -> Future:
        p = msg.prepared
        p.images = [None if x is None else self.arena.view(x) for x in msg.images]
        engine = self.embed_engine
        if engine is None:
            raise APIError(501, "embeddings are not available on this server",
                           code="embeddings_unavailable")
        return self.scheduler.call(lambda: embed_prepared(engine, msg.dims, p))


def main(argv: list[str]) -> None:
    rfd, wfd, arena_fd, arena_bytes, arriving_fd, parent = (int(x) for x in argv)
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    link = Link(rfd, wfd)
    start = link.recv()
    assert isinstance(start, Start), start
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"vlmbatch engine {start.index}: %(message)s")
    try:
        server = EngineServer(start, link, Arena(arena_bytes, arena_fd), Arriving(arriving_fd))
    except Exception as e:  # noqa: BLE001  (the HTTP process reports it and exits)
        link.send(StartFailed(e if _picklable(e) else ConfigError(f"{type(e).__name__}: {e}")))
        return
    link.send(Ready(engine_info(server.engine, server.embed_engine)))
    server.serve()


def _picklable(e: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":
    main(sys.argv[1:])
