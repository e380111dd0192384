"""What a job does with its items: answer their questions, or embed them. The store, the
in-process runner (``jobs/job.py``) and the Ray executor (``jobs/ray_executor.py``) are the
same for both; a ``Task`` says what differs: how an item is stored, stage 1 (prepare a
group, CPU), stage 2 (the model: a group's results) and how results are keyed.

Invariant: stage 2 returns, for every item of the group, its results (one ``Answer`` per
question, or one ``Embedding``), each with an ``error`` that is None when it succeeded; the
store records an item ``done`` iff none of its results has an error.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

from vlmbatch.jobs import embed_input, embed_requests
from vlmbatch.jobs.config import RunConfig
from vlmbatch.jobs.embed_requests import EmbedRequestItem, PreparedRequests
from vlmbatch.jobs.errors import ManifestError
from vlmbatch.jobs.manifest import (
    first_line,
    items_from_folder,
    iter_manifest,
    manifest_format,
    read_policy,
)
from vlmbatch.jobs.store import Recorded, by_item, item_from_json, item_to_json
from vlmbatch.pipeline.config import ConfigError
from vlmbatch.pipeline.drive import PreparedGroup, prepare_group, prepared_groups, score_group
from vlmbatch.pipeline.embed import build_embedder, check_embed_config
from vlmbatch.pipeline.embed_drive import PreparedEmbedGroup, embed_group
from vlmbatch.pipeline.engine import Engine
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.records import Embedding, EmbedItem, ImageItem, ItemError
from vlmbatch.preprocessing.prepare import ImagePlan

Stage2 = Callable[[Any], list]  # a prepared group -> its results
Prepared = PreparedEmbedGroup | PreparedRequests  # stage 1 of an embedding job's group


class Task(ABC):
    name: str

    @abstractmethod
    def items(self, cfg: RunConfig) -> tuple[Iterator[tuple[str, Any]],
                                             Callable[[str], str] | None]:
        """(where, item) of the run's input, streamed, and for a manifest where a repeated id
        was first (called on that error only)."""

    def check(self, cfg: RunConfig) -> None:
        """Raise ConfigError for options the checkpoint cannot meet (at submit, before any
        work); the model folder itself is checked by the caller."""

    @abstractmethod
    def to_json(self, item: Any) -> str: ...

    @abstractmethod
    def from_json(self, text: str) -> Any: ...

    @abstractmethod
    def key(self, item: Any) -> str:
        """The item's id in the store (unique in a job)."""

    @abstractmethod
    def prepare(self, group: list, plan: ImagePlan, max_pixels: int) -> Any:
        """Stage 1 of a group."""

    @property
    @abstractmethod
    def stage1(self) -> Callable[[list, ImagePlan, int], Any]:
        """``prepare`` as a module-level function, for Ray prepare tasks (pickled by
        reference: the worker imports its module, so a light one is quicker to start)."""

    @abstractmethod
    def prepared(self, groups: Iterable[list], plan: ImagePlan, max_pixels: int,
                 threads: int, decode_timeout: float = 0.0,
                 hooks: FaultHooks = NO_HOOKS) -> Generator[Any, None, None]:
        """Stage 1 of a stream of groups, on preprocessing threads or, with a
        ``decode_timeout``, decoder processes (in-process runs; ``drive.prepared_groups``)."""

    @abstractmethod
    def failed(self, item: Any, err: ItemError) -> Any:
        """Stage 1's result for one item that could not be prepared."""

    @abstractmethod
    def model(self, engine: Engine, cfg: RunConfig) -> Stage2:
        """Stage 2 on ``engine`` (checks the run's task options against its checkpoint)."""

    @abstractmethod
    def by_item(self, results: list) -> dict[str, list[Recorded]]:
        """A group's results keyed by item id (``JobStore.record``)."""


class AnswerTask(Task):
    """Yes/no questions about images (``vlmbatch run``/``submit``)."""
    name = "answer"

    def items(self, cfg: RunConfig) -> tuple[Iterator[tuple[str, Any]],
                                             Callable[[str], str] | None]:
        policy = read_policy(cfg.policy) if cfg.policy else ()
        manifest = cfg.manifest
        if manifest is not None:
            def first(item_id: str) -> str:
                return f"line {first_line(manifest, item_id, policy)}"

            return ((f"{manifest}:{ln}", it) for ln, it in iter_manifest(manifest, policy)), \
                first
        assert cfg.images is not None
        return ((str(cfg.images), it) for it in items_from_folder(cfg.images, policy)), None

    def to_json(self, item: ImageItem) -> str:
        return item_to_json(item)

    def from_json(self, text: str) -> ImageItem:
        return item_from_json(text)

    def key(self, item: ImageItem) -> str:
        return item.id

    def prepare(self, group: list, plan: ImagePlan, max_pixels: int) -> PreparedGroup:
        return prepare_group(group, plan, max_pixels)

    @property
    def stage1(self) -> Callable[[list, ImagePlan, int], PreparedGroup]:
        return prepare_group

    def prepared(self, groups: Iterable[list], plan: ImagePlan, max_pixels: int,
                 threads: int, decode_timeout: float = 0.0,
                 hooks: FaultHooks = NO_HOOKS) -> Generator[PreparedGroup, None, None]:
        return prepared_groups(groups, plan, max_pixels, threads,
                               decode_timeout=decode_timeout, hooks=hooks)

    def failed(self, item: ImageItem, err: ItemError) -> PreparedGroup:
        return PreparedGroup([item], [None], {item.id: err})

    def model(self, engine: Engine, cfg: RunConfig) -> Stage2:
        return lambda pg: score_group(engine, pg)

    def by_item(self, results: list) -> dict[str, list[Recorded]]:
        return dict(by_item(results))  # type: ignore[arg-type]


class EmbedTask(Task):
    """One embedding per item (``submit --task embed``), or, for an OpenAI batch file of
    ``/v1/embeddings`` requests, one item per request holding its strings
    (``jobs/embed_requests.py``)."""
    name = "embed"

    def items(self, cfg: RunConfig) -> tuple[Iterator[tuple[str, Any]],
                                             Callable[[str], str] | None]:
        manifest = cfg.manifest
        if manifest is not None and manifest_format(manifest) == "openai":
            def first_request(item_id: str) -> str:
                lines = embed_requests.iter_embed_requests(manifest)
                return f"line {next(ln for ln, r in lines if r.custom_id == item_id)}"

            return ((f"{manifest}:{ln}", r)
                    for ln, r in embed_requests.iter_embed_requests(manifest)), first_request
        if manifest is not None:
            def first(item_id: str) -> str:
                lines = embed_input.iter_embed_manifest(manifest)
                return f"line {next(ln for ln, it in lines if it.key == item_id)}"

            return ((f"{manifest}:{ln}", it)
                    for ln, it in embed_input.iter_embed_manifest(manifest)), first
        assert cfg.images is not None
        return ((str(cfg.images), it) for it in embed_input.folder_items(cfg.images)), None

    def check(self, cfg: RunConfig) -> None:
        resolved = check_embed_config(cfg.model.path, cfg.embed)
        manifest = cfg.manifest
        if manifest is None or manifest_format(manifest) != "openai":
            return
        # a file of /v1/embeddings requests: what the server's batches check (one pooled
        # vector per string, each request's dimensions one of the model's sizes)
        if cfg.embed.multi_vector or cfg.embed.dimensions is not None:
            raise ConfigError("a file of /v1/embeddings requests gives one vector per string, "
                              "at each request's body.dimensions: --multi-vector and "
                              "--dimensions do not apply to it")
        sizes = resolved.spec.matryoshka_dims
        for ln, r in embed_requests.iter_embed_requests(manifest):
            if r.dimensions is not None and r.dimensions not in sizes:
                have = (f"declares the sizes {list(sizes)}: give one of them" if sizes
                        else "declares no Matryoshka sizes")
                raise ManifestError(f"{manifest}:{ln}: body.dimensions {r.dimensions}: the "
                                    f"model {have}, or leave dimensions out for its full size")

    def to_json(self, item: EmbedItem | EmbedRequestItem) -> str:
        if isinstance(item, EmbedRequestItem):
            return item.to_json()
        return embed_input.item_to_json(item)

    def from_json(self, text: str) -> EmbedItem | EmbedRequestItem:
        if embed_requests.is_request_json(text):
            return EmbedRequestItem.from_json(text)
        return embed_input.item_from_json(text)

    def key(self, item: EmbedItem | EmbedRequestItem) -> str:
        return item.custom_id if isinstance(item, EmbedRequestItem) else item.key

    def prepare(self, group: list, plan: ImagePlan, max_pixels: int) -> Prepared:
        return embed_requests.prepare_items(group, plan, max_pixels)

    @property
    def stage1(self) -> Callable[[list, ImagePlan, int], Prepared]:
        return embed_requests.prepare_items

    def prepared(self, groups: Iterable[list], plan: ImagePlan, max_pixels: int,
                 threads: int, decode_timeout: float = 0.0,
                 hooks: FaultHooks = NO_HOOKS) -> Generator[Prepared, None, None]:
        return embed_requests.prepared_items(groups, plan, max_pixels, threads,
                                             decode_timeout, hooks)

    def failed(self, item: EmbedItem | EmbedRequestItem, err: ItemError) -> Prepared:
        if isinstance(item, EmbedRequestItem):
            return embed_requests.failed_request(item, err)
        return PreparedEmbedGroup.failed(item, err)

    def model(self, engine: Engine, cfg: RunConfig) -> Stage2:
        embedder = build_embedder(engine, cfg.embed)
        # /v1/embeddings requests: one pooled vector per string, whatever the checkpoint's
        # default (a ColQwen2 one is multi-vector)
        pooled = build_embedder(engine, dataclasses.replace(cfg.embed, multi_vector=False))

        def stage2(p: Prepared) -> list[Embedding]:
            if isinstance(p, PreparedRequests):
                return embed_requests.request_results(p, embed_group(pooled, p.inputs))
            return embed_group(embedder, p)

        return stage2

    def by_item(self, results: list) -> dict[str, list[Recorded]]:
        """Keyed by id (a request's strings share its ``custom_id``), else index."""
        out: dict[str, list[Recorded]] = {}
        for e in results:
            out.setdefault(e.id if e.id is not None else str(e.index), []).append(e)
        return out


_BY_NAME: dict[str, Task] = {t.name: t for t in (AnswerTask(), EmbedTask())}


def task_named(name: str) -> Task:
    """The task called ``name`` (one of ``jobs.config.TASKS``)."""
    return _BY_NAME[name]


def task_of(cfg: RunConfig) -> Task:
    """The run's task (``RunConfig.task``)."""
    return task_named(cfg.task)

