"""``ServingConfig``: what the engine side of ``vlmbatch serve`` is started with, the part
of the server's config root (``server/config.py`` ``ServerConfig.serving``) an engine
process needs: which models, how the engine thread batches requests, how it runs batch
jobs. Names and numbers only (it is pickled to each engine process); no option parsing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from vlmbatch.engine.config import EngineConfig, ModelConfig


@dataclass(frozen=True)
class ServingConfig:
    model: ModelConfig  # the chat model
    engine: EngineConfig
    embed_model: ModelConfig | None  # /v1/embeddings' model; None: no embeddings
    threads: int | None = None  # torch threads (None: torch's default)
    # interactive scheduling: the engine thread waits up to batch_wait_s after the first
    # queued request for more while others are arriving, then answers up to
    # max_batch_requests in one engine call
    batch_wait_s: float = 0.02
    max_batch_requests: int = 64
    max_queue: int = 1024  # queued requests per engine; 429 beyond
    preprocess_threads: int | None = None  # a batch job's decoder processes
    shutdown_timeout_s: float = 30.0
    engines: int = 1  # engine processes; 0: the engine thread in the HTTP process

    def model_of(self, task: str) -> ModelConfig | None:
        """The model a job of ``task`` ("answer" or "embed") runs on here (None: none)."""
        return self.embed_model if task == "embed" else self.model

    @property
    def shared_embed_engine(self) -> bool:
        """The embedding model is the chat model's checkpoint: one engine serves both."""
        e = self.embed_model
        return e is not None and self.model.path is not None and \
            Path(self.model.path).resolve() == Path(e.path or "").resolve()


def absolute(m: ModelConfig) -> ModelConfig:
    """``m`` with its path absolute (how a job and a server compare their models)."""
    return dataclasses.replace(m, path=Path(m.path).absolute() if m.path else None)
