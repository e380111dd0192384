"""In-process job runner: items -> preprocess -> engine -> JSONL (or CSV) results, with progress.

``run(config)`` validates every input before loading the model, then takes items in groups of
``images_per_batch``: each image is read, decoded and tiled (a failure becomes that item's
error lines) by ``prepared_groups``, on preprocessing threads that work on the next groups
while the model answers this one; the group's questions are scored in one engine call, and
the results are written and flushed before the next group's are. ``jobs/ray_executor.py``
runs the same stages on Ray, over the job store of ``jobs/store.py``.

Output line per (image, question)::

    {"id", "question_id", "question", "answer": "yes"|"no"|null, "p_yes", "margin",
     "image_tokens", "error": null | "message", "text" (only where the question's
     max_new_tokens, else --max-new-tokens, is > 0)}
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from queue import SimpleQueue
from typing import IO, Any

import torch
from tqdm import tqdm

from jobs.manifest import (
    ImageItem,
    items_from_folder,
    manifest_format,
    read_manifest,
    read_policy,
)
from jobs.sinks import format_of, line_writer, open_text
from jobs.sources import SourceError, read_bytes
from pipeline.config import RunConfig, preprocess_threads_for
from pipeline.engine import Request
from pipeline.engines import Engine, build_engine
from preprocessing.decode import DEFAULT_MAX_PIXELS, ImageError
from preprocessing.prepare import PreparedImage, TilingConfig, prepare_bytes


@dataclass(frozen=True)
class RunSummary:
    images: int
    questions: int
    failed_images: int
    failed_questions: int
    seconds: float
    prefill_tokens: int = 0  # tokens the LLM computed
    prompt_tokens: int = 0  # tokens the prompts hold (what a cacheless engine computes)
    cache_hit_rate: float | None = None  # cached blocks found / looked up; None: no cache
    graph_buckets: int = 0  # CUDA graphs captured for the vision encoder (batch sizes)
    graph_bytes: int = 0  # device memory those graphs took at capture

    @property
    def qpm(self) -> float:
        return 60.0 * (self.questions - self.failed_questions) / max(self.seconds, 1e-9)

    def text(self) -> str:
        answered = max(self.questions - self.failed_questions, 1)
        cache = ("off" if self.cache_hit_rate is None
                 else f"block hit rate {self.cache_hit_rate:.2f}")
        return (f"{self.images} images, {self.questions} questions, "
                f"{self.failed_images} images failed ({self.failed_questions} questions), "
                f"{self.seconds:.1f}s, {self.qpm:.0f} QPM; prefill "
                f"{self.prefill_tokens / answered:.0f} of {self.prompt_tokens / answered:.0f} "
                f"prompt tokens per question (prefix cache {cache})"
                + (f"; vision CUDA graphs: {self.graph_buckets} batch sizes, "
                   f"{self.graph_bytes / 2**20:.0f} MiB" if self.graph_buckets else ""))


def load_items(cfg: RunConfig) -> list[ImageItem]:
    policy = read_policy(cfg.policy) if cfg.policy else ()
    if cfg.manifest is not None:
        return read_manifest(cfg.manifest, policy)
    assert cfg.images is not None
    return items_from_folder(cfg.images, policy)


def prepare_item(item: ImageItem, tiling: TilingConfig,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> PreparedImage:
    """Read, decode, tile; raises SourceError or ImageError with the reason."""
    return prepare_bytes(read_bytes(item.image, item.base_dir), tiling, max_pixels)


def _groups(items: list[ImageItem], n: int) -> Iterator[list[ImageItem]]:
    for i in range(0, len(items), n):
        yield items[i: i + n]


@dataclass
class PreparedGroup:
    """Stage 1 of a group (CPU): each item's tiles, or the reason it has none.

    ``images[i]`` is ``None`` exactly when ``errors`` holds ``group[i].id``."""
    group: list[ImageItem]
    images: list[PreparedImage | None]
    errors: dict[str, str]


def prepare_group(group: list[ImageItem], tiling: TilingConfig,
                  max_pixels: int = DEFAULT_MAX_PIXELS) -> PreparedGroup:
    return _collect(group, [_prepare_or_error(it, tiling, max_pixels) for it in group])


def _prepare_or_error(item: ImageItem, tiling: TilingConfig,
                      max_pixels: int) -> PreparedImage | str:
    """The item's tiles, or why it has none (an unreadable or undecodable image)."""
    try:
        return prepare_item(item, tiling, max_pixels)
    except (SourceError, ImageError) as e:
        return f"{item.image}: {e}"


def _collect(group: list[ImageItem], done: list[PreparedImage | str]) -> PreparedGroup:
    images = [None if isinstance(d, str) else d for d in done]
    errors = {it.id: d for it, d in zip(group, done) if isinstance(d, str)}
    return PreparedGroup(group, images, errors)


def prepared_groups(groups: Iterable[list[ImageItem]], tiling: TilingConfig, max_pixels: int,
                    threads: int, ahead: int = 2) -> Generator[PreparedGroup, None, None]:
    """``groups`` prepared, in order. ``threads == 0``: each group is prepared when asked
    for, in this thread. Otherwise ``threads`` daemon threads prepare the items of the next
    ``ahead`` groups while the caller scores the current one, so decoding and tiling overlap
    the model and each other (OpenCV and NumPy release the GIL); at most ``ahead + 2``
    groups' tiles are alive at once (the caller's previous one until it lets go). ``groups``
    is advanced in the calling thread only (it may read a SQLite store). Closing the
    generator, or an exception, cancels what has not started and does not wait for what has:
    a read stuck on a hung mount cannot hold up Ctrl-C (its thread dies with the process)."""
    if threads == 0:
        for group in groups:
            yield prepare_group(group, tiling, max_pixels)
        return
    source = iter(groups)
    pool = _DaemonPool(threads)
    queue: deque[tuple[list[ImageItem], list[Future]]] = deque()
    try:
        while True:
            while len(queue) <= ahead and (nxt := next(source, None)) is not None:
                queue.append((nxt, [pool.submit(_prepare_or_error, it, tiling, max_pixels)
                                    for it in nxt]))
            if not queue:
                return
            group, futures = queue[0]
            done = [f.result() for f in futures]
            queue.popleft()
            yield _collect(group, done)
    finally:
        for _, futures in queue:
            for f in futures:
                f.cancel()
        pool.stop()


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


def score_group(engine: Engine, pg: PreparedGroup) -> list[dict]:
    """Stage 2 of a group (the model): result lines, in item then question order."""
    errors = dict(pg.errors)
    index: dict[str, int] = {}
    prepared: list[PreparedImage] = []
    for item, im in zip(pg.group, pg.images):
        if im is not None:
            index[item.id] = len(prepared)
            prepared.append(im)
    requests = [Request(index[it.id], q.text, q.max_new_tokens) for it in pg.group
                if it.id in index
                for q in it.questions]
    try:
        scores = iter(engine.score(prepared, requests))
    except Exception as e:  # noqa: BLE001  (e.g. out of memory: fail this group, not the job)
        print(f"vlmbatch: engine failed on images {[it.id for it in pg.group]}: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        errors.update({it_id: f"engine failed: {type(e).__name__}: {e}" for it_id in index})
        index.clear()
        scores = iter(())
    lines = []
    for item in pg.group:
        for q in item.questions:
            line: dict[str, Any] = {
                "id": item.id, "question_id": q.id, "question": q.text, "answer": None,
                "p_yes": None, "margin": None, "image_tokens": None,
                "error": errors.get(item.id)}
            if item.id in index:
                s = next(scores)
                line.update(answer="yes" if s.p_yes >= q.threshold else "no",
                            p_yes=round(s.p_yes, 6), margin=round(s.margin, 4),
                            image_tokens=s.image_tokens)
                if s.text is not None:
                    line["text"] = s.text
            lines.append(line)
    return lines


def answer_group(engine: Engine, tiling: TilingConfig, group: list[ImageItem],
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> list[dict]:
    """Result lines for one group of items, in item then question order."""
    return score_group(engine, prepare_group(group, tiling, max_pixels))


def run(cfg: RunConfig, out: IO[str] | None = None) -> RunSummary:
    """Run a whole job in this process. Raises ManifestError/ModelError before any work."""
    items = load_items(cfg)
    openai = cfg.manifest is not None and manifest_format(cfg.manifest) == "openai"
    fmt = format_of(cfg.out)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    engine, tiling = build_engine(cfg.model, cfg.engine)
    n_q = sum(len(it.questions) for it in items)
    own = out is None and cfg.out is not None
    sink = open_text(cfg.out, fmt) if own else (out or sys.stdout)  # type: ignore[arg-type]
    write = line_writer(sink, fmt, openai)
    failed_images = failed_q = 0
    start = time.perf_counter()
    bar = tqdm(total=n_q, unit="q", disable=not cfg.progress, file=sys.stderr,
               desc="answering", dynamic_ncols=True)
    groups = prepared_groups(_groups(items, cfg.images_per_batch), tiling, cfg.max_pixels,
                             preprocess_threads_for(cfg.preprocess_threads, cfg.model.device))
    try:
        for pg in groups:
            lines = score_group(engine, pg)
            write(lines)
            sink.flush()
            bad = {ln["id"] for ln in lines if ln["error"]}
            failed_images += len(bad)
            failed_q += sum(1 for ln in lines if ln["error"])
            bar.update(len(lines))
            minutes = (time.perf_counter() - start) / 60
            bar.set_postfix(qpm=f"{(bar.n - failed_q) / max(minutes, 1e-9):.0f}",
                            errors=failed_images)
    finally:
        groups.close()  # stops the preprocessing threads (Ctrl-C, a failed write)
        bar.close()
        if own:
            sink.close()
    st = engine.stats
    pool = getattr(getattr(engine, "vision", None), "pool", None)  # torch ViT on CUDA only
    return RunSummary(len(items), n_q, failed_images, failed_q, time.perf_counter() - start,
                      st.prefill_tokens, st.prompt_tokens,
                      engine.cache.stats.hit_rate() if engine.cache is not None else None,
                      len(pool.graphs) if pool is not None else 0,
                      pool.graph_bytes if pool is not None else 0)
