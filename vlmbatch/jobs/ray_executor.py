"""A job's two stages on Ray: CPU prepare tasks feed model actors; the driver records.

    with ray_stages(cfg, task, hooks) as stages:     # `vlmbatch run JOB --executor ray`
        drive_job(store, cfg, job_task, stages)      # jobs/job.py: the one drive loop

Data flow (one *group* = ``images_per_batch`` pending items, read lazily from the store)::

    driver: store.pending() --group--> prepare task (num_cpus=1; pipeline.drive.prepare_task:
            read, decode, tile, hash) --Prepared (images in Ray's object store)-->
            ModelWorker actor (pipeline.drive.run_group) --each item's results--> driver:
            the drive loop's sink (the store: one transaction per group)

The images never pass through the driver: it fetches only a prepare task's small "done"
object, then hands the group's ObjectRef to an actor, which Ray resolves there.

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
- Results come back in the groups' order (the drive loop records them so).
- A prepare task that exceeds ``decode_timeout`` seconds per item, or whose worker process
  dies, is cancelled (its worker killed) and its items are prepared again one task each, so
  the item that hangs or crashes becomes that item's error and the others go on.
- A model worker that dies is restarted by Ray and its call retried
  (``max_restarts``/``max_task_retries``); results are recorded only by the driver, only for
  items still pending, so a retried group is never recorded twice.
- Clips are sampled by the engine's ``VideoPlan`` (a model actor's, ``ModelWorker.video_plan``)
  under the run's ``--fps``/``--num-frames``/``--max-frames`` (a line's keys win), bound into
  the task as ``pipeline.drive.LocalStages`` binds it (sent only with a group that holds a
  clip: unpickling the plan imports PyAV); a list's images and a clip are fetched
  with the run's fetch options (``pipeline/media_fetch.py``), and the decode deadline counts
  per image and per clip.
- A node that dies takes its prepare tasks and the images it holds with it: those groups are
  prepared again elsewhere (up to 3 times each), never failed for it.
- Closing the stages (the job cancelled, an interrupt) cancels the prepare tasks in flight;
  groups at the model are dropped unrecorded (their items stay pending).

Fault injection for tests: a ``pipeline.hooks.FaultHooks`` passed in travels (pickled) to the
prepare tasks (``before_prepare``: hang or crash on an item) and the model actors
(``before_score``: die on the N-th call, or be slow); production passes none.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from vlmbatch.engine.build import build_engine
from vlmbatch.engine.loading import read_spec
from vlmbatch.jobs.config import RunConfig
from vlmbatch.jobs.ray_cluster import init_ray
from vlmbatch.pipeline.drive import GroupResults, prepare_task, run_group
from vlmbatch.pipeline.hooks import FaultHooks, Named
from vlmbatch.pipeline.media_fetch import has_remote, media_count
from vlmbatch.pipeline.media_inputs import SamplingKeys
from vlmbatch.pipeline.records import ErrorKind, ItemError
from vlmbatch.pipeline.task import Prepared, Task
from vlmbatch.preprocessing.limits import MAX_RETRY_AFTER_S
from vlmbatch.preprocessing.prepare import ImagePlan
from vlmbatch.preprocessing.video_source import VideoSource

if TYPE_CHECKING:
    from vlmbatch.preprocessing.video_plan import VideoPlan


def require_ray() -> Any:
    try:  # optional dependency: the ray extra
        import ray
    except ModuleNotFoundError as e:
        raise ImportError("--executor ray needs Ray: pip install 'vlmbatch[ray]'") from e
    return ray


class ModelWorker:
    """Holds one engine; ``run`` is stage 2 of a group (``pipeline.drive.run_group``: the
    job's task on the engine, an engine failure that group's error). Ray makes it an actor."""

    def __init__(self, cfg: RunConfig, task: Task, threads: int | None,
                 hooks: FaultHooks) -> None:
        self.engine = build_engine(cfg.model, cfg.engine, threads)
        self.task, self.hooks = task, hooks
        self.calls = 0

    def image_plan(self) -> ImagePlan:
        return self.engine.image_plan

    def video_plan(self) -> VideoPlan | None:
        """The engine's clip plan (``Engine.video_plan``), which ``RayStages`` binds into the
        run's task as ``LocalStages`` does, so the prepare tasks sample clips by it."""
        return self.engine.video_plan

    def run(self, p: Prepared) -> list[list]:
        self.calls += 1
        self.hooks.score(self.calls)
        return run_group(self.task, self.engine, p)


@contextlib.contextmanager
def ray_stages(cfg: RunConfig, task: Task, hooks: FaultHooks | None = None
               ) -> Iterator[RayStages]:
    """Ray started or joined (``cfg.executor.ray``), the model actors made; both undone on
    exit (Ray shut down only if started here)."""
    ray = require_ray()
    hooks = hooks or FaultHooks()
    read_spec(cfg.model.path)  # a bad model fails here, not in an actor
    started = not ray.is_initialized()
    if started:
        init_ray(ray, cfg.executor.ray)
    try:
        workers, plan = model_workers(ray, cfg, task, hooks)
        yield RayStages(ray, cfg, task, workers, plan, hooks)
    finally:
        if started:
            ray.shutdown()


def model_workers(ray: Any, cfg: RunConfig, task: Task, hooks: FaultHooks
                  ) -> tuple[list, ImagePlan]:
    """``model_workers`` model actors for ``task`` on Ray (already started), and the image
    plan of their engine. Each runs ``model_cpus`` torch threads (what Ray reserves for
    it), whatever ``--threads`` the job was submitted with."""
    opts = cfg.executor.ray
    threads = max(1, int(opts.model_cpus))  # Ray's reservation, not the job's --threads
    # one GPU per model actor when the model runs on CUDA (never run here: no GPU yet)
    gpus = 1 if cfg.model.device.startswith("cuda") else 0
    hooks.loading()
    actor = ray.remote(num_cpus=opts.model_cpus, num_gpus=gpus, max_restarts=3,
                       max_task_retries=3)(ModelWorker)
    workers = [actor.remote(cfg, task, threads, hooks) for _ in range(opts.model_workers)]
    return workers, ray.get(workers[0].image_plan.remote())


class RayStages:
    """The ``pipeline.drive.Stages`` of a job on Ray (module docstring)."""

    def __init__(self, ray: Any, cfg: RunConfig, task: Task, workers: list,  # noqa: PLR0913
                 plan: ImagePlan, hooks: FaultHooks) -> None:
        # the engine's clip plan under the run's --fps/--num-frames/--max-frames, as
        # pipeline.drive.LocalStages binds it: the prepare tasks read it from the task
        video = ray.get(workers[0].video_plan.remote())
        task = task.with_video(video, cfg.prepare_options.sampling)
        self.ray, self.cfg, self.task, self.workers = ray, cfg, task, workers
        self.plan, self.hooks = plan, hooks

    def results(self, groups: Iterable[list]) -> Generator[GroupResults, None, None]:
        s = _Scheduler(self.ray, self.cfg, self.task, self.workers, self.plan, self.hooks,
                       iter(groups))
        try:
            while True:
                done = s.finished()  # results first: a lost group is prepared again next
                if done is not None:
                    yield done
                    s.take()
                    continue
                s.fill()
                if not s.preparing and not s.scoring:
                    return
                ready, _ = self.ray.wait(list(s.preparing) + [r for r, _ in s.scoring],
                                         num_returns=1, timeout=0.2)
                s.collect_prepared(set(ready))
        finally:
            s.cancel()


class _Scheduler:
    """The driver's in-flight work: prepare tasks (``preparing``: done ref -> (group,
    deadline, prepared ref)), single items to prepare again (``retry``), groups whose images
    were lost with their node (``again``), and groups at the model actors (``scoring``, in
    submission order, so results come back in the groups' order)."""

    def __init__(self, ray: Any, cfg: RunConfig, task: Task, workers: list,  # noqa: PLR0913
                 plan: ImagePlan, hooks: FaultHooks, groups: Iterator[list]) -> None:
        self.ray, self.cfg, self.task, self.workers = ray, cfg, task, workers
        self.plan, self.opts, self.hooks, self.groups = plan, cfg.executor.ray, hooks, groups
        # a module-level function of a light module: a new prepare worker imports
        # pipeline.drive (numpy, OpenCV), not torch and the models, before its deadline runs
        self.prepare = ray.remote(num_cpus=1, max_retries=0, num_returns=2)(prepare_task)
        # a group without a clip gets the task without the clip plan, whose unpickling would
        # import the decoder of clips (PyAV) into the prepare worker before its deadline runs
        self.stills = task.with_video(None, SamplingKeys())
        self.preparing: dict = {}  # done ref -> (group, deadline, prepared ref)
        self.retry: deque = deque()
        self.again: deque[list] = deque()  # groups whose images were lost
        self.lost: dict[str, int] = {}  # first item's key -> times its group's images were lost
        self.scoring: deque = deque()  # (ref, group)
        self.next_worker = 0
        self.exhausted = False
        self._done: GroupResults | None = None  # the oldest group's results, once fetched

    def cancel(self) -> None:
        """Stop preparing: the prepare tasks in flight are dropped, not killed, except those
        already past their deadline (hung: no reply is coming); groups at the model are left
        to finish unrecorded. A dropped task ends on its own, or with its owner when the
        driver exits; one that hangs later, in a driver that lives on (the server's Ray
        batches), holds its CPU until then.

        Not ``ray.cancel`` on the others: a task cancelled just as its reply arrives crashes
        the driver's core worker (Ray 2.60: "Check failed: it != submissible_tasks_.end()
        Tried to complete task that was not pending", ray-project/ray#54527's race), so a
        SIGTERM or a cancel during a run exited 1 instead of 143 (seen in
        tests/jobs/test_ray_executor.py::test_sigterm_on_ray_ends_the_run_as_ctrl_c_does)."""
        now = time.monotonic()
        for ref, (_, deadline, _) in self.preparing.items():
            if now >= deadline:
                self.ray.cancel(ref, force=True)
        self.preparing.clear()
        self.retry.clear()
        self.again.clear()

    def fill(self) -> None:
        """Keep the preprocessing workers busy, with at most 2 groups per model worker
        queued."""
        while (len(self.preparing) < self.opts.preprocess_workers
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
        fetch = self.cfg.prepare.fetch
        refs = [self.task.image(it) for it in group]
        clips = any(r is not None and isinstance(r.image, VideoSource) for r in refs)
        done, prepared = self.prepare.remote(self.task if clips else self.stills, group,
                                             self.plan, self.cfg.prepare.max_pixels,
                                             self.hooks, fetch)
        timeout = self.cfg.prepare.decode_timeout or float("inf")  # 0: no deadline
        # the task fetches its group's remote images first, at once, under their own timeout:
        # the decode deadline gets that on top, so it still measures decoding; it counts per
        # image and per clip (a list of n images has n deadlines' worth)
        remote = any(r is not None and has_remote(r.image) for r in refs)
        fetching = (fetch.retries + 1) * fetch.timeout_s + fetch.backoff_s * 2 ** (
            fetch.retries + 1) + MAX_RETRY_AFTER_S * fetch.retries if remote else 0.0
        deadline = time.monotonic() + timeout * sum(map(media_count, refs)) + fetching
        self.preparing[done] = (group, deadline, prepared)

    def collect_prepared(self, ready: set) -> None:
        """Hand finished prepare tasks to the model workers; a task past its deadline or
        whose worker died is killed, and its items retried one by one (a single item's
        failure becomes its error)."""
        now = time.monotonic()
        for ref, (group, deadline, prepared) in list(self.preparing.items()):
            done = ref in ready
            if not done and now < deadline:
                continue
            del self.preparing[ref]
            try:
                if not done:
                    self.ray.cancel(ref, force=True)
                    raise TimeoutError
                self.ray.get(ref)  # raises if the task failed; the images stay where they are
            except (TimeoutError, self.ray.exceptions.RayError) as e:
                if self._lost(e, group):  # its node died: not the images' fault
                    self.again.append(group)
                    continue
                if len(group) > 1:
                    self.retry.extend(group)  # find the culprit: one task per item
                    continue
                prepared = self._failed(group[0], e)
            # an ObjectRef argument reaches the actor as its value, fetched there
            self.scoring.append((self.workers[self.next_worker].run.remote(prepared), group))
            self.next_worker = (self.next_worker + 1) % len(self.workers)

    def _failed(self, item: Any, e: BaseException) -> Prepared:
        """A one-item group whose stage 1 failed with ``e``: its image's error."""
        return Prepared([item], [None], {self.task.key(item): self._failure(item, e)})

    def _lost(self, e: BaseException, group: list, most: int = 3) -> bool:
        """Whether a task failed because a node died: the node that ran a prepare task, or
        that held a group's images when a model call read them (prepare tasks are not
        retried, so Ray cannot rebuild them). At most ``most`` times for this group: then
        the group is prepared again (its items are still pending)."""
        lost = (self.ray.exceptions.ObjectLostError, self.ray.exceptions.NodeDiedError)
        if not (isinstance(e, lost) or isinstance(getattr(e, "cause", None), lost)):
            return False
        first = self.task.key(group[0])
        n = self.lost[first] = self.lost.get(first, 0) + 1
        return n <= most

    def _failure(self, item: Named, e: BaseException) -> ItemError:
        if isinstance(e, TimeoutError):
            return ItemError(ErrorKind.DECODE_TIMEOUT, f"{item.source}: decoding timed out after "
                             f"{self.cfg.prepare.decode_timeout:g}s (worker killed)")
        return ItemError(ErrorKind.DECODER_CRASHED,
                         f"{item.source}: preprocessing worker died ({type(e).__name__})")

    def finished(self) -> GroupResults | None:
        """The oldest group at the model, with its results, once its call has returned (a
        group whose images were lost with their node is prepared again instead)."""
        while self._done is None and self.scoring and _is_ready(self.ray, self.scoring[0][0]):
            ref, group = self.scoring.popleft()
            try:
                self._done = (group, self.ray.get(ref))
            except self.ray.exceptions.RayError as e:
                if not self._lost(e, group):
                    raise
                self.again.append(group)  # its items are still pending: prepare them again
        return self._done

    def take(self) -> None:
        """The group ``finished`` returned has been handed on."""
        self._done = None


def _is_ready(ray: Any, ref: Any) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)
