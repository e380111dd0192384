"""``serve``: what one running server holds, and running it.

``ServerState``: made once at start and passed to the routes (no globals): the config, the
engines (``engines.py``: engine processes, or the engine thread here with ``--engines 0``),
the image cache and the decoder processes of interactive requests, the files and batches on
disk, the batch worker, the metrics, the embedder (None with ``--no-embeddings``) and, with
``--executor ray``, the Ray runner of batches (``ray_batches.py``).
``start`` also resumes what a previous server on the same data folder left unfinished
(killed, or stopped with SIGTERM): batches still validating are validated again, those in
progress go back to the engines' queue (or Ray's) (their jobs continue with the items still
pending), and those finalizing or cancelling are finalized.

``serve``: take the data folder, start the engines (each loads the model), run the app under
uvicorn. One server per
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from vlmbatch.app.server.app import create_app
from vlmbatch.app.server.batch_worker import BatchWorker
from vlmbatch.app.server.batches import ACTIVE, BatchBook
from vlmbatch.app.server.config import ServerConfig
from vlmbatch.app.server.embeddings import Embedder, EngineEmbedder
from vlmbatch.app.server.engine_process import build_engines
from vlmbatch.app.server.engines import BookEvents, EngineProcesses, Engines, LocalEngines
from vlmbatch.app.server.files import FileStore
from vlmbatch.app.server.media import ImageCache
from vlmbatch.app.server.metrics import Metrics
from vlmbatch.app.server.ray_batches import RayBatches
from vlmbatch.engine.config import ConfigError
from vlmbatch.engine.loading import label_set_checker, read_spec
from vlmbatch.pipeline.drive import Preparer, preparer
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks

log = logging.getLogger("vlmbatch.app.server")


@dataclass
class ServerState:
    cfg: ServerConfig
    engines: Engines
    images: ImageCache
    files: FileStore
    book: BatchBook
    worker: BatchWorker
    metrics: Metrics
    embedder: Embedder | None = None
    answer_words: tuple[str, str] = ("yes", "no")  # how logprobs name the two classes
    hooks: FaultHooks = NO_HOOKS
    # interactive requests' decoder processes (chat images; embedding inputs' images)
    decoders: list[Preparer] = field(default_factory=list)
    ray_batches: RayBatches | None = None  # with --executor ray
    _choices: Callable[[tuple[str, ...]], None] | None = None  # label_set_checker, once

    @classmethod
    def build(cls, cfg: ServerConfig, engines: Engines, hooks: FaultHooks = NO_HOOKS,
              embedder: Embedder | None = None) -> ServerState:
        files = FileStore(cfg.files_dir)
        book = BatchBook(cfg.batches_dir)
        files.in_use = lambda file_id: any(  # a batch in progress reads it: kept
            r.input_file_id == file_id and r.status in ACTIVE for r in book.all())
        worker = BatchWorker(cfg, book, files)
        engines.bind(book, BookEvents(book, worker.finalize))
        decoders = preparer(engines.image_plan, cfg.prepare_options, hooks)
        images = ImageCache(engines.image_plan, cfg.prepare_options,
                            cfg.allowed_local_media_path, cfg.image_cache_bytes, decoders,
                            cfg.remote_media)
        words = (cfg.engine.yes_words[0], cfg.engine.no_words[0])
        return cls(cfg, engines, images, files, book, worker, Metrics(engines, book),
                   embedder, words, hooks, [decoders] if decoders is not None else [])

    def check_choices(self, choices: tuple[str, ...]) -> None:
        """ConfigError for a chat request's label set the engines would not score (checked
        here, before its image is decoded: the engines may be other processes); the
        tokenizer is read on the first label set."""
        if self._choices is None:
            self._choices = label_set_checker(self.cfg.model.path, self.cfg.engine)
        self._choices(choices)

    def serve_embeddings(self) -> None:
        """Answer ``/v1/embeddings`` on the engines' embedding engine (the chat engine
        itself when the checkpoint is the same), its images decoded by the chat images'
        decoder processes when the plan is the same."""
        plan = self.engines.embed_plan
        assert plan is not None
        decoders = self.images.workers if plan == self.engines.image_plan \
            else preparer(plan, self.cfg.prepare_options, self.hooks)
        if decoders is not None and decoders is not self.images.workers:
            self.decoders.append(decoders)
        self.embedder = EngineEmbedder(self.engines, plan, self.cfg.prepare_options, decoders)

    def start(self) -> None:
        """Resume unfinished batches (oldest first), then start the threads."""
        enqueue = self.engines.enqueue_batch
        if self.ray_batches is not None:
            enqueue = self.ray_batches.enqueue_batch
        for rec in reversed(self.book.all()):
            if rec.status == "validating":
                self.worker.validate(rec.id)
            elif rec.status == "in_progress":
                enqueue(rec.id)
            elif rec.status in ("finalizing", "cancelling"):
                self.worker.finalize(rec.id)
            else:
                continue
            log.info("batch %s: %s, resumed", rec.id, rec.status)
        self.worker.start(enqueue)
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


def start_engines(cfg: ServerConfig, hooks: FaultHooks = NO_HOOKS) -> Engines:
    """The engines of ``cfg``: ``--engines N`` processes, started and loaded; 0: built here."""
    read_spec(cfg.model.path)  # a bad model folder fails here, with its message
    if cfg.engines == 0:
        engine, embed_engine = build_engines(cfg)
        return LocalEngines(engine, cfg, hooks, embed_engine)
    engines = EngineProcesses(cfg, hooks)
    engines.launch()
    return engines


def serve(cfg: ServerConfig, hooks: FaultHooks = NO_HOOKS) -> None:
    """Run the server until SIGTERM or Ctrl-C."""
    fd = _take_data_dir(Path(cfg.data_dir))
    engines: Engines | None = None
    try:
        engines = start_engines(cfg, hooks)
        state = ServerState.build(cfg, engines, hooks)
        if engines.embed_dims is not None:
            state.serve_embeddings()
        if cfg.executor.kind == "ray":
            state.ray_batches = RayBatches(cfg, state.book, BookEvents(
                state.book, state.worker.finalize), hooks)
        app = create_app(state)
        logging.basicConfig(level=logging.INFO, format="vlmbatch serve: %(message)s",
                            stream=sys.stderr)
        print(f"vlmbatch serve: model {cfg.served_model_name!r} on http://{cfg.host}:"
              f"{cfg.port}/v1, data in {cfg.data_dir}, "
              + (f"{cfg.engines} engine process(es)" if cfg.engines else "engine in-process")
              + (", batches on Ray" if cfg.executor.kind == "ray" else "")
              + (", API key required" if cfg.api_key else ""), file=sys.stderr, flush=True)
        uvicorn.Server(uvicorn.Config(
            app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
            timeout_graceful_shutdown=cfg.shutdown_timeout_s)).run()
    finally:
        if isinstance(engines, EngineProcesses) and not engines.stopping:
            engines.stop(0)  # the app never started (its lifespan stops them otherwise)
        os.close(fd)
