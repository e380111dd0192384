"""``ServerConfig``: everything ``vlmbatch serve`` is started with, one frozen record.

The model and engine are the same ``ModelConfig``/``EngineConfig`` as ``vlmbatch run``'s;
the rest is the server's: where it listens, who may call it, where batches live, and the
limits that turn an oversized or hostile request into a 4xx before it reaches the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from vlmbatch.pipeline.config import (
    DEFAULT_EMBED_MODEL,
    ConfigError,
    EngineConfig,
    ModelConfig,
    PrepareOptions,
    preprocess_threads_for,
)
from vlmbatch.preprocessing.limits import DEFAULT_MAX_PIXELS

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
    max_body_bytes: int = 64 << 20  # any request body (413 beyond): images, uploads
    max_pixels: int = DEFAULT_MAX_PIXELS  # decompression-bomb guard (400 beyond)
    max_prompt_chars: int = 16_384  # a chat request's question text (400 beyond)
    max_completion_tokens: int = 512  # largest max_tokens a request may ask for (400 beyond)
    # interactive scheduling: the engine thread waits up to batch_wait_s after the first
    # queued request for more, then answers up to max_batch_requests in one engine call
    batch_wait_s: float = 0.005
    max_batch_requests: int = 64
    max_queue: int = 1024  # queued chat requests; beyond that 429 (clients retry)
    image_cache_bytes: int = 64 << 20  # prepared data: images kept by URL hash (no re-decode)
    images_per_batch: int = 16  # a batch job's group: the most an interactive request waits
    threads: int | None = None  # torch threads (None: torch's default)
    preprocess_threads: int | None = None  # decoder processes (None: auto)
    # seconds an image may take to read and decode before its decoder process is killed: an
    # interactive request's 400, a batch line's error; 0: decode on the request's thread (a
    # batch's job: on threads), no deadline. A batch keeps the value it was submitted with
    decode_timeout: float = 30.0
    shutdown_timeout_s: int = 30  # SIGTERM: how long in-flight requests may take
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    # /v1/embeddings: the checkpoint (None: the built-in embedding model when the chat model
    # is the built-in one, else the chat model itself); embeddings False: answered 501
    embed_model: Path | None = None
    embeddings: bool = True

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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError(f"--api-key (or ${API_KEY_ENV}) must not be empty")
        if not self.served_model_name.strip():
            raise ConfigError("--served-model-name must not be empty")
        for name in ("max_body_bytes", "max_pixels", "max_prompt_chars",
                     "max_completion_tokens", "max_batch_requests", "max_queue",
                     "images_per_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.decode_timeout >= 0:  # NaN too
            raise ConfigError(f"--decode-timeout must be >= 0, got {self.decode_timeout}")
        if self.image_cache_bytes < 0 or not 0 <= self.batch_wait_s <= 1:
            raise ConfigError("image_cache_bytes must be >= 0 and batch_wait_s in [0, 1] seconds")
        if self.allowed_local_media_path is not None \
                and not Path(self.allowed_local_media_path).is_dir():
            raise ConfigError(f"--allowed-local-media-path {self.allowed_local_media_path} is "
                              "not a folder")

    @property
    def prepare(self) -> PrepareOptions:
        """How interactive requests' images are prepared (decoder processes, deadline)."""
        return PrepareOptions(self.max_pixels, preprocess_threads_for(
            self.preprocess_threads, self.model.device), self.decode_timeout)

    @property
    def files_dir(self) -> Path:
        return Path(self.data_dir) / "files"

    @property
    def batches_dir(self) -> Path:
        return Path(self.data_dir) / "batches"
