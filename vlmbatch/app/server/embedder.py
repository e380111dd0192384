"""The ``Embedder`` the ``/v1/embeddings`` endpoint calls: our embedder
(``pipeline/embed.py``, the same pooling and prefix cache as ``vlmbatch embed``) run on the
server's engine thread (``Scheduler.call``), since no engine is thread-safe.

The embedding checkpoint may be the chat model itself or another one (``--embed-model``: by
default the built-in embedding model when the chat model is the built-in one); both run on
the one engine thread, embeddings before chat. Token-id inputs are refused (400): the
embedder builds its prompts from text.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from vlmbatch.app.server.embeddings import Embeddings, EmbedInput, EmbedOptions, EmbedRefused
from vlmbatch.app.server.scheduler import Scheduler
from vlmbatch.pipeline.config import ConfigError, EmbedConfig
from vlmbatch.pipeline.embed import Embedder, build_embedder
from vlmbatch.pipeline.embed_drive import embed_group, prepare_embed_group
from vlmbatch.pipeline.engine import Engine
from vlmbatch.pipeline.records import Embedding, EmbedItem


class EngineEmbedder:
    def __init__(self, engine: Engine, scheduler: Scheduler, max_pixels: int) -> None:
        self.engine, self.scheduler, self.max_pixels = engine, scheduler, max_pixels
        self._by_dims: dict[int | None, Embedder] = {}
        # pooled vectors are the decoder's hidden size (a projection serves multi-vector only)
        self.dimensions = int(self._embedder(None).engine.model.spec.text.hidden)

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
        embedder = self._embedder(options.dimensions)

        def work() -> list[Embedding]:  # on the engine thread
            return embed_group(embedder, prepare_embed_group(items, embedder.image_plan,
                                                             self.max_pixels))

        out: list[Embedding] = self.scheduler.call(work).result()
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
