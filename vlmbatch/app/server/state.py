"""``ServerState``: what one running server holds, made once at start and passed to the
routes (no globals): the config, the engine thread, the image cache and the decoder
processes of interactive requests, the files and batches on disk, the batch worker and the
embedder (None with ``--no-embeddings``).

``start`` also resumes what a previous server on the same data folder left unfinished
(killed, or stopped with SIGTERM): batches still validating are validated again, those in
progress go back to the engine thread's queue (their jobs continue with the items still
pending), and those finalizing or cancelling are finalized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vlmbatch.app.server.batch_worker import BatchWorker
from vlmbatch.app.server.batches import BatchBook
from vlmbatch.app.server.config import ServerConfig
from vlmbatch.app.server.embedder import EngineEmbedder
from vlmbatch.app.server.embeddings import Embedder
from vlmbatch.app.server.files import FileStore
from vlmbatch.app.server.images import ImageCache
from vlmbatch.app.server.scheduler import Scheduler
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
