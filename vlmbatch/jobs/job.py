"""Batch jobs on disk: submit, run/resume, cancel (status and the folder's files:
``jobs/folder.py``).

``submit`` validates the input (as ``vlmbatch run`` does) and writes the job folder; ``run``
answers the pending items group by group, recording each group's answers in one
transaction, so a killed run loses only the group in flight and ``resume`` (= ``run``)
finishes the rest, every item recorded exactly once; ``resume --retry-failed`` first puts
the failed items back in the queue. ``cancel`` sets a flag the running job checks between
groups.

Paths (manifest, images, model) are stored absolute, so a job runs from any directory.
Two executors feed the same store: this process, or Ray workers (``jobs/ray_executor.py``),
as the run's ``ExecutorConfig`` says.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.engine.base import Engine
from vlmbatch.engine.build import build_engine
from vlmbatch.engine.config import ConfigError
from vlmbatch.engine.loading import check_label_sets, read_spec
from vlmbatch.inputs.manifest import label_sets, manifest_format
from vlmbatch.jobs.config import ExecutorConfig, RunConfig
from vlmbatch.jobs.folder import (
    STORE_FILE,
    JobStatus,
    job_format,
    load_config,
    require_job,
    status,
    write_job_file,
)
from vlmbatch.jobs.lock import host_id, run_lock
from vlmbatch.jobs.ray_executor import ray_stages
from vlmbatch.jobs.reuse import Pass, Reuse, count_reused, reuse_pass
from vlmbatch.jobs.store import JobStore
from vlmbatch.jobs.tasks import JobTask, job_task
from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.drive import Drive, GroupResults, LocalStages, Stages
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.questions import ManifestError
from vlmbatch.pipeline.task import Task
from vlmbatch.preprocessing.sources import is_remote


def _absolute(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its input and model paths absolute and no output (a job's results stay
    in its store)."""
    def ab(p: Path | None) -> Path | None:
        return Path(p).absolute() if p is not None else None

    dataset = cfg.dataset
    if dataset is not None and not is_remote(dataset):  # a path, glob or brace pattern
        dataset = os.path.abspath(dataset)
    return dataclasses.replace(cfg, manifest=ab(cfg.manifest), images=ab(cfg.images),
                               dataset=dataset, policy=ab(cfg.policy), out=None,
                               model=dataclasses.replace(cfg.model, path=ab(cfg.model.path)))


def submit(cfg: RunConfig, job: Path, hooks: FaultHooks = NO_HOOKS,
           reuse: Path | None = None) -> int:
    """Create the job folder; returns the number of items. Fails before writing anything if
    the input or the model folder is invalid, or the folder already holds a job. The device
    is checked when the job runs (it may run on another machine). The folder is built under
    a temporary name beside ``job`` and renamed onto it when complete, so a submit that
    fails or is interrupted (a bad line, a full disk, Ctrl-C, SIGTERM) leaves no job.
    ``reuse``: an earlier job whose answers the job's runs copy (``jobs/reuse.py``)."""
    job = Path(job)
    if reuse is not None:
        require_job(reuse)
    if job.exists() and (not job.is_dir() or any(job.iterdir())):
        raise ManifestError(f"{job} already exists and is not an empty folder; pick a new job "
                            "folder (or `vlmbatch resume` it if it is a job)")
    read_spec(cfg.model.path)  # raises ModelError naming what is wrong
    fmt = manifest_format(cfg.manifest) if cfg.manifest else "vlmbatch"
    jt = job_task(cfg, fmt)  # answer questions, or embed (jobs/tasks.py)
    jt.check(cfg)
    items, first = jt.items(cfg)
    sets: set[tuple[str, ...]] = set()
    with _naming_job(job), replaced_on_success(job) as part:
        part.mkdir()
        store = JobStore(part / STORE_FILE)
        try:
            n = store.add_items(_counted(items, hooks, sets), first, jt.to_json, jt.task.key)
            check_label_sets(cfg.model.path, cfg.engine, sets)  # before the job exists
            store.set("status", "submitted")
            store.set("created", str(time.time()))
            if reuse is not None:
                store.set("reuse", str(Path(reuse).resolve()))
        finally:
            store.close()
        write_job_file(part, _absolute(cfg), fmt)
    return n


def _counted(items: Iterator[tuple[str, Any]], hooks: FaultHooks,
             sets: set[tuple[str, ...]]) -> Iterator[tuple[str, Any]]:
    """``items``, counted for the hooks; the label sets they ask are added to ``sets``."""
    for n, x in enumerate(items, 1):
        sets |= label_sets([x[1]])
        yield x
        hooks.submitted(n)


@contextlib.contextmanager
def _naming_job(job: Path) -> Iterator[None]:
    """An OSError about the temporary folder ``submit`` builds (or a file in it) names
    ``job`` instead."""
    try:
        yield
    except OSError as e:
        prefix, name = str(job.parent / f".{job.name}."), str(e.filename or "")
        if not name.startswith(prefix) or ".part" not in name:
            raise
        inside = name[len(prefix):].partition(".part")[2]  # "" or "/store.sqlite"
        raise OSError(e.errno, e.strerror, str(job) + inside) from e


def run_job(job: Path, progress: bool = True, executor: ExecutorConfig | None = None,
            retry_failed: bool = False, threads: int | None = None,
            preprocess_threads: int | None = None, decode_timeout: float | None = None,
            hooks: FaultHooks = NO_HOOKS, fetch: dict[str, Any] | None = None,
            reuse: Path | None = None) -> JobStatus:
    """Answer every pending item (a fresh run or a resume) with the job's stored config, on
    this run's ``executor`` (None: the stored one); with ``retry_failed``, first queue the
    failed items again, under the same lock. In-process, ``threads``/``preprocess_threads``
    replace the stored ones for this run (``decode_timeout`` and ``fetch``, the fetch stage's
    settings of ``jobs.config.RUN_FETCH``, on either executor); on Ray,
    where each model actor runs ``model_cpus``
    torch threads, the CLI refuses them. ``reuse``: an earlier job whose answers are copied
    where image, question and model agree (``jobs/reuse.py``; default: the one given at
    submit, if any). Raises ``JobBusy`` if another process is running
    the job."""
    require_job(job)
    cfg = load_config(Path(job)).for_run(threads, preprocess_threads, executor, decode_timeout,
                                         fetch)
    if cfg.executor.kind == "ray" and (threads, preprocess_threads) != (None, None):
        raise ConfigError("threads and preprocess_threads apply to in-process runs; on Ray "
                          "use model_cpus (--model-cpus) and preprocess_workers")
    with run_lock(Path(job)):
        requeued = _requeue_failed(Path(job)) if retry_failed else 0
        st = _run(Path(job), progress, cfg, hooks, reuse)
    return dataclasses.replace(st, requeued=requeued)


def _requeue_failed(job: Path) -> int:
    store = JobStore(job / STORE_FILE)
    try:
        return store.requeue_failed()
    finally:
        store.close()


class StoreSink:
    """A group's results into the job store: each item's results with its state change, in
    one transaction, only for items still pending (``JobStore.record``); an item's reused
    answers (``jobs/reuse.py``) put back beside the computed ones."""

    def __init__(self, store: JobStore, task: Task, reused: Pass | None = None) -> None:
        self.store, self.task, self.reused = store, task, reused or Pass()

    def write(self, items: list, results: list[list]) -> None:
        keys = [self.task.key(it) for it in items]
        self.store.record({k: self.reused.merge(k, r) for k, r in zip(keys, results)})
        count_reused(self.store, sum(len(self.reused.partial.get(k, ())) for k in keys))


def drive_job(store: JobStore, cfg: RunConfig, jt: JobTask, stages: Stages,
              hooks: FaultHooks = NO_HOOKS, reused: Pass | None = None
              ) -> Generator[GroupResults, None, None]:
    """One run of a job's pending items through ``stages`` (this process, Ray) into its
    store, a group at a time: the store's run marks (``status`` reads them), ``cancel``
    checked before each group, the run's end recorded however it ends (``interrupted`` on an
    exception or when the consumer stops early; groups prepared ahead stay pending).
    ``reused``: the questions already answered (``reuse_pass``) are not asked again."""
    store.begin_run(store.counts(), host_id())
    r = reused or Pass()
    d = Drive(stages, store.pending(cfg.images_per_batch, lambda s: r.strip(jt.from_json(s))),
              StoreSink(store, jt.task, r), lambda: store.get("cancel") == "1", hooks)
    try:
        yield from d
    except BaseException:  # the job's state first: a second signal may cut the rest short
        store.end_run(d.final, failing=True)
        raise
    store.end_run(d.final)


class JobRun:
    """A job run step by step on an engine that is already built (the server's engine thread
    runs a batch's job a group at a time between interactive requests): the job's lock held
    (``run.lock``: one process per job), its store open, ``drive_job`` over ``LocalStages``.
    Raises ``JobBusy`` (another process runs the job) or ``ManifestError`` (a damaged folder)
    before anything is marked."""

    def __init__(self, job: Path, cfg: RunConfig, engine: Engine, opts: PrepareOptions,
                 hooks: FaultHooks = NO_HOOKS) -> None:
        self._exit = contextlib.ExitStack()
        try:
            self._exit.enter_context(run_lock(job))
            store = JobStore(job / STORE_FILE)
            self._exit.callback(store.close)
            jt = job_task(cfg, job_format(job))
            steps = drive_job(store, cfg, jt, LocalStages(jt.task, engine, opts, hooks), hooks)
            # the engine thread reads pending items from the store: in this thread only
        except BaseException:
            self._exit.close()
            raise
        self.store = store
        self._steps = steps
        self._exit.callback(self._steps.close)

    def cancel(self) -> None:
        """Stop before the next group (as ``vlmbatch cancel`` does: the store's flag)."""
        self.store.set("cancel", "1")

    def step(self) -> GroupResults | None:
        """Run and record the next group: its items and results; None when none is left (or
        the job is cancelled): the run has ended, and ``close`` only lets go."""
        return next(self._steps, None)

    def close(self) -> None:
        """Let go of the job: a run still going ends ``interrupted`` (resumable)."""
        self._exit.close()


def _run(job: Path, progress: bool, cfg: RunConfig, hooks: FaultHooks,
         reuse: Path | None = None) -> JobStatus:
    store = JobStore(job / STORE_FILE)
    try:
        source = reuse or (Path(s) if (s := store.get("reuse")) else None)
        reused = _reuse(store, cfg, source) if source is not None else None
        c = store.counts()
        if c.pending == 0:
            store.set("status", "done")
            return status(job)
        jt = job_task(cfg, job_format(job))
        ray = cfg.executor.kind == "ray"
        with ray_stages(cfg, jt.task, hooks) if ray else _local_stages(cfg, jt.task, hooks) \
                as stages:
            bar = tqdm(total=c.total, initial=c.total - c.pending, unit="img",
                       disable=not progress, file=sys.stderr,
                       desc=f"job {job.name}" + (" (ray)" if ray else ""), dynamic_ncols=True)
            start, results = time.perf_counter(), 0
            try:
                for items, out in drive_job(store, cfg, jt, stages, hooks, reused):
                    bar.update(len(items))
                    results += sum(len(r) for r in out)
                    bar.set_postfix(qpm=f"{60 * results / (time.perf_counter() - start):.0f}")
            finally:
                bar.close()
    finally:
        store.close()
    return status(job)


def _reuse(store: JobStore, cfg: RunConfig, source: Path) -> Pass:
    """The reuse pass over the pending items (``jobs/reuse.py``), said on stderr."""
    r = Reuse.open(source, cfg)
    if r.why_not is not None:
        print(f"vlmbatch: nothing reused from {source}: {r.why_not}", file=sys.stderr)
        return Pass()
    p = reuse_pass(store, r)
    print(f"vlmbatch: {p.reused} answers reused from {source} ({p.whole} images whole, "
          f"{len(p.partial)} with questions to compute)", file=sys.stderr)
    return p


@contextlib.contextmanager
def _local_stages(cfg: RunConfig, task: Task, hooks: FaultHooks) -> Iterator[LocalStages]:
    """Both stages in this process: the engine built here, on the run's torch threads."""
    hooks.loading()
    engine = build_engine(cfg.model, cfg.engine, cfg.threads)
    yield LocalStages(task, engine, cfg.prepare_options, hooks)
