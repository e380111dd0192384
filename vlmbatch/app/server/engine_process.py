"""The engine process (``python -m vlmbatch.app.server.engine_process ...``): the server's
model and its engine thread (``scheduler.py``), apart from the HTTP process and its GIL, as
vLLM v1 keeps its EngineCore apart from its API server.

Started by the HTTP process (``engines.EngineProcess``, by exec, never fork: the parent has
threads, an event loop, decoder pools), it builds the engines of the server's config (chat;
embeddings, the same engine when the checkpoint is the same), says ``("ready", info)`` and
then serves the channel (``channel.py``) until told to stop or until the HTTP process goes
away (its pipe closes; ``PR_SET_PDEATHSIG`` kills it when that process is killed):

    from the HTTP process                      what this process does
    ("chat", rid, question, packed)            queue the Question, its image read in place
    ("embed", rid, dims, prepared, packed)     queue an embedding call of a prepared group
    ("batch", batch_id, job)                   run the batch's job after those queued
    ("cancel", batch_id)                       stop it between groups
    ("stop", timeout_s)                        answer what is queued, end the job's group,
                                               leave the job resumable, exit 0

    to it: ("ready", info) | ("start_failed", exc) once, then ("done", [(rid, ok, value)],
    stats) after each turn that settled a request, ("event", kind, batch_id, arg) for a
    batch drained / failed / released, and stats in each.

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
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from vlmbatch.app.server.channel import Arena, Arriving, Link
from vlmbatch.app.server.config import ServerConfig
from vlmbatch.app.server.embeddings import EmbedRefused, embed_dims, embed_prepared
from vlmbatch.app.server.errors import APIError
from vlmbatch.app.server.scheduler import Scheduler
from vlmbatch.engine.base import Engine
from vlmbatch.engine.build import build_engine
from vlmbatch.engine.config import ConfigError
from vlmbatch.pipeline.hooks import FaultHooks
from vlmbatch.pipeline.records import ImageItem, Question
from vlmbatch.preprocessing.decoder_process import die_with_parent

log = logging.getLogger("vlmbatch.app.server")


def failure(e: BaseException) -> tuple:
    """An exception as a request's answer on the wire (``engines.raise_wire``)."""
    if isinstance(e, APIError):
        return ("api", e.wire())
    if isinstance(e, EmbedRefused):
        return ("refused", str(e), e.index, e.code)
    return ("api", APIError(500, f"internal error: {type(e).__name__}: {e}",
                            code="internal_error").wire())


def build_engines(cfg: ServerConfig) -> tuple[Engine, Engine | None]:
    """The chat engine and the embedding engine (the chat one when the checkpoint is the
    same; None with --no-embeddings)."""
    engine = build_engine(cfg.model, cfg.engine, cfg.threads)
    if not cfg.embeddings:
        return engine, None
    if cfg.model.path is not None and \
            Path(cfg.model.path).resolve() == cfg.embed_model_dir.resolve():
        return engine, engine
    return engine, build_engine(cfg.embed_model_config, cfg.engine, cfg.threads)


class Outbox:
    """Answers settled on the engine thread, sent in one message per turn with the
    engine's counters."""

    def __init__(self, link: Link, stats: Any) -> None:
        self.link, self.stats = link, stats
        self.items: list[tuple[int, bool, Any]] = []
        self.lock = threading.Lock()
        self.sent_stats: dict | None = None

    def settled(self, rid: int, f: Future) -> None:
        e = f.exception()
        with self.lock:
            self.items.append((rid, True, f.result()) if e is None else (rid, False, failure(e)))

    def flush(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        stats = self.stats()
        if items or stats != self.sent_stats:
            self.sent_stats = stats
            self.link.send(("done", items, stats))


class ChannelEvents:
    """``scheduler.BatchEvents`` over the channel (the HTTP process owns the records)."""

    def __init__(self, link: Link, outbox: Outbox) -> None:
        self.link, self.outbox = link, outbox

    def _send(self, kind: str, batch_id: str, arg: object) -> None:
        self.outbox.flush()  # the counters of the batch's last group first
        self.link.send(("event", kind, batch_id, arg))

    def drained(self, batch_id: str, cancelled: bool) -> None:
        self._send("drained", batch_id, cancelled)

    def failed(self, batch_id: str, message: str) -> None:
        self._send("failed", batch_id, message)

    def released(self, batch_id: str) -> None:
        self._send("released", batch_id, None)


class EngineServer:
    """The engine side of one channel: the scheduler and the reader of requests."""

    def __init__(self, cfg: ServerConfig, hooks: FaultHooks, link: Link, arena: Arena,
                 arriving: Arriving) -> None:
        self.cfg, self.link, self.arena = cfg, link, arena
        self.engine, self.embed_engine = build_engines(cfg)
        self.outbox = Outbox(link, self.stats)
        self.scheduler = Scheduler(self.engine, cfg, ChannelEvents(link, self.outbox), hooks,
                                   arriving, on_turn=self.outbox.flush)
        if self.embed_engine is not None:
            self.scheduler.engines["embed"] = self.embed_engine

    def info(self) -> dict:
        return {"image_plan": self.engine.image_plan,
                "embed_dims": embed_dims(self.embed_engine) if self.embed_engine else None,
                "embed_plan": self.embed_engine.image_plan if self.embed_engine else None}

    def stats(self) -> dict:
        c = self.scheduler.counters
        engines = {id(e): e for e in self.scheduler.engines.values()}.values()
        return {"interactive": c.interactive, "batch": c.batch, "calls": c.calls,
                "prompt_tokens": sum(e.stats.prompt_tokens for e in engines),
                "prefill_tokens": sum(e.stats.prefill_tokens for e in engines),
                "depth": self.scheduler.depth()}

    def serve(self) -> None:
        self.scheduler.start()
        while True:
            try:
                msg = self.link.recv()
            except (EOFError, OSError):  # the HTTP process is gone: stop, jobs resumable
                self.scheduler.stop(self.cfg.shutdown_timeout_s)
                return
            if msg[0] == "stop":
                self.scheduler.stop(msg[1])
                self.outbox.flush()
                return
            self.handle(msg)

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "batch":
            self.scheduler.enqueue_batch(msg[1], Path(msg[2]))
        elif kind == "cancel":
            self.scheduler.cancel_batch(msg[1])
        elif kind in ("chat", "embed"):
            rid = msg[1]
            try:
                f = self._chat(*msg[2:]) if kind == "chat" else self._embed(*msg[2:])
            except APIError as e:  # the queue is full, or the engine is stopping
                self.link.send(("done", [(rid, False, failure(e))], self.stats()))
                return
            f.add_done_callback(functools.partial(self.outbox.settled, rid))
        else:
            log.error("engine process: unknown message %r", kind)

    def _chat(self, question: Question, packed: tuple) -> Future:
        """The chat question (its label set, system turn and instruction with it)."""
        item = ImageItem("request", "", (question,), Path("/"))
        return self.scheduler.submit(item, self.arena.view(packed))

    def _embed(self, dims: int | None, prepared: Any, packed: list) -> Future:
        prepared.images = [None if p is None else self.arena.view(p) for p in packed]
        engine = self.embed_engine
        if engine is None:
            raise APIError(501, "embeddings are not available on this server",
                           code="embeddings_unavailable")
        return self.scheduler.call(lambda: embed_prepared(engine, dims, prepared))


def main(argv: list[str]) -> None:
    rfd, wfd, arena_fd, arena_bytes, arriving_fd, parent = (int(x) for x in argv)
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    link = Link(rfd, wfd)
    cfg, hooks, index = link.recv()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"vlmbatch engine {index}: %(message)s")
    try:
        server = EngineServer(cfg, hooks, link, Arena(arena_bytes, arena_fd),
                              Arriving(arriving_fd))
    except Exception as e:  # noqa: BLE001  (the HTTP process reports it and exits)
        link.send(("start_failed", e if _picklable(e) else ConfigError(f"{type(e).__name__}: "
                                                                       f"{e}")))
        return
    link.send(("ready", server.info()))
    server.serve()


def _picklable(e: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":
    main(sys.argv[1:])
