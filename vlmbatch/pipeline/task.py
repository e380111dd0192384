"""What the drive loop does with a group of items, as one typed interface: ``Task[I, R]``,
and the two tasks of this layer (``AnswerTask``: yes/no questions; ``EmbedTask``: vectors).

Every way in (a run, a job in-process or on Ray, a server batch, the Python API, ``embed``,
``eval``) drives items through the same two stages (``pipeline/drive.py``)::

    stage 1 (CPU, generic)   each item's image (``Task.image``: an ``ImageRef`` or None) read,
                             decoded and prepared with the engine's image plan -> Prepared[I]
                             (an unreadable or undecodable image is that item's ItemError)
    stage 2 (the model)      Task.run(engine, prepared) -> one list of results per item

A task differs from another only in what its items are, which image an item names, what the
model computes for a group and what a failed item's results are. Tasks are small frozen
records: a Ray prepare task or model actor receives them pickled, and this module (which
imports no torch, no decoder: a job folder's readers load it too) is all a prepare worker
loads of them. ``jobs/`` adds its own task (OpenAI
``/v1/embeddings`` requests, ``inputs/openai_embeddings.py``) and how each kind of item is stored.

Invariant: ``run`` and ``failed`` give, for each item, its results (``Answer`` per question,
one ``Embedding``, ...), each failed result carrying ``error`` and ``error_kind``; a job
records an item done iff none of its results has an error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from vlmbatch.engine.records import EmbedRequest, MediaItem
from vlmbatch.pipeline.hooks import Named
from vlmbatch.pipeline.media_inputs import SamplingKeys, VideoInput
from vlmbatch.pipeline.parts import PartedItem, run_answers
from vlmbatch.pipeline.records import (
    Answer,
    Embedding,
    EmbedItem,
    ErrorKind,
    ImageItem,
    ItemError,
    ItemMedia,
    request_of,
)
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.video_source import VideoSource

if TYPE_CHECKING:
    from vlmbatch.engine.base import Engine
    from vlmbatch.engine.config import EmbedConfig
    from vlmbatch.engine.records import Item
    from vlmbatch.preprocessing.video_plan import VideoPlan

I = TypeVar("I", bound=Named)  # noqa: E741  (an item)
R = TypeVar("R")  # a result


@dataclass(frozen=True)
class ImageRef:
    """The image stage 1 reads for an item: a path (relative to ``base_dir``), a ``file://``
    or ``data:`` URL, encoded bytes, or decoded uint8 RGB pixels ``[H, W, 3]``; or several
    (``ImageList``), or a clip: a ``VideoSource`` (its plan bound by the task: ``AnswerTask``),
    a ``VideoInput`` where the engine takes no clips (that item's error)."""
    image: ItemMedia | VideoSource
    base_dir: Path
    source: str  # how messages name it


@dataclass
class Prepared(Generic[I]):
    """Stage 1 of a group: ``images[i]`` is item i's prepared image (or ``MediaItem``: several
    images, a clip), None when it needs none or when it failed, and then ``errors`` holds
    why, by ``Task.key``."""
    items: list[I]
    images: list[Item | None]
    errors: dict[str, ItemError] = field(default_factory=dict)


class Task(ABC, Generic[I, R]):
    """One kind of work over items of type ``I`` giving results of type ``R``."""

    name: str

    @abstractmethod
    def key(self, item: I) -> str:
        """The item's id, unique in a run (what errors and a job store key it by)."""

    @abstractmethod
    def image(self, item: I) -> ImageRef | None:
        """The image stage 1 prepares for the item; None: it needs none."""

    @abstractmethod
    def run(self, engine: Engine, p: Prepared[I]) -> list[list[R]]:
        """Stage 2 of a group on ``engine``: each item's results, in item order (an item with
        an error in ``p.errors`` gets ``failed`` results). May raise: the drive loop then
        fails the group's items with kind ``engine``."""

    @abstractmethod
    def failed(self, item: I, err: ItemError) -> list[R]:
        """The item's results when it could not be prepared or answered."""

    def with_video(self, plan: VideoPlan | None, run: SamplingKeys) -> Task[I, R]:
        """This task preparing clips by the engine's ``plan`` under the run's sampling keys
        (``run``; a line's win); the same task where it takes no clips."""
        return self


def with_images(task: Task[I, R], p: Prepared[I]) -> tuple[list[Item], dict[str, int]]:
    """The group's prepared images, each once, and the index of each item's (by key)."""
    images: list[Item] = []
    index: dict[str, int] = {}
    for item, im in zip(p.items, p.images):
        if im is not None:
            index[task.key(item)] = len(images)
            images.append(im)
    return images, index


def stills(images: list[Item]) -> list[PreparedImage]:
    """``images``, each a still image (an embedding input's: its records hold one image)."""
    out = [im for im in images if isinstance(im, PreparedImage)]
    if len(out) != len(images):
        raise TypeError("an embedding input holds one image, not several or a clip")
    return out


@dataclass(frozen=True)
class AnswerTask(Task[ImageItem, Answer]):
    """Every question of every item (``vlmbatch run``/``submit``, the API's ``ask``, eval):
    one ``Answer`` per question (yes/no, or a label set's), in the item's order. ``video``:
    the engine's clip plan under the run's sampling keys (``with_video``); None: clips are
    their items' errors."""
    video: VideoPlan | None = None
    sampling: SamplingKeys = SamplingKeys()
    name = "answer"

    def key(self, item: ImageItem) -> str:
        return item.id

    def image(self, item: ImageItem) -> ImageRef:
        src: ItemMedia | VideoSource = item.image
        if isinstance(src, VideoInput) and self.video is not None:
            keys = src.sampling.over(self.sampling)
            src = VideoSource(src.source, self.video.with_sampling(
                keys.fps, keys.num_frames, keys.max_frames, keys.max_video_tokens
            ).with_windows(keys.segment_seconds, keys.segment_stride))
        return ImageRef(src, item.base_dir, item.source)

    def with_video(self, plan: VideoPlan | None, run: SamplingKeys) -> AnswerTask:
        return replace(self, video=plan, sampling=run)

    def run(self, engine: Engine, p: Prepared[ImageItem]) -> list[list[Answer]]:
        if any(isinstance(im, PartedItem) for im in p.images):  # windows, images alone
            return run_answers(engine, p.items, p.images, p.errors)
        images, index = with_images(self, p)
        p = over_context(engine, p, images, index)  # the items it failed leave ``index``
        requests = [request_of(index[it.id], q) for it in p.items if it.id in index
                    for q in it.questions]
        scores = iter(engine.score(images, requests))
        return [[Answer.scored(it.id, q, next(scores)).seen(images[index[it.id]])
                 for q in it.questions] if it.id in index
                else self.failed(it, p.errors[it.id]) for it in p.items]

    def failed(self, item: ImageItem, err: ItemError) -> list[Answer]:
        return [Answer.failed(item.id, q, err) for q in item.questions]


def over_context(engine: Engine, p: Prepared[ImageItem], images: list[Item],
                 index: dict[str, int]) -> Prepared[ImageItem]:
    """``p`` with each item holding several parts or a clip (``MediaItem``) whose prompt for
    some question would not fit the model's context (``Engine.context_error``) failed as
    ``too_large``, and taken out of ``index``; still images are not checked (their tokens
    are bounded by the image plan)."""
    errors = dict(p.errors)
    for it in p.items:
        k = index.get(it.id)
        if k is None or not isinstance(images[k], MediaItem):
            continue
        why = next((m for q in it.questions
                    if (m := engine.context_error(images[k], request_of(k, q)))), None)
        if why is not None:
            del index[it.id]
            errors[it.id] = ItemError(ErrorKind.TOO_LARGE, why)
    return p if errors == p.errors else replace(p, errors=errors)


@dataclass(frozen=True)
class EmbedTask(Task[EmbedItem, Embedding]):
    """One vector (or one per token) per input: an image, a text or both (``vlmbatch
    embed``, the API's ``embed_many``, ``submit --task embed``), as ``cfg`` says."""
    cfg: EmbedConfig
    name = "embed"

    def key(self, item: EmbedItem) -> str:
        return item.key

    def image(self, item: EmbedItem) -> ImageRef | None:
        return None if item.image is None else ImageRef(item.image, item.base_dir, item.source)

    def run(self, engine: Engine, p: Prepared[EmbedItem]) -> list[list[Embedding]]:
        images, index = with_images(self, p)
        todo = [it for it in p.items if it.image is None or it.key in index]
        requests = [EmbedRequest(None if it.image is None else index[it.key], it.text)
                    for it in todo]
        vectors = dict(zip((it.key for it in todo),
                           engine.embed(stills(images), requests, self.cfg)))
        return [[Embedding.of(it, vectors[it.key])] if it.key in vectors
                else self.failed(it, p.errors[it.key]) for it in p.items]

    def failed(self, item: EmbedItem, err: ItemError) -> list[Embedding]:
        return [Embedding.failed(item, err)]
