"""``vlmbatch serve``'s own options (the model and engine options are ``run``'s, added by
``vlmbatch/app/args.py``), and the ``ServerConfig`` they make. Defaults are the config's."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vlmbatch.app.server.config import API_KEY_ENV, ServerConfig
from vlmbatch.pipeline.config import EngineConfig, ModelConfig, default_of


def _d(name: str) -> object:
    return default_of(ServerConfig, name)


# the integer limits: (option, ServerConfig field, help)
LIMITS = [
    ("--max-pixels", "max_pixels", "images with more pixels (read from the header) are "
     "refused with a 400"),
    ("--max-prompt-chars", "max_prompt_chars", "longest question text; 400 beyond"),
    ("--max-completion-tokens", "max_completion_tokens", "largest max_tokens a request may "
     "ask; 400 beyond"),
    ("--max-batch-requests", "max_batch_requests", "chat requests per engine call"),
    ("--max-queue", "max_queue", "queued chat requests; 429 beyond")]


def add_server_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("server")
    g.add_argument("--host", default=_d("host"),
                   help="address to listen on (default %(default)s: this machine only)")
    g.add_argument("--port", type=int, default=_d("port"), help="default %(default)s")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
                   f"(default: ${API_KEY_ENV} if set, else no key)")
    g.add_argument("--data-dir", type=Path, default=_d("data_dir"),
                   help="uploaded files and batches (each batch a job folder) (default "
                   "%(default)s)")
    g.add_argument("--served-model-name", default=_d("served_model_name"),
                   help="the model id clients name (default %(default)s)")
    g.add_argument("--allowed-local-media-path", type=Path, default=None,
                   help="let image URLs be file:// paths inside this folder (default: only "
                   "data: URLs)")
    for flag, field, text in LIMITS:
        g.add_argument(flag, type=int, default=_d(field),
                       help=f"{text} (default %(default)s)")
    g.add_argument("--max-body-mib", type=int, default=_d("max_body_bytes") >> 20,  # type: ignore[operator]
                   help="largest request body, uploads included; 413 beyond (default "
                   "%(default)s)")
    g.add_argument("--embed-model", type=Path, default=None,
                   help="checkpoint for /v1/embeddings (default: the built-in embedding model "
                   "with the built-in chat model, else --model)")
    g.add_argument("--no-embeddings", action="store_true",
                   help="answer /v1/embeddings with 501 (no embedding model loaded)")
    g.add_argument("--decode-timeout", type=float, default=_d("decode_timeout"),
                   help="seconds an image may take to read and decode before its decoder "
                   "process is killed: a request's 400, a batch line's error (default "
                   "%(default)s); 0: no limit, decoding on the request's thread")
    g.add_argument("--batch-wait-ms", type=float,
                   default=1000 * _d("batch_wait_s"),  # type: ignore[operator]
                   help="how long the engine waits after a request for others to batch "
                   "with it (default %(default)s)")

def server_config(a: argparse.Namespace, model: ModelConfig, engine: EngineConfig
                  ) -> ServerConfig:
    return ServerConfig(
        data_dir=a.data_dir, host=a.host, port=a.port,
        api_key=a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV),
        served_model_name=a.served_model_name,
        allowed_local_media_path=a.allowed_local_media_path,
        max_body_bytes=a.max_body_mib << 20, max_pixels=a.max_pixels,
        max_prompt_chars=a.max_prompt_chars, max_completion_tokens=a.max_completion_tokens,
        batch_wait_s=a.batch_wait_ms / 1000, max_batch_requests=a.max_batch_requests,
        max_queue=a.max_queue, images_per_batch=a.images_per_batch, threads=a.threads,
        preprocess_threads=a.preprocess_threads, decode_timeout=a.decode_timeout,
        model=model, engine=engine, embed_model=a.embed_model,
        embeddings=not a.no_embeddings)
