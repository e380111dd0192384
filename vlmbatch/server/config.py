"""``ServerConfig``: everything ``vlmbatch serve`` is started with, one frozen record (the
serve command's config root, ``cli/config.py``), its fields declaring their options.

The model, engine, stage-1 and executor settings are the same sub-configs as ``vlmbatch
run``'s (``ModelConfig``, ``EngineConfig``, ``PrepareConfig``, ``ExecutorConfig``, with their
options); the rest is the server's: where it listens, who may call it, where batches live,
and the limits that turn an oversized or hostile request into a 4xx before it reaches the
engine. ``server_config`` builds it from what the command line typed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from vlmbatch.common.options import COUNT, MIB, MS, build, opt, reuse
from vlmbatch.engine.config import ConfigError, EngineConfig, ModelConfig
from vlmbatch.jobs.config import ExecutorConfig, RunConfig
from vlmbatch.models.paths import DEFAULT_EMBED_MODEL
from vlmbatch.pipeline.config import PrepareConfig, PrepareOptions, check_threads
from vlmbatch.pipeline.questions import MAX_PROMPT_CHARS
from vlmbatch.preprocessing.limits import MediaGuard
from vlmbatch.serving.config import ServingConfig

API_KEY_ENV = "VLMBATCH_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    OPTION_GROUP: ClassVar[str] = "server"
    # files/ and batches/ (each batch a job folder)
    data_dir: Path = field(default=Path("vlmbatch-server"), metadata=opt(
        "--data-dir", parse=Path, metavar="DIR", help="uploaded files and batches (each batch "
        "a job folder) (default %(default)s)"))
    host: str = field(default="127.0.0.1", metadata=opt(
        "--host", metavar="HOST", help="address to listen on (default %(default)s: this "
        "machine only)"))
    port: int = field(default=8000, metadata=opt(
        "--port", parse=int, metavar="PORT", help="default %(default)s"))
    # every endpoint but /health needs "Authorization: Bearer KEY"
    api_key: str | None = field(default=None, metadata=opt(
        "--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on every "
        f"endpoint but /health (default: ${API_KEY_ENV} if set, else no key)"))
    # the one id /v1/models lists and requests must name
    served_model_name: str = field(default="vlmbatch", metadata=opt(
        "--served-model-name", metavar="NAME", help="the model id clients name (default "
        "%(default)s)"))
    # file:// image URLs are read only from under this folder; None: file:// is refused
    allowed_local_media_path: Path | None = field(default=None, metadata=opt(
        "--allowed-local-media-path", parse=Path, metavar="DIR", help="let image URLs be "
        "file:// paths inside this folder (default: only data: URLs)"))
    # http(s) image URLs in chat requests and batch lines, fetched under the SSRF guard
    # (prepare.media_guard, always on in the server; prepare.allowed_media_domains let
    # through); False: refused with a 400 (data: and file:// only)
    allow_remote_media: bool = field(default=False, metadata=opt(
        "--allow-remote-media", action="true", help="let image URLs be http(s):// (chat "
        "requests and batch lines), fetched under the SSRF guard: loopback, private, "
        "link-local and metadata addresses refused, redirects and DNS answers included "
        "(docs/server.md); the fetching options (--fetch-timeout, --max-image-mib) apply"))
    # any request body (413 beyond): images, uploads
    max_body_bytes: int = field(default=64 << 20, metadata=opt(
        "--max-body-mib", unit=MIB, help="largest request body, uploads included; 413 beyond "
        "(default %(default)s)"))
    max_prompt_chars: int = field(default=MAX_PROMPT_CHARS, metadata=opt(  # 400 beyond
        "--max-prompt-chars", unit=COUNT, metavar="CHARS", help="longest question text; 400 "
        "beyond (default %(default)s)"))
    # largest max_tokens a request may ask for (400 beyond)
    max_completion_tokens: int = field(default=512, metadata=opt(
        "--max-completion-tokens", unit=COUNT, metavar="TOKENS", help="largest max_tokens a "
        "request may ask; 400 beyond (default %(default)s)"))
    # interactive scheduling: the engine thread waits up to batch_wait_s after the first
    # queued request for more on their way (serving/scheduler.py), then answers up to
    # max_batch_requests in one engine call
    batch_wait_s: float = field(default=0.02, metadata=opt(
        "--batch-wait-ms", unit=MS, help="how long the engine waits after a request for "
        "others to batch with it (default %(default)s)"))
    max_batch_requests: int = field(default=64, metadata=opt(
        "--max-batch-requests", unit=COUNT, help="chat requests per engine call (default "
        "%(default)s)"))
    max_queue: int = field(default=1024, metadata=opt(  # queued chat requests; 429 beyond
        "--max-queue", unit=COUNT, help="queued chat requests; 429 beyond (default %(default)s)"))
    # chat images kept prepared by the content hash of their bytes (media_cache.py): a
    # second request about an image decodes nothing
    media_cache_bytes: int = field(default=256 << 20, metadata=opt(
        "--media-cache-mib", unit=MIB, help="chat images kept decoded and tiled, by the "
        "content hash of their bytes, so later requests about an image decode nothing "
        "(default %(default)s; 0: none)"))
    # a batch job's group: the most an interactive request waits
    images_per_batch: int = reuse(RunConfig, "images_per_batch", 16)
    threads: int | None = reuse(RunConfig, "threads", None)  # None: torch's default
    shutdown_timeout_s: int = 30  # SIGTERM: how long in-flight requests may take
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    # every image's pixel limit (400 beyond), the decoder processes and each image's decode
    # deadline: an interactive request's 400, a new batch's line error (a batch keeps what it
    # was submitted with)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    # /v1/embeddings: the checkpoint (None: the built-in embedding model when the chat model
    # is the built-in one, else the chat model itself); embeddings False: answered 501
    embed_model: Path | None = field(default=None, metadata=opt(
        "--embed-model", parse=Path, metavar="DIR", help="checkpoint for /v1/embeddings "
        "(default: the built-in embedding model with the built-in chat model, else --model)"))
    embeddings: bool = field(default=True, metadata=opt(
        "--no-embeddings", action="false", help="answer /v1/embeddings with 501 (no embedding "
        "model loaded)"))
    # engine processes (one per GPU on a multi-GPU host); 0: the engine thread in the HTTP
    # process itself (no process boundary, no restart)
    engines: int = field(default=1, metadata=opt(
        "--engines", unit=COUNT, help="engine processes, each with the model (one per GPU on a "
        "multi-GPU host); requests are spread over them and one that dies is restarted "
        "(default %(default)s; 0: the engine in the HTTP process)"))
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


def server_config(typed: Mapping[str, Any]) -> ServerConfig:
    """The server's config root from what its command line typed (``--api-key``, else
    $VLMBATCH_API_KEY); the SSRF guard is on for every fetch the server makes, its batches'
    jobs included."""
    key = typed.get("api_key", os.environ.get(API_KEY_ENV))
    prepare = dataclasses.replace(build(PrepareConfig, typed), media_guard=True)
    return build(ServerConfig, typed, api_key=key, prepare=prepare)
