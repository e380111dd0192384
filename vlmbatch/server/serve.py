"""``serve``: take the data folder, start the engines (each loads the model), build the
server's state (``state.py``) and run the app (``app.py``) under uvicorn. One server per
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
from pathlib import Path

import uvicorn

from vlmbatch.engine.config import ConfigError
from vlmbatch.engine.loading import read_spec
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.server.app import create_app
from vlmbatch.server.config import ServerConfig
from vlmbatch.server.state import ServerState
from vlmbatch.serving.engine_process import build_engines
from vlmbatch.serving.engines import Engines, LocalEngines
from vlmbatch.serving.processes import EngineProcesses

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
        engine, embed_engine = build_engines(cfg.serving)
        return LocalEngines(engine, cfg.serving, hooks, embed_engine)
    engines = EngineProcesses(cfg.serving, hooks)
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
            state.serve_batches_on_ray()
        app = create_app(state)
        logging.basicConfig(level=logging.INFO, format="vlmbatch serve: %(message)s",
                            stream=sys.stderr)
        print(f"vlmbatch serve: model {cfg.served_model_name!r} on http://{cfg.host}:"
              f"{cfg.port}/v1, data in {cfg.data_dir}, "
              + (f"{cfg.engines} engine process(es)" if cfg.engines else "engine in-process")
              + (", batches on Ray" if cfg.executor.kind == "ray" else "")
              + (", API key required" if cfg.api_key else ""), file=sys.stderr, flush=True)
        uvicorn.Server(uvicorn.Config(  # no proxy headers: the client's address is unused
            app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
            proxy_headers=False, timeout_graceful_shutdown=cfg.shutdown_timeout_s)).run()
    finally:
        if isinstance(engines, EngineProcesses) and not engines.stopping:
            engines.stop(0)  # the app never started (its lifespan stops them otherwise)
        os.close(fd)
