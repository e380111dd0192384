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
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.jobs.config import ExecutorConfig, RunConfig
from vlmbatch.jobs.errors import ManifestError
from vlmbatch.jobs.folder import (  # cancel, status: re-exported
    STORE_FILE,
    JobStatus,
    cancel,
    is_job,
    load_config,
    require_job,
    status,
    write_job_file,
)
from vlmbatch.jobs.lock import host_id, run_lock
from vlmbatch.jobs.manifest import manifest_format
from vlmbatch.jobs.ray_executor import run_job_ray
from vlmbatch.jobs.store import JobStore
from vlmbatch.jobs.tasks import task_of
from vlmbatch.pipeline.build import build_engine
from vlmbatch.pipeline.config import ConfigError, preprocess_threads_for
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.loading import read_spec

__all__ = ["cancel", "is_job", "run_job", "status", "submit"]


def _absolute(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its input and model paths absolute and no output (a job's results stay
    in its store)."""
    def ab(p: Path | None) -> Path | None:
        return Path(p).absolute() if p is not None else None

    return dataclasses.replace(cfg, manifest=ab(cfg.manifest), images=ab(cfg.images),
                               policy=ab(cfg.policy), out=None,
                               model=dataclasses.replace(cfg.model, path=ab(cfg.model.path)))


def submit(cfg: RunConfig, job: Path, hooks: FaultHooks = NO_HOOKS) -> int:
    """Create the job folder; returns the number of items. Fails before writing anything if
    the input or the model folder is invalid, or the folder already holds a job. The device
    is checked when the job runs (it may run on another machine). The folder is built under
    a temporary name beside ``job`` and renamed onto it when complete, so a submit that
    fails or is interrupted (a bad line, a full disk, Ctrl-C, SIGTERM) leaves no job."""
    job = Path(job)
    if job.exists() and (not job.is_dir() or any(job.iterdir())):
        raise ManifestError(f"{job} already exists and is not an empty folder; pick a new job "
                            "folder (or `vlmbatch resume` it if it is a job)")
    read_spec(cfg.model.path)  # raises ModelError naming what is wrong
    task = task_of(cfg)  # answer questions, or embed (jobs/tasks.py)
    task.check(cfg)
    items, first = task.items(cfg)
    fmt = manifest_format(cfg.manifest) if cfg.manifest else "vlmbatch"
    with _naming_job(job), replaced_on_success(job) as part:
        part.mkdir()
        store = JobStore(part / STORE_FILE)
        try:
            n = store.add_items(_counted(items, hooks), first, task.to_json, task.key)
            store.set("status", "submitted")
            store.set("created", str(time.time()))
        finally:
            store.close()
        write_job_file(part, _absolute(cfg), fmt)
    return n


def _counted(items: Iterator[tuple[str, Any]], hooks: FaultHooks) -> Iterator[tuple[str, Any]]:
    for n, x in enumerate(items, 1):
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
            preprocess_threads: int | None = None, hooks: FaultHooks = NO_HOOKS) -> JobStatus:
    """Answer every pending item (a fresh run or a resume) with the job's stored config, on
    this run's ``executor`` (None: the stored one); with ``retry_failed``, first queue the
    failed items again, under the same lock. In-process, ``threads``/``preprocess_threads``
    replace the stored ones for this run; on Ray, where each model actor runs ``model_cpus``
    torch threads, the CLI refuses them. Raises ``JobBusy`` if another process is running
    the job."""
    require_job(job)
    cfg = load_config(Path(job)).for_run(threads, preprocess_threads, executor)
    if cfg.executor.kind == "ray" and (threads, preprocess_threads) != (None, None):
        raise ConfigError("threads and preprocess_threads apply to in-process runs; on Ray "
                          "use model_cpus (--model-cpus) and preprocess_workers")
    with run_lock(Path(job)):
        requeued = _requeue_failed(Path(job)) if retry_failed else 0
        if cfg.executor.kind == "ray":
            st = run_job_ray(Path(job), cfg, progress, hooks)
        else:
            st = _run_local(Path(job), progress, cfg, hooks)
    return dataclasses.replace(st, requeued=requeued)


def _requeue_failed(job: Path) -> int:
    store = JobStore(job / STORE_FILE)
    try:
        return store.requeue_failed()
    finally:
        store.close()


def _run_local(job: Path, progress: bool, cfg: RunConfig, hooks: FaultHooks) -> JobStatus:
    store = JobStore(job / STORE_FILE)
    try:
        c = store.counts()
        if c.pending == 0:
            store.set("status", "done")
            return status(job)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        task = task_of(cfg)
        hooks.loading()
        engine = build_engine(cfg.model, cfg.engine)
        stage2 = task.model(engine, cfg)
        store.begin_run(c, host_id())
        bar = tqdm(total=c.total, initial=c.total - c.pending, unit="img", disable=not progress,
                   file=sys.stderr, desc=f"job {job.name}", dynamic_ncols=True)
        final = "interrupted"  # unless the loop ends normally
        threads = preprocess_threads_for(cfg.preprocess_threads, cfg.model.device)
        groups = task.prepared(store.pending(cfg.images_per_batch, task.from_json),
                               engine.image_plan, cfg.max_pixels, threads,
                               decode_timeout=cfg.executor.decode_timeout, hooks=hooks)
        # (groups prepared ahead stay pending)
        try:
            for pg in groups:
                if store.get("cancel") == "1":
                    final = "cancelled"
                    break
                store.record(task.by_item(stage2(pg)))
                bar.update(len(pg.group))
                hooks.group_done()
            else:
                final = "done"
        except BaseException:  # the job's state first: a second signal may cut the rest short
            store.end_run(final, failing=True)
            raise
        else:
            store.end_run(final)
        finally:
            groups.close()  # stops the decoder processes or threads
            bar.close()
    finally:
        store.close()
    return status(job)

