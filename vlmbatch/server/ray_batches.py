"""Batches on Ray (``serve --executor ray [--address ...]``): each batch in progress is its
job driven on the Ray executor (``jobs/ray_executor.py``), several at once.

    batch worker -> enqueue_batch(id) -> a driver thread per batch:
        drive_job(store, job's config, RayStages(shared model actors))   (jobs/job.py)
            prepare tasks (decode, tile) -> the model actors of the job's task -> the store

What stays on the server: the job folders (each batch's store, recorded by its driver
thread in one transaction per group, exactly once as in-process) and the files. What runs
on Ray: the prepare tasks and the model actors, made once per task (chat: answer; an
embeddings batch: embed) the first time a batch needs them and shared by every batch
after; each batch keeps at most ``2 x model_workers`` groups at the actors, which take
calls in order, so batches in progress at once share the actors in turn (no batch waits
for another to finish). Interactive requests stay on the engine processes.

Cancel sets the job's flag (checked before each group, as ``vlmbatch cancel`` does), then
the batch is finalized with the lines answered so far; a stopped server leaves each job
``interrupted`` and its batch ``in_progress``, resumed at the next start; a prepare
worker that dies has its group prepared again item by item (the executor's rule), so no
item is lost or recorded twice. Ray is started (or joined, ``--address``) once, in the
main thread, when the server starts.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from vlmbatch.engine.config import ConfigError
from vlmbatch.jobs.config import RunConfig
from vlmbatch.jobs.folder import STORE_FILE, job_format, load_config
from vlmbatch.jobs.job import drive_job
from vlmbatch.jobs.lock import run_lock
from vlmbatch.jobs.ray_cluster import init_ray
from vlmbatch.jobs.ray_executor import RayStages, model_workers, require_ray
from vlmbatch.jobs.store import JobStore
from vlmbatch.jobs.tasks import job_task
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.questions import ManifestError
from vlmbatch.pipeline.task import Task
from vlmbatch.preprocessing.prepare import ImagePlan
from vlmbatch.server.batches import BatchBook
from vlmbatch.server.config import ServerConfig
from vlmbatch.serving.scheduler import BatchEvents, mismatch

log = logging.getLogger("vlmbatch.server")


class RayBatches:
    def __init__(self, cfg: ServerConfig, book: BatchBook, events: BatchEvents,
                 hooks: FaultHooks = NO_HOOKS) -> None:
        self.cfg, self.book, self.events, self.hooks = cfg, book, events, hooks
        self.ray = require_ray()
        if not self.ray.is_initialized():
            init_ray(self.ray, cfg.executor.ray)
        self.pools: dict[Task, tuple[list, ImagePlan]] = {}
        self.running: dict[str, threading.Thread] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.answered = 0  # results recorded (metrics)

    def enqueue_batch(self, batch_id: str) -> None:
        t = threading.Thread(target=self._drive, args=(batch_id,), daemon=True,
                             name=f"vlmbatch-ray-{batch_id[-8:]}")
        with self.lock:
            if self.stopping.is_set() or batch_id in self.running:
                return
            self.running[batch_id] = t
        t.start()

    def cancel_batch(self, batch_id: str) -> bool:
        """Set the job's cancel flag; False when no driver thread holds the batch."""
        with self.lock:
            if batch_id not in self.running:
                return False
        store = JobStore(self.book.job_of(batch_id) / STORE_FILE)
        try:
            store.set("cancel", "1")
        finally:
            store.close()
        return True

    def stop(self, timeout: float) -> None:
        """Every driver stops after its group in flight (jobs ``interrupted``), then Ray is
        shut down."""
        self.stopping.set()
        with self.lock:
            threads = list(self.running.values())
        for t in threads:
            t.join(timeout)
        self.ray.shutdown()

    def _pool(self, run: RunConfig, task: Task) -> tuple[list, ImagePlan]:
        with self.lock:
            if task not in self.pools:
                self.pools[task] = model_workers(self.ray, run, task, self.hooks)
            return self.pools[task]

    def _config(self, job: Path) -> RunConfig:
        """The job's config on this server's Ray options (ConfigError: it cannot run here,
        ``serving.scheduler.mismatch``)."""
        run = load_config(job)
        why = mismatch(run, self.cfg.serving)
        if why is not None:
            raise ConfigError(why)
        return run.for_run(executor=self.cfg.executor)

    def _drive(self, batch_id: str) -> None:
        job = self.book.job_of(batch_id)
        try:
            with run_lock(job):
                cancelled = self._run(job)
        except (ManifestError, ConfigError) as e:  # JobBusy too: it cannot run here
            log.warning("batch %s cannot run: %s", batch_id, e)
            message = f"the batch cannot run on this server: {e}"
            self._done(batch_id, lambda: self.events.failed(batch_id, message))
        except Exception as e:  # noqa: BLE001  (this batch fails, not the server)
            log.exception("batch %s stopped", batch_id)
            message = f"the job stopped: {type(e).__name__}: {e}"
            self._done(batch_id, lambda: self.events.failed(batch_id, message))
        else:
            if cancelled is None:  # the server is stopping: resumed at the next start
                self._done(batch_id, lambda: None)
            else:
                self._done(batch_id, lambda: self.events.drained(batch_id, cancelled))

    def _done(self, batch_id: str, then: Any) -> None:
        with self.lock:
            self.running.pop(batch_id, None)
        then()

    def _run(self, job: Path) -> bool | None:
        """Drive the job to its end: True if cancelled, False if drained, None if the
        server stopped first."""
        run = self._config(job)
        store = JobStore(job / STORE_FILE)
        try:
            jt = job_task(run, job_format(job))
            workers, plan = self._pool(run, jt.task)
            stages = RayStages(self.ray, run, jt.task, workers, plan, self.hooks)
            steps = drive_job(store, run, jt, stages, self.hooks)
            try:
                for _, results in steps:
                    with self.lock:
                        self.answered += sum(len(r) for r in results)
                    if self.stopping.is_set():
                        return None
            finally:
                steps.close()  # a run cut short ends "interrupted"
            return store.get("cancel") == "1"
        finally:
            store.close()

