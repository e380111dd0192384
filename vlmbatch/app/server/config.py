"""``ServerConfig``: everything ``vlmbatch serve`` is started with, one frozen record (the
serve command's config root, ``app/config.py``), and the options that make it.

The model, engine and stage-1 settings are the same sub-configs as ``vlmbatch run``'s
(``ModelConfig``, ``EngineConfig``, ``PrepareConfig``, added by ``app/args.py``); the rest is
the server's: where it listens, who may call it, where batches live, and the limits that turn
an oversized or hostile request into a 4xx before it reaches the engine. Each option's
``dest`` is its field's name (``from_args``); defaults are the fields'.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from vlmbatch.app.config import from_args
from vlmbatch.engine.config import (
    DEFAULT_EMBED_MODEL,
    ConfigError,
    EngineConfig,
    ModelConfig,
    default_of,
)
from vlmbatch.jobs.config import EXECUTORS, ExecutorConfig, RayOptions
from vlmbatch.pipeline.config import PrepareConfig, PrepareOptions, check_threads
from vlmbatch.preprocessing.limits import MediaGuard
from vlmbatch.serving.config import ServingConfig

API_KEY_ENV = "VLMBATCH_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    data_dir: Path = Path("vlmbatch-server")  # files/ and batches/ (each batch a job folder)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # every endpoint but /health needs "Authorization: Bearer KEY"
    served_model_name: str = "vlmbatch"  # the one id /v1/models lists and requests must name
    # file:// image URLs are read only from under this folder; None: file:// is refused
    allowed_local_media_path: Path | None = None
    # http(s) image URLs in chat requests and batch lines, fetched under the SSRF guard
    # (prepare.media_guard, always on in the server; prepare.allowed_media_domains let
    # through); False: refused with a 400 (data: and file:// only)
    allow_remote_media: bool = False
    max_body_bytes: int = 64 << 20  # any request body (413 beyond): images, uploads
    max_prompt_chars: int = 16_384  # a chat request's question text (400 beyond)
    max_completion_tokens: int = 512  # largest max_tokens a request may ask for (400 beyond)
    # interactive scheduling: the engine thread waits up to batch_wait_s after the first
    # queued request for more on their way (serving/scheduler.py), then answers up to
    # max_batch_requests in one engine call
    batch_wait_s: float = 0.02
    max_batch_requests: int = 64
    max_queue: int = 1024  # queued chat requests; beyond that 429 (clients retry)
    # chat images kept prepared by the content hash of their bytes (media_cache.py): a
    # second request about an image decodes nothing
    media_cache_bytes: int = 256 << 20
    images_per_batch: int = 16  # a batch job's group: the most an interactive request waits
    threads: int | None = None  # torch threads (None: torch's default)
    shutdown_timeout_s: int = 30  # SIGTERM: how long in-flight requests may take
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    # every image's pixel limit (400 beyond), the decoder processes and each image's decode
    # deadline: an interactive request's 400, a new batch's line error (a batch keeps what it
    # was submitted with)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    # /v1/embeddings: the checkpoint (None: the built-in embedding model when the chat model
    # is the built-in one, else the chat model itself); embeddings False: answered 501
    embed_model: Path | None = None
    embeddings: bool = True
    # engine processes (one per GPU on a multi-GPU host); 0: the engine thread in the HTTP
    # process itself (no process boundary, no restart)
    engines: int = 1
    # where batches run: the engine processes (local), or each batch a job on Ray
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError(f"--api-key (or ${API_KEY_ENV}) must not be empty")
        if not self.served_model_name.strip():
            raise ConfigError("--served-model-name must not be empty")
        for name in ("max_body_bytes", "max_prompt_chars", "max_completion_tokens",
                     "max_batch_requests", "max_queue", "images_per_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.media_cache_bytes < 0 or not 0 <= self.batch_wait_s <= 1:
            raise ConfigError("--media-cache-mib must be >= 0 and --batch-wait-ms in [0, 1000]")
        check_threads(self.threads, None)
        if not 0 <= self.engines <= 64:
            raise ConfigError(f"--engines must be in 0..64, got {self.engines}")
        if self.prepare.allowed_media_domains and not self.allow_remote_media:
            raise ConfigError("--allowed-media-domains needs --allow-remote-media")
        if self.allowed_local_media_path is not None \
                and not Path(self.allowed_local_media_path).is_dir():
            raise ConfigError(f"--allowed-local-media-path {self.allowed_local_media_path} is "
                              "not a folder")

    @property
    def remote_media(self) -> MediaGuard | None:
        """The guard chat and batch image URLs are checked with; None: http(s) refused."""
        return MediaGuard(self.prepare.allowed_media_domains) if self.allow_remote_media \
            else None

    @property
    def embed_model_dir(self) -> Path:
        if self.embed_model is not None:
            return Path(self.embed_model)
        return DEFAULT_EMBED_MODEL if self.model.path is None else Path(self.model.path)

    @property
    def embed_model_config(self) -> ModelConfig:
        """The embedding model: ``embed_model_dir`` on the chat model's device and dtype
        (what ``/v1/embeddings`` and embedding batches run on)."""
        return dataclasses.replace(self.model, path=self.embed_model_dir)

    @property
    def serving(self) -> ServingConfig:
        """What the engine side is started with (``serving/config.py``)."""
        return ServingConfig(
            self.model, self.engine, self.embed_model_config if self.embeddings else None,
            self.threads, self.batch_wait_s, self.max_batch_requests, self.max_queue,
            self.prepare.preprocess_threads, self.shutdown_timeout_s, self.engines)

    @property
    def prepare_options(self) -> PrepareOptions:
        """How interactive requests' images are prepared (decoder processes, deadline)."""
        return self.prepare.options(self.model.device)

    @property
    def files_dir(self) -> Path:
        return Path(self.data_dir) / "files"

    @property
    def batches_dir(self) -> Path:
        return Path(self.data_dir) / "batches"


def _d(name: str) -> object:
    return default_of(ServerConfig, name)


def _ms(text: str) -> float:
    """argparse type: milliseconds as seconds."""
    return float(text) / 1000


def _mib(text: str) -> int:
    """argparse type: MiB as bytes."""
    return int(text) << 20


# the integer limits: (option, field, help)
LIMITS = [
    ("--max-pixels", "max_pixels", "images with more pixels (read from the header) are "
     "refused with a 400"),
    ("--max-prompt-chars", "max_prompt_chars", "longest question text; 400 beyond"),
    ("--max-completion-tokens", "max_completion_tokens", "largest max_tokens a request may "
     "ask; 400 beyond"),
    ("--max-batch-requests", "max_batch_requests", "chat requests per engine call"),
    ("--max-queue", "max_queue", "queued chat requests; 429 beyond")]


def add_server_args(s: argparse.ArgumentParser) -> None:
    """``serve``'s own options (the model, engine and stage-1 options are ``run``'s)."""
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
    g.add_argument("--allow-remote-media", action="store_true",
                   help="let image URLs be http(s):// (chat requests and batch lines), fetched "
                   "under the SSRF guard: loopback, private, link-local and metadata "
                   "addresses refused, redirects and DNS answers included (docs/server.md); "
                   "the fetch options below (--fetch-timeout, --max-image-mib) apply")
    g.add_argument("--allowed-media-domains", type=domain_list, default=(),
                   metavar="HOST,HOST",
                   help="hosts the SSRF guard lets through whatever they resolve to (exact "
                   "names or addresses; .b.org for b.org's subdomains)")
    for flag, name, text in LIMITS:
        default = default_of(PrepareConfig, name) if name == "max_pixels" else _d(name)
        g.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
    g.add_argument("--max-body-mib", dest="max_body_bytes", type=_mib,
                   default=_d("max_body_bytes"),
                   help="largest request body, uploads included; 413 beyond (default "
                   f"{int(_d('max_body_bytes')) >> 20})")  # type: ignore[call-overload]
    g.add_argument("--media-cache-mib", dest="media_cache_bytes", type=_mib,
                   default=_d("media_cache_bytes"), metavar="MIB",
                   help="chat images kept decoded and tiled, by the content hash of their "
                   "bytes, so later requests about an image decode nothing (default "
                   f"{int(_d('media_cache_bytes')) >> 20}; 0: none)")  # type: ignore[call-overload]
    g.add_argument("--embed-model", type=Path, default=None,
                   help="checkpoint for /v1/embeddings (default: the built-in embedding model "
                   "with the built-in chat model, else --model)")
    g.add_argument("--no-embeddings", dest="embeddings", action="store_false",
                   help="answer /v1/embeddings with 501 (no embedding model loaded)")
    g.add_argument("--decode-timeout", type=float,
                   default=default_of(PrepareConfig, "decode_timeout"),
                   help="seconds an image may take to read and decode before its decoder "
                   "process is killed: a request's 400, a batch line's error (default "
                   "%(default)s); 0: no limit, decoding on the request's thread")
    g.add_argument("--batch-wait-ms", dest="batch_wait_s", type=_ms,
                   default=_d("batch_wait_s"),
                   help="how long the engine waits after a request for others to batch "
                   f"with it (default {1000 * float(_d('batch_wait_s')):g})")  # type: ignore[arg-type]


def add_executor_args(s: argparse.ArgumentParser) -> None:
    """Where the engine runs and where batches run."""
    g = s.add_argument_group("engines and batches")
    g.add_argument("--engines", type=int, default=_d("engines"),
                   help="engine processes, each with the model (one per GPU on a multi-GPU "
                   "host); requests are spread over them and one that dies is restarted "
                   "(default %(default)s; 0: the engine in the HTTP process)")
    g.add_argument("--executor", default=EXECUTORS[0], choices=EXECUTORS,
                   help="local: batches run on the engine processes between interactive "
                   "requests (default); ray: each batch a job on Ray (prepare tasks, model "
                   "actors), several at once, sharing the actors")
    r = RayOptions()
    g.add_argument("--address", default=None,
                   help="ray: join this cluster (HOST:PORT, ray://HEAD:10001, auto; default "
                   "$RAY_ADDRESS, else a new local instance)")
    g.add_argument("--preprocess-workers", type=int, default=r.preprocess_workers,
                   help="ray: concurrent decode/tile tasks per batch (default %(default)s)")
    g.add_argument("--model-workers", type=int, default=r.model_workers,
                   help="ray: model actors shared by the batches (default %(default)s)")
    g.add_argument("--model-cpus", type=float, default=r.model_cpus,
                   help="ray: CPUs per model actor (default %(default)s)")


def domain_list(text: str) -> tuple[str, ...]:
    """argparse type: ``a.com,.b.org,127.0.0.1`` -> its entries, lower case, checked."""
    out = []
    for entry in (e.strip().lower() for e in text.split(",")):
        host = entry.removeprefix(".")
        if not host or any(c in host for c in "/@?#\\ ") or "://" in entry:
            raise argparse.ArgumentTypeError(f"{entry!r} is not a host name (a.com, .b.org)")
        out.append(entry)
    return tuple(out)


def server_config(a: argparse.Namespace) -> ServerConfig:
    """The server's config root from its command line (``--api-key``, else $VLMBATCH_API_KEY)."""
    key = a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV)
    ray = from_args(RayOptions, a)
    if a.executor != "ray" and ray != RayOptions():
        raise ConfigError("--address, --preprocess-workers, --model-workers and --model-cpus "
                          "are Ray executor options; add --executor ray")
    # the guard is on for every fetch the server makes, its batches' jobs included
    prepare = dataclasses.replace(from_args(PrepareConfig, a), media_guard=True)
    return from_args(ServerConfig, a, api_key=key, executor=ExecutorConfig(a.executor, ray),
                     prepare=prepare)
