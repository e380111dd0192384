"""The drive loop: items -> prepared groups -> one engine call per group -> ``Answer``s.

Stage 1 (CPU): each item of a group is read (``preprocessing.sources``), decoded and
prepared with the engine's image plan; a failure becomes that item's ``ItemError`` (with its
kind), never the group's. ``prepared_groups`` runs stage 1 ahead, on the next groups while
the model answers the current one: in decoder processes, each image under a deadline, so a
decoder that hangs or crashes fails that item only (``--decode-timeout``, the default), or on
threads of this process. Stage 2 (the model,
``score_group``): the group's questions go to the engine in one ``score`` call; an engine
failure (e.g. out of memory) fails that group's items with kind ``engine`` and the caller goes
on. ``jobs/`` (the in-process runner, the job store, Ray), ``evaluate.py``, ``quantize.py``
and the Python API all answer through these functions, so they behave alike.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Protocol

import numpy as np

from vlmbatch.pipeline.engine import Engine
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.records import Answer, ErrorKind, ImageItem, ItemError, Request
from vlmbatch.preprocessing.decode import DEFAULT_MAX_PIXELS, ImageError, ImageTooLarge
from vlmbatch.preprocessing.isolated import DecoderCrashed, DecoderPool, DecodeTimeout
from vlmbatch.preprocessing.prepare import ImagePlan, PreparedImage, prepare_bytes
from vlmbatch.preprocessing.sources import SourceError, read_bytes


@dataclass
class PreparedGroup:
    """Stage 1 of a group (CPU): each item's prepared image, or the reason it has none.

    ``images[i]`` is ``None`` exactly when ``errors`` holds ``group[i].id``."""
    group: list[ImageItem]
    images: list[PreparedImage | None]
    errors: dict[str, ItemError]


def prepare_item(item: ImageItem, plan: ImagePlan,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> PreparedImage:
    """Read, decode, prepare; raises SourceError or ImageError with the reason."""
    src = item.image
    if isinstance(src, np.ndarray):  # decoded pixels (the Python API)
        if src.ndim != 3 or src.shape[2] != 3 or src.dtype != np.uint8:
            raise ImageError(f"an image array must be uint8 RGB [H, W, 3], got {src.dtype} "
                             f"{list(src.shape)}")
        if src.shape[0] * src.shape[1] > max_pixels:
            raise ImageTooLarge(f"image is {src.shape[1]}x{src.shape[0]} pixels, over the "
                                f"limit of {max_pixels:,} (raise --max-pixels to allow it)")
        return plan.prepare(src)
    data = src if isinstance(src, bytes) else read_bytes(src, item.base_dir)
    return prepare_bytes(data, plan, max_pixels)


def item_error(item: ImageItem, e: SourceError | ImageError) -> ItemError:
    """Why ``item`` has no prepared image, with its kind."""
    kind = (ErrorKind.SOURCE if isinstance(e, SourceError) else
            ErrorKind.TOO_LARGE if isinstance(e, ImageTooLarge) else
            ErrorKind.DECODE_TIMEOUT if isinstance(e, DecodeTimeout) else
            ErrorKind.DECODER_CRASHED if isinstance(e, DecoderCrashed) else ErrorKind.DECODE)
    return ItemError(kind, f"{item.source}: {e}")


def _prepare_hooked(item: ImageItem, plan: ImagePlan, max_pixels: int,
                    hooks: FaultHooks) -> PreparedImage:
    hooks.prepare(item)
    return prepare_item(item, plan, max_pixels)


def _prepare_or_error(item: ImageItem, plan: ImagePlan, max_pixels: int,
                      hooks: FaultHooks = NO_HOOKS) -> PreparedImage | ItemError:
    """The item's prepared image, or why it has none (an unreadable or undecodable image)."""
    try:
        return _prepare_hooked(item, plan, max_pixels, hooks)
    except (SourceError, ImageError) as e:
        return item_error(item, e)


def _outcome(item: ImageItem, f: Future) -> PreparedImage | ItemError:
    try:
        return f.result()
    except (SourceError, ImageError) as e:
        return item_error(item, e)


def _collect(group: list[ImageItem], done: list[PreparedImage | ItemError]) -> PreparedGroup:
    images = [None if isinstance(d, ItemError) else d for d in done]
    errors = {it.id: d for it, d in zip(group, done) if isinstance(d, ItemError)}
    return PreparedGroup(group, images, errors)


def prepare_group(group: list[ImageItem], plan: ImagePlan,
                  max_pixels: int = DEFAULT_MAX_PIXELS,
                  hooks: FaultHooks = NO_HOOKS) -> PreparedGroup:
    return _collect(group, [_prepare_or_error(it, plan, max_pixels, hooks) for it in group])


def prepare_task(group: list, plan: ImagePlan, max_pixels: int, hooks: FaultHooks,
                 stage1: Callable[[list, ImagePlan, int], object] | None = None
                 ) -> tuple[int, object]:
    """A Ray prepare task (``jobs/ray_executor.py``) with two return objects
    (``num_returns=2``): a small one the driver fetches to learn that the task succeeded, and
    the tiles, which go from the object store straight to a model actor without passing
    through the driver. ``stage1``: the job's stage 1 (a module-level function, pickled by
    reference; default ``prepare_group``). Here, in a module whose imports are light,
    because a fresh worker imports it before the task's deadline starts to count its work
    (an embedding job's stage 1 imports more: ``pipeline/embed_drive.py``)."""
    for it in group:
        hooks.prepare(it)
    return len(group), (stage1 or prepare_group)(group, plan, max_pixels)


def prepared_groups(groups: Iterable[list[ImageItem]], plan: ImagePlan, max_pixels: int,
                    threads: int, ahead: int = 2, decode_timeout: float = 0.0,
                    hooks: FaultHooks = NO_HOOKS) -> Generator[PreparedGroup, None, None]:
    """``groups`` prepared, in order.

    ``decode_timeout > 0``: in ``max(threads, 1)`` decoder processes
    (``preprocessing.isolated.DecoderPool``), each image under that deadline; a hang or a
    crash is that item's error (``decode_timeout``, ``decoder_crashed``) and the rest go on.
    Otherwise in this process, with no deadline: ``threads == 0``, each group when asked
    for, in this thread; else ``threads`` daemon threads (OpenCV and NumPy release the GIL).

    With threads or processes the items of the next ``ahead`` groups are prepared while the
    caller scores the current one (``threads == 0``: none ahead), so at most ``ahead + 2``
    groups' tiles are alive at once (the caller's previous one until it lets go). ``groups``
    is advanced in the calling thread only (it may read a SQLite store). Closing the
    generator, or an exception, cancels what has not started and does not wait for what has
    (threads stuck on a hung mount die with the process; decoder processes are killed)."""
    if threads == 0 and not decode_timeout > 0:
        for group in groups:
            yield prepare_group(group, plan, max_pixels, hooks)
        return
    source = iter(groups)
    pool: _Preparer = (_ProcessPreparer(max(threads, 1), plan, max_pixels, decode_timeout, hooks)
                       if decode_timeout > 0 else _ThreadPreparer(threads, plan, max_pixels, hooks))
    ahead = ahead if threads else 0
    queue: deque[tuple[list[ImageItem], list[Future]]] = deque()
    try:
        while True:
            while len(queue) <= ahead and (nxt := next(source, None)) is not None:
                queue.append((nxt, [pool.submit(it) for it in nxt]))
            if not queue:
                return
            group, futures = queue[0]
            done = [_outcome(it, f) for it, f in zip(group, futures)]
            queue.popleft()
            yield _collect(group, done)
    finally:
        for _, futures in queue:
            for f in futures:
                f.cancel()
        pool.stop()


class _Preparer(Protocol):
    def submit(self, item: ImageItem) -> Future: ...

    def stop(self) -> None: ...


class _ThreadPreparer:
    def __init__(self, threads: int, plan: ImagePlan, max_pixels: int,
                 hooks: FaultHooks) -> None:
        self.pool = _DaemonPool(threads)
        self.args = plan, max_pixels, hooks

    def submit(self, item: ImageItem) -> Future:
        return self.pool.submit(_prepare_hooked, item, *self.args)

    def stop(self) -> None:
        self.pool.stop()


class _ProcessPreparer:
    """Decoder processes for encoded images (paths, URLs, bytes); decoded pixels (the
    Python API's arrays) need no decoder and are tiled here, at once."""

    def __init__(self, workers: int, plan: ImagePlan, max_pixels: int, timeout_s: float,
                 hooks: FaultHooks) -> None:
        self.pool = DecoderPool(workers, plan, max_pixels, timeout_s, hooks.before_prepare)
        self.plan, self.max_pixels = plan, max_pixels

    def submit(self, item: ImageItem) -> Future:
        if not isinstance(item.image, np.ndarray):
            return self.pool.submit(item.image, item.base_dir)
        f: Future = Future()
        try:
            f.set_result(prepare_item(item, self.plan, self.max_pixels))
        except (SourceError, ImageError) as e:
            f.set_exception(e)
        return f

    def stop(self) -> None:
        self.pool.stop()


class _DaemonPool:
    """A few daemon threads running submitted calls, FIFO, each result in a ``Future``. Unlike
    ``ThreadPoolExecutor`` (whose threads Python joins at exit), a thread blocked in a read
    never keeps the process alive."""

    def __init__(self, threads: int) -> None:
        self.jobs: SimpleQueue = SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._work, name=f"vlmbatch-prepare-{i}",
                             daemon=True).start()
        self.threads = threads

    def submit(self, fn: Callable, *args: object) -> Future:
        f: Future = Future()
        self.jobs.put((f, fn, args))
        return f

    def stop(self) -> None:
        for _ in range(self.threads):
            self.jobs.put(None)

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            f, fn, args = job
            if not f.set_running_or_notify_cancel():
                continue  # cancelled before it started
            try:
                f.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001  (handed to whoever waits on f)
                f.set_exception(e)


def score_group(engine: Engine, pg: PreparedGroup) -> list[Answer]:
    """Stage 2 of a group (the model): its answers, in item then question order."""
    errors = dict(pg.errors)
    index: dict[str, int] = {}
    prepared: list[PreparedImage] = []
    for item, im in zip(pg.group, pg.images):
        if im is not None:
            index[item.id] = len(prepared)
            prepared.append(im)
    requests = [Request(index[it.id], q.text, q.max_new_tokens) for it in pg.group
                if it.id in index for q in it.questions]
    try:
        scores = iter(engine.score(prepared, requests))
    except Exception as e:  # noqa: BLE001  (e.g. out of memory: fail this group, not the job)
        print(f"vlmbatch: engine failed on images {[it.id for it in pg.group]}: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        failed = ItemError(ErrorKind.ENGINE, f"engine failed: {type(e).__name__}: {e}")
        errors.update({it_id: failed for it_id in index})
        index.clear()
        scores = iter(())
    answers = []
    for item in pg.group:
        for q in item.questions:
            if item.id in index:
                answers.append(Answer.scored(item.id, q, next(scores)))
            else:
                answers.append(Answer.failed(item.id, q, errors[item.id]))
    return answers


def answer_group(engine: Engine, group: list[ImageItem],
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> list[Answer]:
    """Answers for one group of items, in item then question order."""
    return score_group(engine, prepare_group(group, engine.image_plan, max_pixels))
