"""Batch jobs on disk: submit, run/resume, status, results, cancel.

A job is a folder::

    JOB/job.json       what to run: model and engine config, batch size, pixel limit, source
    JOB/store.sqlite   every item, its state and its result lines (jobs/store.py)
    JOB/run.lock       held (flock) by the one process running the job

``submit`` validates the input (as ``vlmbatch run`` does) and writes both; ``run`` answers the
pending items group by group, recording each group's results in one transaction, so a killed
run loses only the group in flight and ``resume`` (= ``run``) finishes the rest, every item
recorded exactly once; ``resume --retry-failed`` first puts the failed items back in the
queue. ``cancel`` sets a flag the running job checks between groups. ``status`` reads the
store and works from another shell while a job runs; a run that died without marking the store
(kill -9, a lost machine) shows as ``interrupted`` once its lock is free (the kernel frees it
when the process dies, whatever its pid becomes).

Paths (manifest, images, model) are stored absolute, so a job runs from any directory.

Two executors feed the same store: in this process (``run_job``'s default), or Ray workers
(``jobs/ray_executor.py``, ``--executor ray``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from jobs.lock import host_id, recorded_runner, run_alive, run_lock, runner_of, who
from jobs.manifest import (
    ManifestError,
    first_line,
    items_from_folder,
    iter_manifest,
    manifest_format,
    read_policy,
)
from jobs.runner import prepared_groups, score_group
from jobs.store import JobStore
from pipeline.config import (
    ConfigError,
    EngineConfig,
    ModelConfig,
    RunConfig,
    check_threads,
    preprocess_threads_for,
)
from pipeline.engines import build_engine

JOB_FILE, STORE_FILE = "job.json", "store.sqlite"


def is_job(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / JOB_FILE).is_file()


def _config_json(cfg: RunConfig) -> dict:
    def plain(obj: object) -> dict[str, Any]:
        d = dataclasses.asdict(obj)  # type: ignore[call-overload]
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}

    def absolute(p: Path | None) -> str | None:
        return str(Path(p).absolute()) if p else None

    fmt = manifest_format(cfg.manifest) if cfg.manifest else "vlmbatch"
    model = plain(cfg.model)
    model["path"] = absolute(cfg.model.path)
    return {"version": 1, "format": fmt, "model": model, "engine": plain(cfg.engine),
            "images_per_batch": cfg.images_per_batch, "max_pixels": cfg.max_pixels,
            "threads": cfg.threads, "preprocess_threads": cfg.preprocess_threads,
            "source": {"manifest": absolute(cfg.manifest), "images": absolute(cfg.images),
                       "policy": absolute(cfg.policy)}}


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfig
    engine: EngineConfig
    images_per_batch: int
    max_pixels: int
    threads: int | None
    preprocess_threads: int | None = None  # None: auto (jobs from before the option too)

    @classmethod
    def load(cls, job: Path) -> JobConfig:
        d = read_job_file(job)
        m = dict(d["model"])
        m["path"] = Path(m["path"]) if m["path"] else None
        e: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                             for k, v in d["engine"].items()}
        if not e.get("max_new_tokens"):  # jobs from before --ignore-eos needed it: no effect
            e["ignore_eos"] = False
        return cls(ModelConfig(**m), EngineConfig(**e), d["images_per_batch"],
                   d["max_pixels"], d.get("threads"), d.get("preprocess_threads"))

    def for_run(self, threads: int | None, preprocess_threads: int | None) -> JobConfig:
        """This config with one run's thread counts in place of those given at submit (None:
        keep them). Threads change no answer, only speed, and a job may run on another
        machine than the one it was submitted on; nothing is written back."""
        check_threads(threads, preprocess_threads)
        return dataclasses.replace(
            self, threads=self.threads if threads is None else threads,
            preprocess_threads=(self.preprocess_threads if preprocess_threads is None
                                else preprocess_threads))


def submit(cfg: RunConfig, job: Path) -> int:
    """Create the job folder; returns the number of items. Fails before writing anything if
    the input or the model folder is invalid, or the folder already holds a job. The device
    is checked when the job runs (it may run on another machine)."""
    from pipeline.model import DEFAULT_MODEL, read_spec

    job = Path(job)
    if job.exists() and (not job.is_dir() or any(job.iterdir())):
        raise ManifestError(f"{job} already exists and is not an empty folder; pick a new job "
                            "folder (or `vlmbatch resume` it if it is a job)")
    read_spec(cfg.model.path or DEFAULT_MODEL)  # raises ModelError naming what is wrong
    policy = read_policy(cfg.policy) if cfg.policy else ()
    manifest = cfg.manifest

    def first(item_id: str) -> str:  # a repeated id's first line (only ids are stored)
        assert manifest is not None
        return f"line {first_line(manifest, item_id, policy)}"

    if manifest is not None:  # streamed: memory stays bounded for any manifest size
        items = ((f"{manifest}:{ln}", it) for ln, it in iter_manifest(manifest, policy))
    else:
        assert cfg.images is not None
        items = ((str(cfg.images), it) for it in items_from_folder(cfg.images, policy))
    job.mkdir(parents=True, exist_ok=True)
    store = JobStore(job / STORE_FILE)
    try:
        n = store.add_items(items, first if manifest is not None else None)
        store.set("status", "submitted")
        store.set("created", str(time.time()))
    except BaseException:
        store.close()
        shutil.rmtree(job)  # nothing half-made is left behind
        raise
    store.close()
    (job / JOB_FILE).write_text(json.dumps(_config_json(cfg), indent=2) + "\n")
    return n


@dataclass(frozen=True)
class JobStatus:
    status: str
    items: int
    done: int
    failed: int
    pending: int
    questions: int  # answered or failed so far
    qpm: float | None  # of the current/last run
    eta_s: float | None
    requeued: int = 0  # failed items this run queued again (run_job(retry_failed=True))
    runner: tuple[int, str] | None = None  # (pid, host) running the job, when running

    def text(self) -> str:
        rate = f"{self.qpm:.0f} QPM" if self.qpm else "QPM n/a"
        eta = (f", ETA {self.eta_s:.0f}s" if self.eta_s is not None and self.pending
               and self.status == "running" else "")
        return (f"{self.status}{who(self.runner)}: {self.done + self.failed}/{self.items} "
                f"images ({self.failed} failed, {self.pending} pending), {self.questions} "
                f"questions, {rate}{eta}")

    def as_json(self) -> dict:
        """``status --json``: these fields, ``runner`` as {"pid", "host"} or null, and
        ``eta_s`` null unless the job is running with items left (as ``text`` shows it)."""
        d = dataclasses.asdict(self)
        d["runner"] = dict(zip(("pid", "host"), self.runner)) if self.runner else None
        if not (self.status == "running" and self.pending):
            d["eta_s"] = None
        del d["requeued"]  # about one run_job call, not the job
        return d


def status(job: Path) -> JobStatus:
    require_job(job)
    store = JobStore(Path(job) / STORE_FILE)
    try:
        c = store.counts()
        q, answered = store.questions_done(), store.questions_answered()
        qpm = eta = None
        start, q0 = store.get("run_started"), store.get("run_answered_at_start")
        end = float(store.get("run_ended") or time.time())
        if start and q0 is not None and end > float(start) and answered > int(q0):
            qpm = 60 * (answered - int(q0)) / (end - float(start))
            done_items = c.done + c.failed - int(store.get("run_items_at_start") or 0)
            if done_items > 0:
                eta = c.pending * (end - float(start)) / done_items
        state = _state(store)
        runner = (runner_of(Path(job)) or recorded_runner(store)) if state == "running" else None
        return JobStatus(state, c.total, c.done, c.failed, c.pending, q, qpm, eta,
                         runner=runner)
    finally:
        store.close()


def cancel(job: Path) -> str:
    """Ask a running job to stop after its current group; returns the job's status. The flag
    is set whenever the store says ``running``."""
    require_job(job)
    store = JobStore(Path(job) / STORE_FILE)
    try:
        if store.get("status") == "running":  # even if it looks interrupted: a stray flag is
            store.set("cancel", "1")         # harmless (the next run clears it)
        return _state(store)
    finally:
        store.close()


def _requeue_failed(job: Path) -> int:
    """Put a job's failed items back in its queue (``run_job(retry_failed=True)``, under
    its lock)."""
    store = JobStore(job / STORE_FILE)
    try:
        return store.requeue_failed()
    finally:
        store.close()


def run_job(job: Path, progress: bool = True, executor: str = "local",
            ray_options=None, retry_failed: bool = False, threads: int | None = None,  # noqa: ANN001
            preprocess_threads: int | None = None) -> JobStatus:
    """Answer every pending item (a fresh run or a resume), in this process (``local``) or
    on Ray (``ray``, ``jobs/ray_executor.py``); with ``retry_failed``, first queue the failed
    items again, under the same lock. In-process, ``threads``/``preprocess_threads`` replace
    the job's own for this run (``JobConfig.for_run``); on Ray, where each model actor runs
    ``model_cpus`` torch threads, they are refused. Raises ``JobBusy`` if another process is
    running the job."""
    require_job(job)
    if executor not in ("local", "ray"):
        raise ManifestError(f"executor {executor!r} not one of local, ray")
    if executor == "ray" and (threads, preprocess_threads) != (None, None):
        raise ConfigError("threads and preprocess_threads apply to in-process runs; on Ray "
                          "use model_cpus (--model-cpus) and preprocess_workers")
    cfg = JobConfig.load(Path(job)).for_run(threads, preprocess_threads)
    with run_lock(Path(job)):
        requeued = _requeue_failed(Path(job)) if retry_failed else 0
        if executor == "ray":
            from jobs.ray_executor import RayOptions, run_job_ray

            st = run_job_ray(job, ray_options or RayOptions(), progress)
        else:
            st = _run_local(Path(job), progress, cfg)
    return dataclasses.replace(st, requeued=requeued)


def _run_local(job: Path, progress: bool, cfg: JobConfig) -> JobStatus:
    store = JobStore(job / STORE_FILE)
    delay = float(os.environ.get("VLMBATCH_TEST_GROUP_DELAY", "0"))  # tests: widen the window
    try:
        c = store.counts()
        if c.pending == 0:
            store.set("status", "done")
            return status(job)
        if cfg.threads:
            import torch

            torch.set_num_threads(cfg.threads)
        engine, tiling = build_engine(cfg.model, cfg.engine)
        _begin_run(store, c)
        bar = tqdm(total=c.total, initial=c.total - c.pending, unit="img", disable=not progress,
                   file=sys.stderr, desc=f"job {job.name}", dynamic_ncols=True)
        final = "interrupted"  # unless the loop ends normally
        threads = preprocess_threads_for(cfg.preprocess_threads, cfg.model.device)
        groups = prepared_groups(store.pending(cfg.images_per_batch), tiling, cfg.max_pixels,
                                 threads)  # groups prepared ahead stay pending if we stop
        try:
            for pg in groups:
                if store.get("cancel") == "1":
                    final = "cancelled"
                    break
                by_item: dict[str, list[dict]] = {}
                for line in score_group(engine, pg):
                    by_item.setdefault(line["id"], []).append(line)
                store.record(by_item)
                bar.update(len(pg.group))
                if delay:
                    time.sleep(delay)
            else:
                final = "done"
        finally:  # the job's state first: a second signal may cut the rest short
            _end_run(store, final)
            groups.close()  # stops the preprocessing threads
            bar.close()
    finally:
        store.close()
    return status(job)


def _begin_run(store: JobStore, c) -> None:  # noqa: ANN001
    """Mark a run as started (what ``status`` computes QPM and ETA from)."""
    store.set("cancel", "0")
    store.set("status", "running")
    store.set("run_started", str(time.time()))
    store.set("run_answered_at_start", str(store.questions_answered()))
    store.set("run_items_at_start", str(c.done + c.failed))
    store.set("run_pid", str(os.getpid()))
    store.set("run_host", host_id())
    store.db.execute("DELETE FROM meta WHERE key = 'run_ended'")


def _end_run(store: JobStore, final: str) -> None:
    store.set("status", final if store.counts().pending else "done")
    store.set("run_ended", str(time.time()))


def _state(store: JobStore) -> str:
    state = store.get("status") or "?"
    return "interrupted" if state == "running" and not run_alive(store) else state


def read_job_file(job: Path) -> dict:
    try:
        d = json.loads((Path(job) / JOB_FILE).read_text())
    except (ValueError, OSError) as e:
        raise ManifestError(f"{Path(job) / JOB_FILE} is not readable ({e}); the job folder is "
                            "damaged: submit the job again") from None
    if not isinstance(d, dict) or not {"model", "engine"} <= d.keys():
        raise ManifestError(f"{Path(job) / JOB_FILE} lacks the job's model and engine "
                            "settings; the job folder is damaged: submit the job again")
    return d


def require_job(job: Path) -> None:
    if not is_job(job):
        raise ManifestError(f"{job} is not a vlmbatch job folder (no {JOB_FILE}); create one "
                            "with `vlmbatch submit`")
    if not (Path(job) / STORE_FILE).is_file():
        raise ManifestError(f"{Path(job) / STORE_FILE} is missing; the job folder is damaged: "
                            "submit the job again")
