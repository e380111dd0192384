"""Embeddings on the server's engines: what ``/v1/embeddings`` hands over
(``EmbedInput``s with ``EmbedOptions``), what it gets back (``Embeddings``), the backend
that does the work (``EmbedBackend``; the server's: ``EngineEmbedBackend``) and the engine
thread's part of it (``embed_prepared``).

``EngineEmbedBackend`` runs the drive loop's two stages: stage 1 (read, decode, tile) on
the request's thread, in the server's decoder processes; stage 2 on an engine thread
(``embed``: ``Engines.embed``, in an engine process or this one), which pools each
prepared item's vectors (``embed_prepared``). Token limits are checked on the engine's
counts (it owns the tokenizer): an input over them is ``EmbedRefused`` (a 400).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from vlmbatch.engine.base import Engine
from vlmbatch.engine.config import ConfigError, EmbedConfig
from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.drive import prepared_groups, run_group
from vlmbatch.pipeline.preparers import PrepareWorkers
from vlmbatch.pipeline.records import Embedding, EmbedItem
from vlmbatch.pipeline.task import EmbedTask, Prepared
from vlmbatch.preprocessing.prepare import ImagePlan
from vlmbatch.serving.errors import EmbedRefused

MAX_INPUTS, MAX_INPUT_TOKENS, MAX_REQUEST_TOKENS = 2048, 8192, 300_000


@dataclass(frozen=True)
class EmbedInput:
    """One thing to embed: a text, token ids, an encoded image, or a text with an image."""
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    image: bytes | None = None  # the file's bytes (PNG, JPEG...), read by the server


@dataclass(frozen=True)
class EmbedOptions:
    dimensions: int | None  # None: native size; else the first n, re-normalised
    max_input_tokens: int = MAX_INPUT_TOKENS
    max_request_tokens: int = MAX_REQUEST_TOKENS


@dataclass(frozen=True)
class Embeddings:
    vectors: np.ndarray  # [N, D] float32, row i for input i, unit length
    tokens: list[int]  # tokens read per input, special tokens included (``usage``)


class EmbedBackend(Protocol):
    """What the endpoint calls: inputs in, one unit vector and one token count per input
    out, in order. Called from a request's worker thread: it must do its own locking (or
    hand the work to the engine thread)."""
    dimensions: int  # the native vector size

    def __call__(self, inputs: Sequence[EmbedInput], options: EmbedOptions) -> Embeddings: ...


def embed_dims(engine: Engine) -> int:
    """A pooled vector's full size on ``engine`` (the decoder's hidden size)."""
    return engine.embedding(EmbedConfig(multi_vector=False)).hidden


def embed_prepared(engine: Engine, dims: int | None, p: Prepared[EmbedItem]
                   ) -> list[list[Embedding]]:
    """On the engine thread: a prepared group's pooled vectors (``dims``: a Matryoshka size
    the checkpoint declares, else ``EmbedRefused``)."""
    cfg = EmbedConfig(dimensions=dims, multi_vector=False)
    try:
        engine.embedding(cfg)  # checked (and its head built) once per size
    except ConfigError as e:
        raise EmbedRefused(str(e), None) from None
    return run_group(EmbedTask(cfg), engine, p)


# Engines.embed: a prepared group (its images in ``images``) -> each item's embeddings
EmbedCall = Callable[[int | None, Prepared[EmbedItem]], "Future[list[list[Embedding]]]"]


class EngineEmbedBackend:
    """The server's ``EmbedBackend``: the inputs' images decoded on the request's thread
    (in the server's decoder processes, ``workers``), the vectors computed on an engine
    thread (``embed``)."""

    def __init__(self, embed: EmbedCall, dimensions: int, plan: ImagePlan,
                 opts: PrepareOptions, workers: PrepareWorkers | None) -> None:
        self.embed, self.dimensions = embed, dimensions
        self.plan, self.opts, self.workers = plan, opts, workers

    def __call__(self, inputs: Sequence[EmbedInput], options: EmbedOptions) -> Embeddings:
        items = [_item(i, x) for i, x in enumerate(inputs)]
        task = EmbedTask(EmbedConfig(dimensions=options.dimensions, multi_vector=False))
        with closing(prepared_groups(task, [items], self.plan, self.opts,
                                     workers=self.workers)) as stage1:
            p = next(stage1)  # decoded here, on the request's thread
        # the engine reads each item's image from p.images, not its encoded bytes
        p.items = [dataclasses.replace(it, image=b"") if it.image is not None else it
                   for it in p.items]
        out = [e for per_item in self.embed(options.dimensions, p).result()
               for e in per_item]
        total = 0
        for e in out:
            if e.vector is None:
                raise EmbedRefused(f"input {e.index} could not be embedded: {e.error}", e.index)
            tokens = e.tokens or 0
            if tokens > options.max_input_tokens:
                raise EmbedRefused(f"input {e.index} has {tokens:,} tokens, over the limit of "
                                   f"{options.max_input_tokens:,}", e.index,
                                   "context_length_exceeded")
            total += tokens
        if total > options.max_request_tokens:
            raise EmbedRefused(f"the request has {total:,} tokens, over the limit of "
                               f"{options.max_request_tokens:,}", None, "context_length_exceeded")
        vectors = np.stack([e.vector for e in out if e.vector is not None]).astype(np.float32)
        return Embeddings(vectors, [e.tokens or 0 for e in out])


def _item(i: int, x: EmbedInput) -> EmbedItem:
    if x.token_ids is not None:
        raise EmbedRefused("token-id inputs are not supported by this server: send the text",
                           i, "invalid_value")
    return EmbedItem(i, None, x.image, x.text, Path.cwd())
