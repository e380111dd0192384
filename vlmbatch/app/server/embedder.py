"""The ``Embedder`` the ``/v1/embeddings`` endpoint calls: the drive loop's two stages
(``pipeline/drive.py`` with ``pipeline.task.EmbedTask``: the same pooling and prefix cache as
``vlmbatch embed``): images decoded in the server's decoder processes for the embedding
model's plan (under ``--decode-timeout``) while the request's worker thread waits, then the
model on the server's engine thread (``Scheduler.call``), since no engine is thread-safe.

The embedding checkpoint may be the chat model itself or another one (``--embed-model``: by
default the built-in embedding model when the chat model is the built-in one); both run on
the one engine thread, embeddings before chat. Token-id inputs are refused (400): the
embedder builds its prompts from text.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import closing
from pathlib import Path

import numpy as np

from vlmbatch.app.server.embeddings import Embeddings, EmbedInput, EmbedOptions, EmbedRefused
from vlmbatch.app.server.scheduler import Scheduler
from vlmbatch.pipeline.config import ConfigError, EmbedConfig, PrepareOptions
from vlmbatch.pipeline.drive import Preparer, prepared_groups, run_group
from vlmbatch.pipeline.embed import Embedder, build_embedder
from vlmbatch.pipeline.engine import Engine
from vlmbatch.pipeline.records import Embedding, EmbedItem
from vlmbatch.pipeline.task import EmbedTask


class EngineEmbedder:
    def __init__(self, engine: Engine, scheduler: Scheduler, opts: PrepareOptions,
                 workers: Preparer | None) -> None:
        self.engine, self.scheduler, self.opts, self.workers = engine, scheduler, opts, workers
        self._by_dims: dict[int | None, Embedder] = {}
        # pooled vectors are the decoder's hidden size (a projection serves multi-vector only)
        self.dimensions = self._embedder(None).resolved.hidden

    def _embedder(self, dims: int | None) -> Embedder:
        if dims not in self._by_dims:  # built once per size (a Matryoshka size is checked)
            try:
                self._by_dims[dims] = build_embedder(  # pooled, whatever the checkpoint's default
                    self.engine, EmbedConfig(dimensions=dims, multi_vector=False))
            except ConfigError as e:
                raise EmbedRefused(str(e), None) from None
        return self._by_dims[dims]

    def __call__(self, inputs: Sequence[EmbedInput], options: EmbedOptions) -> Embeddings:
        items = [_item(i, x) for i, x in enumerate(inputs)]
        task = EmbedTask(self._embedder(options.dimensions).cfg)
        with closing(prepared_groups(task, [items], self.engine.image_plan, self.opts,
                                     workers=self.workers)) as stage1:
            p = next(stage1)  # decoded here, on the request's thread

        def work() -> list[list[Embedding]]:  # on the engine thread
            return run_group(task, self.engine, p)

        out = [e for per_item in self.scheduler.call(work).result() for e in per_item]
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
