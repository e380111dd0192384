"""``ServerState``: what one running server holds, made once at start and passed to the
routes (no globals): the config, the engine thread, the image cache, the files and batches
on disk, the batch worker and the embedder (None with ``--no-embeddings``).

``start`` also resumes what a previous server on the same data folder left unfinished
(killed, or stopped with SIGTERM): batches still validating are validated again, those in
progress go back to the engine thread's queue (their jobs continue with the items still
pending), and those finalizing or cancelling are finalized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vlmbatch.app.server.batch_worker import BatchWorker
from vlmbatch.app.server.batches import BatchBook
from vlmbatch.app.server.config import ServerConfig
from vlmbatch.app.server.embedder import EngineEmbedder
from vlmbatch.app.server.embeddings import Embedder
from vlmbatch.app.server.files import FileStore
from vlmbatch.app.server.images import ImageCache
from vlmbatch.app.server.scheduler import Scheduler
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

    @classmethod
    def build(cls, cfg: ServerConfig, engine: Engine, hooks: FaultHooks = NO_HOOKS,
              embedder: Embedder | None = None) -> ServerState:
        files = FileStore(cfg.files_dir)
        book = BatchBook(cfg.batches_dir)
        worker = BatchWorker(cfg, book, files)
        scheduler = Scheduler(engine, cfg, book, worker.finalize, hooks)
        images = ImageCache(engine.image_plan, cfg.max_pixels, cfg.allowed_local_media_path,
                            cfg.image_cache_bytes)
        words = (cfg.engine.yes_words[0], cfg.engine.no_words[0])
        return cls(cfg, engine, scheduler, images, files, book, worker, embedder, words)

    def serve_embeddings(self, engine: Engine) -> None:
        """Answer ``/v1/embeddings`` and run embedding batches on ``engine`` (the chat
        engine itself when the checkpoint is the same), on the engine thread."""
        self.embedder = EngineEmbedder(engine, self.scheduler, self.cfg.max_pixels)
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
