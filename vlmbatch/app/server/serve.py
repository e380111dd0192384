"""``serve``: what one running server holds, and running it.

``ServerState``: made once at start and passed to the routes (no globals): the config, the
engine thread, the image cache and the decoder processes of interactive requests, the files
and batches on disk, the batch worker and the embedder (None with ``--no-embeddings``).
``start`` also resumes what a previous server on the same data folder left unfinished
(killed, or stopped with SIGTERM): batches still validating are validated again, those in
progress go back to the engine thread's queue (their jobs continue with the items still
pending), and those finalizing or cancelling are finalized.

``serve``: load the engine, take the data folder, run the app under uvicorn. One server per
data folder: ``DATA/server.lock`` is held (flock) while it runs, so a second server on the
same batches is refused instead of running their jobs twice. SIGTERM and Ctrl-C are
uvicorn's graceful shutdown: it stops accepting, waits up to ``shutdown_timeout_s`` for
in-flight requests, then the app's lifespan stops the engine thread after its current group,
leaving batch jobs resumable by the next start.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from vlmbatch.app.server.app import create_app
from vlmbatch.app.server.batch_worker import BatchWorker
from vlmbatch.app.server.batches import BatchBook, FileStore
from vlmbatch.app.server.config import ServerConfig
from vlmbatch.app.server.embeddings import Embedder, EngineEmbedder
from vlmbatch.app.server.media import ImageCache
from vlmbatch.app.server.scheduler import Scheduler
from vlmbatch.pipeline.build import build_engine
from vlmbatch.pipeline.config import ConfigError
from vlmbatch.pipeline.drive import Preparer, preparer
from vlmbatch.pipeline.engine import Engine
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks

log = logging.getLogger("vlmbatch.app.server")


@dataclass
class ServerState:
    cfg: ServerConfig
    engine: Engine
    scheduler: Scheduler
    images: ImageCache
    files: FileStore
    book: BatchBook
    worker: BatchWorker
    embedder: Embedder | None = None
    answer_words: tuple[str, str] = ("yes", "no")  # how logprobs name the two classes
    hooks: FaultHooks = NO_HOOKS
    # interactive requests' decoder processes (chat images; embedding inputs' images)
    decoders: list[Preparer] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: ServerConfig, engine: Engine, hooks: FaultHooks = NO_HOOKS,
              embedder: Embedder | None = None) -> ServerState:
        files = FileStore(cfg.files_dir)
        book = BatchBook(cfg.batches_dir)
        worker = BatchWorker(cfg, book, files)
        scheduler = Scheduler(engine, cfg, book, worker.finalize, hooks)
        decoders = preparer(engine.image_plan, cfg.prepare_options, hooks)
        images = ImageCache(engine.image_plan, cfg.prepare_options, cfg.allowed_local_media_path,
                            cfg.image_cache_bytes, decoders)
        words = (cfg.engine.yes_words[0], cfg.engine.no_words[0])
        return cls(cfg, engine, scheduler, images, files, book, worker, embedder, words,
                   hooks, [decoders] if decoders is not None else [])

    def serve_embeddings(self, engine: Engine) -> None:
        """Answer ``/v1/embeddings`` and run embedding batches on ``engine`` (the chat
        engine itself when the checkpoint is the same), on the engine thread; its images
        decoded by the chat images' decoder processes when the plan is the same."""
        decoders = self.images.workers if engine.image_plan == self.engine.image_plan \
            else preparer(engine.image_plan, self.cfg.prepare_options, self.hooks)
        if decoders is not None and decoders is not self.images.workers:
            self.decoders.append(decoders)
        self.embedder = EngineEmbedder(engine, self.scheduler, self.cfg.prepare_options,
                                       decoders)
        self.scheduler.engines["embed"] = engine

    def start(self) -> None:
        """Resume unfinished batches (oldest first), then start both threads."""
        for rec in reversed(self.book.all()):
            if rec.status == "validating":
                self.worker.validate(rec.id)
            elif rec.status == "in_progress":
                self.scheduler.enqueue_batch(rec.id)
            elif rec.status in ("finalizing", "cancelling"):
                self.worker.finalize(rec.id)
            else:
                continue
            log.info("batch %s: %s, resumed", rec.id, rec.status)
        self.worker.start(self.scheduler.enqueue_batch)
        self.scheduler.start()

    def stop(self) -> None:
        """After in-flight requests (uvicorn waits for them): the engine thread answers what
        is queued and stops after its group; jobs are left resumable."""
        self.scheduler.stop(self.cfg.shutdown_timeout_s)
        self.worker.stop(self.cfg.shutdown_timeout_s)
        for d in self.decoders:
            d.stop()


LOCK_FILE = "server.lock"


def _take_data_dir(data_dir: Path) -> int:
    """Hold ``DATA/server.lock`` for this process (the kernel drops it when it dies)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
        os.close(fd)
        raise ConfigError(f"{data_dir} is in use by another vlmbatch server (pid "
                          f"{holder or '?'}); give another --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _embed_engine(cfg: ServerConfig, chat: Engine) -> Engine:
    """The engine of ``/v1/embeddings``: the chat engine when the checkpoint is the same,
    else one of its own (same device and engine options)."""
    model = cfg.embed_model_dir
    if cfg.model.path is not None and Path(cfg.model.path).resolve() == model.resolve():
        return chat
    return build_engine(cfg.embed_model_config, cfg.engine, cfg.threads)


def serve(cfg: ServerConfig, hooks: FaultHooks = NO_HOOKS) -> None:
    """Run the server until SIGTERM or Ctrl-C."""
    fd = _take_data_dir(Path(cfg.data_dir))
    try:
        engine = build_engine(cfg.model, cfg.engine, cfg.threads)
        state = ServerState.build(cfg, engine, hooks)
        if cfg.embeddings:
            state.serve_embeddings(_embed_engine(cfg, engine))
        app = create_app(state)
        logging.basicConfig(level=logging.INFO, format="vlmbatch serve: %(message)s",
                            stream=sys.stderr)
        print(f"vlmbatch serve: model {cfg.served_model_name!r} on http://{cfg.host}:"
              f"{cfg.port}/v1, data in {cfg.data_dir}"
              + (", API key required" if cfg.api_key else ""), file=sys.stderr, flush=True)
        uvicorn.Server(uvicorn.Config(
            app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
            timeout_graceful_shutdown=cfg.shutdown_timeout_s)).run()
    finally:
        os.close(fd)
