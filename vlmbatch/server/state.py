"""``ServerState``: what one running server holds, made once at start and handed, piece by
piece, to the routes (no globals): the config, the engines (``serving/engines.py``:
engine processes, or the engine thread here with ``--engines 0``), the chat endpoint's
service (``chat.Chat``: the media cache, the label-set check), the decoder processes of
interactive requests, the files and batches on disk, the batch worker, the metrics, the
embedding backend (None with ``--no-embeddings``) and, with ``--executor ray``, the Ray
runner of batches (``ray_batches.py``).

``start`` also resumes what a previous server on the same data folder left unfinished
(killed, or stopped with SIGTERM): batches still validating are validated again, those in
progress go back to the engines' queue (or Ray's) (their jobs continue with the items still
pending), and those finalizing or cancelling are finalized.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.preparers import PrepareWorkers, preparer
from vlmbatch.server.batch_worker import BatchWorker, BookEvents
from vlmbatch.server.batches import ACTIVE, BatchBook
from vlmbatch.server.chat import Chat
from vlmbatch.server.config import ServerConfig
from vlmbatch.server.files import FileStore
from vlmbatch.server.media_cache import MediaCache
from vlmbatch.server.metrics import Metrics
from vlmbatch.server.ray_batches import RayBatches
from vlmbatch.serving.embed import EmbedBackend, EngineEmbedBackend
from vlmbatch.serving.engines import Engines

log = logging.getLogger("vlmbatch.server")


@dataclass
class ServerState:
    cfg: ServerConfig
    engines: Engines
    chat: Chat
    files: FileStore
    book: BatchBook
    worker: BatchWorker
    metrics: Metrics
    embeddings: EmbedBackend | None = None
    hooks: FaultHooks = NO_HOOKS
    # interactive requests' decoder processes (chat images; embedding inputs' images)
    decoders: list[PrepareWorkers] = field(default_factory=list)
    ray_batches: RayBatches | None = None  # with --executor ray

    @classmethod
    def build(cls, cfg: ServerConfig, engines: Engines, hooks: FaultHooks = NO_HOOKS,
              embeddings: EmbedBackend | None = None) -> ServerState:
        files = FileStore(cfg.files_dir)
        book = BatchBook(cfg.batches_dir)
        files.in_use = lambda file_id: any(  # a batch in progress reads it: kept
            r.input_file_id == file_id and r.status in ACTIVE for r in book.all())
        worker = BatchWorker(cfg, book, files)
        engines.bind(BookEvents(book, worker.finalize))
        decoders = preparer(engines.image_plan, cfg.prepare_options, hooks)
        images = MediaCache(engines.image_plan, cfg.prepare_options,
                            cfg.allowed_local_media_path, cfg.media_cache_bytes, decoders,
                            cfg.remote_media)
        return cls(cfg, engines, Chat(cfg, engines, images), files, book, worker,
                   Metrics(engines, book, images.stats), embeddings, hooks,
                   [decoders] if decoders is not None else [])

    @property
    def images(self) -> MediaCache:
        return self.chat.images

    def serve_embeddings(self) -> None:
        """Answer ``/v1/embeddings`` on the engines' embedding engine (the chat engine
        itself when the checkpoint is the same), its images decoded by the chat images'
        decoder processes when the plan is the same."""
        plan, dims = self.engines.embed_plan, self.engines.embed_dims
        assert plan is not None and dims is not None
        decoders = self.images.workers if plan == self.engines.image_plan \
            else preparer(plan, self.cfg.prepare_options, self.hooks)
        if decoders is not None and decoders is not self.images.workers:
            self.decoders.append(decoders)
        self.embeddings = EngineEmbedBackend(self.engines.embed, dims, plan,
                                             self.cfg.prepare_options, decoders)

    def serve_batches_on_ray(self) -> None:
        """``--executor ray``: batches run on Ray, not on the engines."""
        self.ray_batches = RayBatches(self.cfg, self.book, BookEvents(
            self.book, self.worker.finalize), self.hooks)
        self.metrics.collector.ray = self.ray_batches

    def enqueue_batch(self, batch_id: str) -> None:
        """A validated batch to where batches run (Ray's runner, or the engines)."""
        if self.ray_batches is not None:
            self.ray_batches.enqueue_batch(batch_id)
        else:
            self.engines.enqueue_batch(batch_id, self.book.job_of(batch_id))

    def start(self) -> None:
        """Resume unfinished batches (oldest first), then start the threads."""
        actions: dict[str, Callable[[str], None]] = {
            "validating": self.worker.validate, "in_progress": self.enqueue_batch,
            "finalizing": self.worker.finalize, "cancelling": self.worker.finalize}
        for rec in reversed(self.book.all()):
            if rec.status in actions:
                actions[rec.status](rec.id)
                log.info("batch %s: %s, resumed", rec.id, rec.status)
        self.worker.start(self.enqueue_batch)
        self.engines.start()

    def cancel_batch(self, batch_id: str) -> bool:
        """Stop a batch between groups; False when nothing holds it (then finalize it)."""
        if self.ray_batches is not None:
            return self.ray_batches.cancel_batch(batch_id)
        return self.engines.cancel_batch(batch_id)

    def stop(self) -> None:
        """After in-flight requests (uvicorn waits for them): the engine threads answer what
        is queued and stop after their group; jobs are left resumable."""
        if self.ray_batches is not None:
            self.ray_batches.stop(self.cfg.shutdown_timeout_s)
        self.engines.stop(self.cfg.shutdown_timeout_s)
        self.worker.stop(self.cfg.shutdown_timeout_s)
        for d in self.decoders:
            d.stop()
        self.images.stop()
