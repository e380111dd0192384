"""The one drive loop: groups of items -> stage 1 (prepare) -> stage 2 (the model) -> a sink,
for any ``Task`` (``pipeline/task.py``), yielding per group.

    Drive(stages, groups, sink, cancelled, hooks)     the loop: for each group, in order,
        stages.results(groups)                         (items, results) from the executor:
            LocalStages: prepared_groups (stage 1 ahead: remote images, table rows and
                shard members through the fetch stage, many at once, their bytes to
                decoder processes under a deadline, or threads: pipeline/preparers.py)
                -> run_group (stage 2 here)
            jobs/ray_executor.py RayStages: prepare tasks -> model actors
        sink.write(items, results)                     e.g. a results file, a job store
        hooks.group_done(); yield; stop if cancelled() after this group

What every caller gets from this one loop (a run, a job in-process, on Ray or in the server,
the Python API, ``embed``, ``eval``):

- an unreadable, undecodable or over-sized image is that item's ``ItemError`` (kind
  ``source``, ``decode``, ``too_large``; a failed fetch is ``source`` with its reason: an
  HTTP status, a timeout, too many bytes, not found, access denied); with a
  ``decode_timeout`` a decoder that hangs or crashes is that item's ``decode_timeout`` /
  ``decoder_crashed``, never the caller's;
- an engine failure (out of memory, ...) fails that group's items with kind ``engine`` and
  the loop goes on (``run_group``);
- a group is written to the sink whole before the next one is, so an interrupted loop keeps
  whole groups; closing the loop (an exception, Ctrl-C, a consumer that stops) cancels the
  groups prepared ahead and stops the decoder processes; ``Drive.final`` says how it ended;
- memory stays bounded: at most ``ahead + 2`` groups' prepared images are alive at once;
  remote images are fetched further ahead, bytes only, ``fetch.concurrency`` items beyond
  them, so that that many fetches stay in flight while the model works (``Lookahead``).

This module imports no torch: a Ray prepare worker loads it (``prepare_task``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks, Named
from vlmbatch.pipeline.media_fetch import fetch_ahead, has_remote
from vlmbatch.pipeline.preparers import (
    PrepareWorkers,
    item_error,
    list_refused,
    outcome,
    prepare_hooked,
    preparer,
)
from vlmbatch.pipeline.records import Answer, ErrorKind, ImageItem, ItemError
from vlmbatch.pipeline.task import AnswerTask, ImageRef, Prepared, Task
from vlmbatch.preprocessing.decode import ImageError
from vlmbatch.preprocessing.fetch import Fetcher
from vlmbatch.preprocessing.limits import DEFAULT_MAX_PIXELS, FetchOptions
from vlmbatch.preprocessing.prepare import ImagePlan
from vlmbatch.preprocessing.sources import SourceError, is_remote

if TYPE_CHECKING:
    from vlmbatch.engine.base import Engine
    from vlmbatch.engine.records import Item

I = TypeVar("I", bound=Named)  # noqa: E741  (an item)
R = TypeVar("R")  # a result
GroupResults = tuple[list[I], list[list[R]]]  # a group's items and each item's results


# --- stage 1 -------------------------------------------------------------------------------

def _collect(task: Task[I, R], items: list[I],
             outcomes: list[Item | ItemError | None]) -> Prepared[I]:
    images = [None if isinstance(x, ItemError) else x for x in outcomes]
    errors = {task.key(it): x for it, x in zip(items, outcomes) if isinstance(x, ItemError)}
    return Prepared(items, images, errors)


def prepare_group(task: Task[I, R], items: list[I], plan: ImagePlan,
                  max_pixels: int = DEFAULT_MAX_PIXELS, hooks: FaultHooks = NO_HOOKS,
                  fetch: FetchOptions | Fetcher = FetchOptions()) -> Prepared[I]:
    """Stage 1 of one group: its remote images fetched at once (on ``fetch``, a caller's
    fetch stage, or one made for this group; a list's and a clip's too), then each decoded
    and prepared in this thread."""
    refs = [task.image(it) for it in items]
    with contextlib.ExitStack() as own:
        fetcher = fetch if isinstance(fetch, Fetcher) else own.enter_context(Fetcher(fetch))
        # every remote source at once: an image, a list's images, a clip (media_fetch.py)
        fetched = {i: fetch_ahead(r, fetcher) for i, r in enumerate(refs)
                   if r is not None and has_remote(r.image) and list_refused(r.image) is None}
        outcomes: list[Item | ItemError | None] = []
        for i, ref in enumerate(refs):
            try:
                if ref is not None and i in fetched:
                    ref = fetched[i]()
                outcomes.append(None if ref is None
                                else prepare_hooked(ref, plan, max_pixels, hooks))
            except (SourceError, ImageError) as e:
                outcomes.append(item_error(refs[i], e))  # type: ignore[arg-type]
    return _collect(task, items, outcomes)


def prepare_task(task: Task[I, R], items: list[I], plan: ImagePlan, max_pixels: int,
                 hooks: FaultHooks, fetch: FetchOptions = FetchOptions()
                 ) -> tuple[int, Prepared[I]]:
    """A Ray prepare task (``jobs/ray_executor.py``) with two return objects
    (``num_returns=2``): a small one the driver fetches to learn that the task succeeded, and
    the prepared group, which goes from the object store straight to a model actor without
    passing through the driver. Here, in a module whose imports are light, because a fresh
    worker imports it before the task's deadline starts to count its work."""
    for it in items:
        hooks.prepare(it)
    return len(items), prepare_group(task, items, plan, max_pixels, fetch=fetch)


def prepared_groups(task: Task[I, R], groups: Iterable[list[I]], plan: ImagePlan,
                    opts: PrepareOptions = PrepareOptions(), hooks: FaultHooks = NO_HOOKS,
                    workers: PrepareWorkers | None = None) -> Generator[Prepared[I], None, None]:
    """``groups`` prepared, in order (``PrepareOptions`` says where and how far ahead:
    ``Lookahead``). ``workers``: a caller's long-lived ``PrepareWorkers`` (made by ``preparer`` for
    the same plan and options: a Python API object, a server), used and left running; else
    one is made here and stopped at the end.

    ``groups`` is advanced in the calling thread only (it may read a SQLite store), and only
    when the caller asks for the next group. Closing the generator, or an exception, cancels
    what has not started (fetches included) and does not wait for what has (threads stuck on
    a hung mount die with the process; the decoder processes of a pool made here are
    killed)."""
    pool = workers or preparer(plan, opts, hooks)
    if pool is None:
        with Fetcher(opts.fetch) as fetcher:
            for items in groups:
                yield prepare_group(task, items, plan, opts.max_pixels, hooks, fetcher)
        return
    window = Lookahead(task, pool, opts)
    source = iter(groups)
    try:
        while (head := window.head(source)) is not None:
            done = [None if f is None else outcome(r, f)  # type: ignore[arg-type]
                    for r, f in zip(head.refs, head.prepared or (), strict=True)]
            window.queue.popleft()
            yield _collect(task, head.items, done)
    finally:
        window.cancel()
        if workers is None:
            pool.stop()


@dataclasses.dataclass
class Taken(Generic[I]):
    """A group taken from the source: each item's image (None: it needs none), the future of
    its bytes (a remote image: read from when the group is taken, else None) and, once the
    group is in the decode window, the future of its ``PreparedImage``."""
    items: list[I]
    refs: list[ImageRef | None]
    fetched: list[Future | None]
    prepared: list[Future | None] | None = None


class Lookahead(Generic[I]):
    """Stage 1's look-ahead: the first ``ahead + 1`` groups taken (the one the caller gets
    next, and ``ahead`` behind it while the model answers it) are in the decode window,
    their images submitted to the workers; behind them, while the last group taken had a
    remote image, groups are taken until they hold ``fetch.concurrency`` items, whose remote
    images are fetched (bytes only) so that that many reads stay in flight, their decoding
    left until they reach the window. Bounded: prepared images of ``ahead + 2`` groups
    alive at once (as for local files: the caller's previous one until it lets go), fetched
    bytes of at most ``ahead + 1`` groups and, behind them, fewer than ``fetch.concurrency``
    items and one group more (each image at most ``fetch.max_bytes``: a larger one is
    refused unread)."""

    def __init__(self, task: Task[I, R], pool: PrepareWorkers, opts: PrepareOptions) -> None:
        self.task, self.pool = task, pool
        self.decoding = (opts.ahead if opts.threads else 0) + 1
        self.fetching = opts.fetch.concurrency
        self.queue: deque[Taken[I]] = deque()
        self.remote = False  # the last group taken had a remote image: fetch further ahead

    def head(self, source: Iterator[list[I]]) -> Taken[I] | None:
        """The first group (``queue[0]``, its images submitted to the workers), after
        taking more from ``source`` as far as the windows allow; None when all are done."""
        while self._wants_more() and (items := next(source, None)) is not None:
            self.queue.append(self._take(items))
        for g in itertools.islice(self.queue, self.decoding):
            if g.prepared is None:
                g.prepared = [None if r is None else self.pool.submit(r, f)
                              for r, f in zip(g.refs, g.fetched, strict=True)]
        return self.queue[0] if self.queue else None

    def _wants_more(self) -> bool:
        if len(self.queue) < self.decoding:
            return True
        behind = itertools.islice(self.queue, self.decoding, None)
        return self.remote and sum(len(g.items) for g in behind) < self.fetching

    def _take(self, items: list[I]) -> Taken[I]:
        refs = [self.task.image(it) for it in items]
        fetched = [self.pool.fetch(r) if r is not None and is_remote(r.image) else None
                   for r in refs]
        self.remote = any(f is not None for f in fetched)
        return Taken(items, refs, fetched)

    def cancel(self) -> None:
        """Cancel what has not started, in every group still queued."""
        for g in self.queue:
            for f in (*g.fetched, *(g.prepared or ())):
                if f is not None:
                    f.cancel()


# --- stage 2 and the loop -------------------------------------------------------------------

def run_group(task: Task[I, R], engine: Engine, p: Prepared[I]) -> list[list[R]]:
    """Stage 2 of a group: each item's results; an engine failure (e.g. out of memory) fails
    the group's items that had not failed already, with kind ``engine``."""
    try:
        return task.run(engine, p)
    except Exception as e:  # noqa: BLE001  (fail this group, not the run)
        keys = [task.key(it) for it in p.items]
        print(f"vlmbatch: engine failed on items {keys}: {type(e).__name__}: {e}",
              file=sys.stderr)
        err = ItemError(ErrorKind.ENGINE, f"engine failed: {type(e).__name__}: {e}")
        return [task.failed(it, p.errors.get(task.key(it), err)) for it in p.items]


class Stages(Protocol[I, R]):
    """Where the two stages run: each group's (items, results), in the groups' order.
    Closing the generator stops the work in flight."""

    def results(self, groups: Iterable[list[I]]) -> Generator[GroupResults[I, R], None, None]: ...


class Sink(Protocol[I, R]):
    def write(self, items: list[I], results: list[list[R]]) -> None:
        """Take one group's results (each item's, in order), whole."""


class LocalStages(Generic[I, R]):
    """Stage 1 on this machine (``prepared_groups``, on ``workers`` if given), stage 2 in
    this process."""

    def __init__(self, task: Task[I, R], engine: Engine, opts: PrepareOptions,
                 hooks: FaultHooks = NO_HOOKS, workers: PrepareWorkers | None = None) -> None:
        plan = engine.video_plan
        if plan is not None:  # the run's length limit (--max-video-seconds)
            plan = dataclasses.replace(plan, max_seconds=opts.max_video_seconds)
        self.task = task.with_video(plan, opts.sampling)
        self.engine, self.opts, self.hooks = engine, opts, hooks
        self.workers = workers

    def results(self, groups: Iterable[list[I]]) -> Generator[GroupResults[I, R], None, None]:
        prepared = prepared_groups(self.task, groups, self.engine.image_plan, self.opts,
                                   self.hooks, self.workers)
        try:
            for p in prepared:
                yield p.items, run_group(self.task, self.engine, p)
        finally:
            prepared.close()  # stops the decoder processes or threads


class Drive(Generic[I, R]):
    """The loop (module docstring). Iterate it to run it; ``final`` is then ``done``,
    ``cancelled`` (``cancelled()`` was true after a group) or ``interrupted`` (an exception,
    or the consumer stopped early)."""

    def __init__(self, stages: Stages[I, R], groups: Iterable[list[I]],
                 sink: Sink[I, R] | None = None, cancelled: Callable[[], bool] | None = None,
                 hooks: FaultHooks = NO_HOOKS) -> None:
        self.stages, self.groups, self.sink, self.hooks = stages, groups, sink, hooks
        self.cancelled = cancelled or (lambda: False)
        self.final = "interrupted"  # until the loop ends by itself

    def __iter__(self) -> Iterator[GroupResults[I, R]]:
        results = self.stages.results(self.groups)
        try:
            while not self.cancelled():  # before each group's model work
                done = next(results, None)
                if done is None:
                    self.final = "done"
                    return
                if self.sink is not None:
                    self.sink.write(*done)
                self.hooks.group_done()
                yield done
            self.final = "cancelled"
        finally:
            results.close()  # what is in flight is dropped (a job's items stay pending)


def drive(task: Task[I, R], engine: Engine, groups: Iterable[list[I]],
          opts: PrepareOptions = PrepareOptions(), sink: Sink[I, R] | None = None,
          cancelled: Callable[[], bool] | None = None, hooks: FaultHooks = NO_HOOKS,
          workers: PrepareWorkers | None = None) -> Drive[I, R]:
    """The loop with both stages on this machine (``LocalStages``)."""
    return Drive(LocalStages(task, engine, opts, hooks, workers), groups, sink, cancelled,
                 hooks)


def groups_of(items: Iterable[I], n: int) -> Iterator[list[I]]:
    """``items`` in lists of ``n`` (the last one shorter), streamed."""
    group: list[I] = []
    for it in items:
        group.append(it)
        if len(group) == n:
            yield group
            group = []
    if group:
        yield group


def answer_group(engine: Engine, items: list[ImageItem],
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> list[Answer]:
    """One group's answers, in item then question order, both stages in this thread (a
    calibration pass, a benchmark row)."""
    task = AnswerTask(engine.video_plan)
    p = prepare_group(task, items, engine.image_plan, max_pixels)
    return [a for answers in run_group(task, engine, p) for a in answers]
