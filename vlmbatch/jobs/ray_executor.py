"""Run a job on Ray: CPU preprocessing tasks feed model actors; the driver records results.

    run_job_ray(job, cfg, progress, hooks)      # `vlmbatch run JOB --executor ray`

Data flow (one *group* = ``images_per_batch`` pending items, read lazily from the store)::

    driver: store.pending() --group--> prepare task (num_cpus=1; read, decode, tile, hash)
            --PreparedGroup (tiles in Ray's object store)--> ModelWorker actor (engine.score)
            --result lines--> driver: store.record()  (one transaction per group)

The tiles never pass through the driver: it fetches only a prepare task's small "done"
object, then hands the tiles' ObjectRef to an actor, which Ray resolves there.

Why plain tasks and actors, not Ray Data: the job store, not Ray, is the source of truth for
what is done. Exactly-once needs the driver to record each group atomically when its result
arrives, to skip items recorded meanwhile, and to turn a hung or crashing decoder into that
item's error; Ray Data's streaming executor owns its own retries and writes to sinks without
a per-item acknowledgement we could make transactional with the store. Tasks and actors give
those hooks directly, with a few dozen lines of scheduling.

Invariants:
- In flight are at most ``preprocess_workers`` prepare tasks (so each starts as soon as it is
  submitted, and its deadline measures its own run time) and ``2 x model_workers`` groups at
  the model: memory is bounded whatever the manifest's size.
- A prepare task that exceeds ``decode_timeout`` seconds per item, or whose worker process
  dies, is cancelled (its worker killed) and its items are prepared again one task each, so
  the item that hangs or crashes becomes that item's error and the others go on.
- A model worker that dies is restarted by Ray and its call retried
  (``max_restarts``/``max_task_retries``); results are recorded only by the driver, only for
  items still pending, so a retried group is never recorded twice.
- A node that dies takes its prepare tasks and the tiles it holds with it: those groups are
  prepared again elsewhere (up to 3 times each), never failed for it.

Fault injection for tests: a ``pipeline.hooks.FaultHooks`` passed in travels (pickled) to the
prepare tasks (``before_prepare``: hang or crash on an item) and the model actors
(``before_score``: die on the N-th call, or be slow); production passes none.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vlmbatch.jobs.config import RunConfig
from vlmbatch.jobs.folder import STORE_FILE, status
from vlmbatch.jobs.lock import host_id
from vlmbatch.jobs.ray_cluster import init_ray
from vlmbatch.jobs.store import Counts, JobStore
from vlmbatch.jobs.tasks import task_of
from vlmbatch.pipeline.build import build_engine
from vlmbatch.pipeline.drive import prepare_task
from vlmbatch.pipeline.hooks import FaultHooks
from vlmbatch.pipeline.loading import read_spec
from vlmbatch.pipeline.records import EmbedItem, ErrorKind, ImageItem, ItemError
from vlmbatch.preprocessing.prepare import ImagePlan


def require_ray() -> Any:
    try:  # optional dependency: the ray extra
        import ray
    except ModuleNotFoundError as e:
        raise ImportError("--executor ray needs Ray: pip install 'vlmbatch[ray]'") from e
    return ray


class ModelWorker:
    """Holds one engine; ``score`` runs stage 2 of a group (the job's task: answers or
    embeddings). Ray makes it an actor."""

    def __init__(self, cfg: RunConfig, threads: int | None, hooks: FaultHooks) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.engine = build_engine(cfg.model, cfg.engine)
        self.stage2 = task_of(cfg).model(self.engine, cfg)
        self.hooks = hooks
        self.calls = 0

    def image_plan(self) -> ImagePlan:
        return self.engine.image_plan

    def score(self, pg: Any) -> list:
        self.calls += 1
        self.hooks.score(self.calls)
        return self.stage2(pg)


def run_job_ray(job: Path, cfg: RunConfig, progress: bool = True,
                hooks: FaultHooks | None = None) -> Any:
    """Answer every pending item of ``job`` on Ray (``cfg.executor.ray``); returns the job's
    status. Each model actor runs ``model_cpus`` torch threads (what Ray reserves for it),
    whatever ``--threads`` the job was submitted with."""
    ray = require_ray()
    hooks = hooks or FaultHooks()
    opts = cfg.executor.ray
    job = Path(job)
    store = JobStore(job / STORE_FILE)
    started_ray = False
    try:
        c = store.counts()
        if c.pending == 0:
            store.set("status", "done")
            return status(job)
        read_spec(cfg.model.path)  # a bad model fails here, not in an actor
        if not ray.is_initialized():
            init_ray(ray, opts)
            started_ray = True
        threads = max(1, int(opts.model_cpus))  # Ray's reservation, not the job's --threads
        # one GPU per model actor when the model runs on CUDA (never run here: no GPU yet)
        gpus = 1 if cfg.model.device.startswith("cuda") else 0
        hooks.loading()
        Actor = ray.remote(num_cpus=opts.model_cpus, num_gpus=gpus, max_restarts=3,
                           max_task_retries=3)(ModelWorker)
        workers = [Actor.remote(cfg, threads, hooks)
                   for _ in range(opts.model_workers)]
        plan = ray.get(workers[0].image_plan.remote())
        try:
            final = _drive(ray, store, cfg, workers, plan, c, progress, job.name, hooks)
        except BaseException:
            store.end_run("interrupted", failing=True)
            raise
        store.end_run(final)
    finally:
        store.close()
        if started_ray:
            ray.shutdown()
    return status(job)


def _drive(ray: Any, store: JobStore, cfg: RunConfig, workers: list,  # noqa: PLR0913
           plan: ImagePlan, counts: Counts, progress: bool, name: str,
           hooks: FaultHooks) -> str:
    """Run the job's pending items through prepare tasks and model actors until none is
    left or the job is cancelled; returns the run's final state."""
    store.begin_run(counts, host_id())
    bar = tqdm(total=counts.total, initial=counts.total - counts.pending, unit="img",
               disable=not progress, file=sys.stderr, desc=f"job {name} (ray)",
               dynamic_ncols=True)
    s = _Scheduler(ray, store, cfg, workers, plan, bar, hooks)
    try:
        while True:
            if not s.cancelled and store.get("cancel") == "1":
                s.cancel()
            s.fill()
            if not s.preparing and not s.scoring:
                return "cancelled" if s.cancelled else "done"
            ready, _ = ray.wait(list(s.preparing) + [r for r, _ in s.scoring], num_returns=1,
                                timeout=0.2)
            s.collect_prepared(set(ready))
            s.record_scored(set(ready))
    finally:
        bar.close()


class _Scheduler:
    """The driver's in-flight work: prepare tasks (``preparing``: done ref -> (group,
    deadline, tiles ref)), single items to prepare again (``retry``), groups whose tiles were
    lost with their node (``again``), and groups at the model actors (``scoring``, in
    submission order, so results are recorded in manifest order)."""

    def __init__(self, ray: Any, store: JobStore, cfg: RunConfig, workers: list,  # noqa: PLR0913
                 plan: ImagePlan, bar: tqdm, hooks: FaultHooks) -> None:
        self.ray, self.store, self.cfg, self.workers = ray, store, cfg, workers
        self.plan, self.opts, self.bar, self.hooks = plan, cfg.executor.ray, bar, hooks
        # a module-level function of a light module: a new prepare worker imports
        # pipeline.drive (numpy, OpenCV), not torch and the models, before its deadline runs
        self.prepare = ray.remote(num_cpus=1, max_retries=0, num_returns=2)(prepare_task)
        self.task = task_of(cfg)
        self.groups = store.pending(cfg.images_per_batch, self.task.from_json)
        self.preparing: dict = {}  # done ref -> (group, deadline, tiles ref)
        self.retry: deque[ImageItem | EmbedItem] = deque()
        self.again: deque[list] = deque()  # groups whose tiles were lost
        self.lost: dict[str, int] = {}  # first item id -> times its group's tiles were lost
        self.scoring: deque = deque()  # (ref, group)
        self.next_worker = 0
        self.exhausted = self.cancelled = False
        self.start, self.questions = time.perf_counter(), 0

    def cancel(self) -> None:
        """Stop preparing; groups already at the model are finished and recorded."""
        self.cancelled = True
        for ref in self.preparing:
            self.ray.cancel(ref, force=True)
        self.preparing.clear()
        self.retry.clear()
        self.again.clear()

    def fill(self) -> None:
        """Keep the preprocessing workers busy, with at most 2 groups per model worker
        queued."""
        while (not self.cancelled and len(self.preparing) < self.opts.preprocess_workers
               and len(self.scoring) < 2 * len(self.workers)):
            if self.again:
                self._submit_prepare(self.again.popleft())
                continue
            if self.retry:
                self._submit_prepare([self.retry.popleft()])
                continue
            group = None if self.exhausted else next(self.groups, None)
            if group is None:
                self.exhausted = True
                return
            self._submit_prepare(group)

    def _submit_prepare(self, group: list) -> None:
        done, tiles = self.prepare.remote(group, self.plan, self.cfg.max_pixels, self.hooks,
                                          self.task.stage1)
        timeout = self.cfg.executor.decode_timeout or float("inf")  # 0: no deadline
        deadline = time.monotonic() + timeout * len(group)
        self.preparing[done] = (group, deadline, tiles)

    def collect_prepared(self, ready: set) -> None:
        """Hand finished prepare tasks to the model workers; a task past its deadline or
        whose worker died is killed, and its items retried one by one (a single item's
        failure becomes its error)."""
        now = time.monotonic()
        for ref, (group, deadline, tiles) in list(self.preparing.items()):
            done = ref in ready
            if not done and now < deadline:
                continue
            del self.preparing[ref]
            try:
                if not done:
                    self.ray.cancel(ref, force=True)
                    raise TimeoutError
                self.ray.get(ref)  # raises if the task failed; the tiles stay where they are
            except (TimeoutError, self.ray.exceptions.RayError) as e:
                if self._lost(e, group):  # its node died: not the images' fault
                    self.again.append(group)
                    continue
                if len(group) > 1:
                    self.retry.extend(group)  # find the culprit: one task per item
                    continue
                tiles = self.task.failed(group[0], self._failure(group[0], e))
            # an ObjectRef argument reaches the actor as its value, fetched there
            self.scoring.append((self.workers[self.next_worker].score.remote(tiles), group))
            self.next_worker = (self.next_worker + 1) % len(self.workers)

    def _lost(self, e: BaseException, group: list, most: int = 3) -> bool:
        """Whether a task failed because a node died: the node that ran a prepare task, or
        that held a group's tiles when a model call read them (prepare tasks are not
        retried, so Ray cannot rebuild them). At most ``most`` times for this group: then
        the group is prepared again (its items are still pending)."""
        lost = (self.ray.exceptions.ObjectLostError, self.ray.exceptions.NodeDiedError)
        if not (isinstance(e, lost) or isinstance(getattr(e, "cause", None), lost)):
            return False
        first = self.task.key(group[0])
        n = self.lost[first] = self.lost.get(first, 0) + 1
        return n <= most

    def _failure(self, item: ImageItem | EmbedItem, e: BaseException) -> ItemError:
        if isinstance(e, TimeoutError):
            return ItemError(ErrorKind.DECODE_TIMEOUT, f"{item.source}: decoding timed out after "
                             f"{self.cfg.executor.decode_timeout:g}s (worker killed)")
        return ItemError(ErrorKind.DECODER_CRASHED,
                         f"{item.source}: preprocessing worker died ({type(e).__name__})")

    def record_scored(self, ready: set) -> None:
        """Record, in submission order, every group whose model call has returned."""
        while self.scoring and (self.scoring[0][0] in ready
                                or _is_ready(self.ray, self.scoring[0][0])):
            ref, group = self.scoring.popleft()
            try:
                answers = self.ray.get(ref)
            except self.ray.exceptions.RayError as e:
                if not self._lost(e, group):
                    raise
                self.again.append(group)  # its items are still pending: prepare them again
                continue
            self.store.record(self.task.by_item(answers))
            self.questions += len(answers)
            self.bar.update(len(group))
            rate = 60 * self.questions / (time.perf_counter() - self.start)
            self.bar.set_postfix(qpm=f"{rate:.0f}")


def _is_ready(ray: Any, ref: Any) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)
