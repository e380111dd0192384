"""``serve``: load the engine, take the data folder, run the app under uvicorn.

One server per data folder: ``DATA/server.lock`` is held (flock) while it runs, so a second
server on the same batches is refused instead of running their jobs twice. SIGTERM and
Ctrl-C are uvicorn's graceful shutdown: it stops accepting, waits up to
``shutdown_timeout_s`` for in-flight requests, then the app's lifespan stops the engine
thread after its current group, leaving batch jobs resumable by the next start.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
from pathlib import Path

import uvicorn

from vlmbatch.app.server.app import create_app
from vlmbatch.app.server.config import ServerConfig
from vlmbatch.app.server.state import ServerState
from vlmbatch.pipeline.build import build_engine
from vlmbatch.pipeline.config import ConfigError
from vlmbatch.pipeline.engine import Engine
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks

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
