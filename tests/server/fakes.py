"""Stand-ins for the server's unit tests: an engine that answers without a model, an
embedding backend that returns known vectors, and a server on them in this process (uvicorn
in a thread on a free port of 127.0.0.1)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import uvicorn
import xxhash

from tests.waiting import wait_until
from vlmbatch.engine.base import Engine, EngineStats
from vlmbatch.engine.records import Request, Score
from vlmbatch.preprocessing.prepare import PreparedImage, TilingConfig
from vlmbatch.server.app import create_app
from vlmbatch.server.config import ServerConfig
from vlmbatch.server.state import ServerState
from vlmbatch.serving.embed import Embeddings, EmbedInput, EmbedOptions
from vlmbatch.serving.engines import LocalEngines
from vlmbatch.serving.errors import EmbedRefused


class FakeEngine(Engine):
    """Scores p_yes = 0.25 for every request; records each call's (images, questions);
    ``hold`` blocks the call whose questions include ``hold_on`` until it is set. Counts
    7 prompt tokens a request, 2 of them prefilled when its (image, question) was asked
    before (a prefix cache's 5 cached tokens), else all 7."""

    def __init__(self) -> None:
        self.image_plan = TilingConfig(tile_size=16, max_tiles=1, use_thumbnail=False)
        self.stats = EngineStats()
        self.seen: set[tuple[str, str]] = set()
        self.calls: list[tuple[list[str], list[str]]] = []
        self.hold, self.hold_on, self.entered = threading.Event(), "", threading.Event()

    def score(self, images: list[PreparedImage], requests: list[Request]) -> list[Score]:
        qs = [r.question for r in requests]
        self.calls.append(([im.cache_key for im in images], qs))
        for r in requests:
            key = (images[r.image].cache_key, r.question)
            self.stats.prompt_tokens += 7
            self.stats.prefill_tokens += 2 if key in self.seen else 7
            self.seen.add(key)
        if self.hold_on in qs:
            self.entered.set()
            self.hold.wait(10)
        if "boom" in qs:
            raise RuntimeError("the engine broke")
        return [Score(0.25, -1.0, 1, None, 7) for _ in requests]


def picture(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (20, 20, 3), dtype=np.uint8)


class FakeEmbedBackend:
    """Vector i of a call: a fixed random unit vector per input, truncated to ``dimensions``
    and re-normalised; a text's tokens are its length + 2, an image's 16. Records calls.
    Refuses a text containing "REFUSE" (as a real one refuses one over the token limit)."""
    dimensions = 8

    def __init__(self) -> None:
        self.calls: list[tuple[list[EmbedInput], EmbedOptions]] = []

    def vector(self, x: EmbedInput, dims: int) -> np.ndarray:
        key = (x.text or "").encode() + (x.image or b"") + str(x.token_ids).encode()
        v = np.random.default_rng(xxhash.xxh64_intdigest(key)).standard_normal(self.dimensions)
        v = v[:dims]
        return (v / np.linalg.norm(v)).astype(np.float32)

    def __call__(self, inputs: Sequence[EmbedInput], options: EmbedOptions) -> Embeddings:
        self.calls.append((list(inputs), options))
        for i, x in enumerate(inputs):
            if x.text and "REFUSE" in x.text:
                raise EmbedRefused(f"input {i} is over {options.max_input_tokens} tokens", i,
                                   "context_length_exceeded")
        dims = options.dimensions or self.dimensions
        tokens = [16 if x.image else len(x.token_ids or ()) or len(x.text or "") + 2
                  for x in inputs]
        return Embeddings(np.stack([self.vector(x, dims) for x in inputs]), tokens)


@contextmanager
def fake_server(cfg: ServerConfig, embedder: FakeEmbedBackend | None = None
                ) -> Iterator[tuple[str, FakeEngine]]:
    """(base URL, engine) of a server on a FakeEngine, running until the block ends."""
    engine = FakeEngine()
    app = create_app(ServerState.build(cfg, LocalEngines(engine, cfg.serving),
                                       embeddings=embedder))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=cfg.port,
                                           log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    wait_until(lambda: server.started, 20, "the in-process server started", interval=0.02)
    try:
        yield f"http://127.0.0.1:{cfg.port}", engine
    finally:
        server.should_exit = True
        t.join(20)
