"""The HTTP process's handle on the engines: where a prepared request goes to be answered.

``Engines`` is what the routes call (``submit`` a chat question, ``embed`` a prepared
group, ``enqueue_batch``/``cancel_batch``), with two layouts behind it:

- ``EngineProcesses`` (``processes.py``; ``--engines N``, N >= 1, the default 1): N
  engine processes, each with its own engine thread, reached over a channel;
- ``LocalEngines`` (here; ``--engines 0``): the engine thread in the HTTP process itself
  (the layout before the split; tests on stand-in engines use it).

Either tells ``BatchEvents`` (``bind``) what becomes of each batch it was given.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vlmbatch.engine.base import Engine
from vlmbatch.engine.records import Item, Score
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.questions import Question
from vlmbatch.pipeline.records import Embedding, EmbedItem
from vlmbatch.pipeline.task import Prepared
from vlmbatch.preprocessing.prepare import ImagePlan
from vlmbatch.serving.config import ServingConfig
from vlmbatch.serving.embed import embed_dims, embed_prepared
from vlmbatch.serving.messages import Counters
from vlmbatch.serving.scheduler import BatchEvents, Scheduler

if TYPE_CHECKING:
    from vlmbatch.preprocessing.video_plan import VideoPlan


@dataclass
class EngineView:
    """One engine as ``/metrics`` shows it."""
    index: int
    up: bool
    outstanding: int  # requests sent, not answered
    batches: int  # batches it runs or has queued
    stats: Counters = field(default_factory=Counters)  # its engine thread's counters


class Engines(ABC):
    image_plan: ImagePlan  # how the chat engine's images are prepared (the HTTP side does)
    embed_plan: ImagePlan | None = None  # the embedding engine's (None: no embeddings)
    video_plan: VideoPlan | None = None  # how the chat engine's clips are (None: no clips)
    embed_dims: int | None = None  # a pooled embedding's full size
    restarts: int = 0  # engine processes started again after one died
    base: Counters  # counters of engine processes that have died (metrics add them)

    @abstractmethod
    def bind(self, events: BatchEvents) -> None:
        """Where batch events go (before ``start``)."""

    @abstractmethod
    def arriving(self) -> AbstractContextManager[None]:
        """A context manager around a request's parsing and image preparation."""

    @abstractmethod
    def submit(self, question: Question, image: Item) -> Future[Score]:
        """``question`` about ``image``, answered in the future (an ``APIError`` there or
        here: 429 queue full, 503 no engine up)."""

    def ask(self, question: Question, image: Item) -> asyncio.Future[Score]:
        """``submit`` from the event loop (called on its thread): the answer as the loop's
        own future."""
        return asyncio.wrap_future(self.submit(question, image))

    @abstractmethod
    def embed(self, dims: int | None, p: Prepared[EmbedItem]
              ) -> Future[list[list[Embedding]]]:
        """A prepared group of embedding inputs, each item's results in the future."""

    @abstractmethod
    def enqueue_batch(self, batch_id: str, job: Path) -> None:
        """Run the batch's job (``job``: its folder) after those queued."""

    @abstractmethod
    def cancel_batch(self, batch_id: str) -> bool:
        """Stop the batch between groups; False when no engine holds it (the caller then
        finalizes it)."""

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self, timeout: float) -> None:
        """Answer what is queued, end each running job's group, leave the jobs resumable."""

    @abstractmethod
    def views(self) -> list[EngineView]: ...


class LocalEngines(Engines):
    """``--engines 0``: the engine thread in this process, on engines built here."""

    def __init__(self, engine: Engine, cfg: ServingConfig, hooks: FaultHooks = NO_HOOKS,
                 embed_engine: Engine | None = None) -> None:
        self.engine, self.cfg, self.hooks, self.embed_engine = engine, cfg, hooks, embed_engine
        self.image_plan, self.video_plan = engine.image_plan, engine.video_plan
        self.base = Counters()
        if embed_engine is not None:
            self.embed_plan, self.embed_dims = embed_engine.image_plan, embed_dims(embed_engine)

    def bind(self, events: BatchEvents) -> None:
        self.scheduler = Scheduler(self.engine, self.cfg, events, self.hooks,
                                   embed_engine=self.embed_engine)

    def arriving(self) -> AbstractContextManager[None]:
        return self.scheduler.arriving()

    def submit(self, question: Question, image: Item) -> Future[Score]:
        return self.scheduler.submit(question, image)

    def embed(self, dims: int | None, p: Prepared[EmbedItem]
              ) -> Future[list[list[Embedding]]]:
        engine = self.embed_engine
        assert engine is not None
        return self.scheduler.call(lambda: embed_prepared(engine, dims, p))

    def enqueue_batch(self, batch_id: str, job: Path) -> None:
        self.scheduler.enqueue_batch(batch_id, job)

    def cancel_batch(self, batch_id: str) -> bool:
        return self.scheduler.cancel_batch(batch_id)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self, timeout: float) -> None:
        self.scheduler.stop(timeout)

    def views(self) -> list[EngineView]:
        s = self.scheduler
        c = s.counters()
        return [EngineView(0, s.thread.is_alive(), c.depth, len(s._owned), c)]
