"""A job folder: its files, its stored config, its status. Shared by the in-process runner
(``jobs/job.py``) and the Ray executor (``jobs/ray_executor.py``)::

    JOB/job.json       {"version", "format", "config": the serialised RunConfig}
    JOB/store.sqlite   every item, its state and its answers (jobs/store.py)
    JOB/run.lock       held (flock) by the one process running the job (jobs/lock.py)

``status`` reads the store and works from another shell while a job runs (``cancel`` sets
its flag from there too); a run that died without marking the store (kill -9, a lost
machine) shows as ``interrupted`` once its lock is free (the kernel frees it when the process
dies, whatever its pid becomes). Light (no torch, no decoding): ``vlmbatch status`` and
``cancel`` import only this, the store and the config tree.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from vlmbatch.engine.config import ConfigError
from vlmbatch.jobs.config import RunConfig, from_json, to_json
from vlmbatch.jobs.lock import recorded_runner, run_alive, runner_of, who
from vlmbatch.jobs.store import JobStore
from vlmbatch.pipeline.questions import ManifestError

JOB_FILE, STORE_FILE = "job.json", "store.sqlite"


def is_job(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / JOB_FILE).is_file()


def require_job(job: Path) -> None:
    if not is_job(job):
        raise ManifestError(f"{job} is not a vlmbatch job folder (no {JOB_FILE}); create one "
                            "with `vlmbatch submit`")
    if not (Path(job) / STORE_FILE).is_file():
        raise ManifestError(f"{Path(job) / STORE_FILE} is missing; the job folder is damaged: "
                            "submit the job again")


def write_job_file(job: Path, cfg: RunConfig, fmt: str) -> None:
    """``job.json`` at ``RunConfig.VERSION`` (3 added the task and its embedding settings, 4
    moved ``decode_timeout`` from the Ray options to the executor's, 5 moved it, the pixel
    limit and the preprocessing threads into ``prepare``, 6 added tabular and sharded inputs,
    the fetch stage's settings and ``engine.choice_scoring``, all with defaults that read a
    version-5 file as it was;
    ``load_config`` reads every earlier version)."""
    # ``--dtype auto`` resolved here, so job.json says what the job runs in, wherever it runs
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                          dtype=cfg.model.resolved_dtype))
    d = {"version": RunConfig.VERSION, "format": fmt, "config": to_json(cfg)}
    (Path(job) / JOB_FILE).write_text(json.dumps(d, indent=2) + "\n")


def read_job_file(job: Path) -> dict:
    try:
        d = json.loads((Path(job) / JOB_FILE).read_text())
    except (ValueError, OSError) as e:
        raise ManifestError(f"{Path(job) / JOB_FILE} is not readable ({e}); the job folder is "
                            "damaged: submit the job again") from None
    if not isinstance(d, dict) or not ({"config"} <= d.keys() or {"model", "engine"} <= d.keys()):
        raise ManifestError(f"{Path(job) / JOB_FILE} lacks the job's model and engine "
                            "settings; the job folder is damaged: submit the job again")
    return d


def job_task_name(job: Path) -> str:
    """The job's task ("answer" for jobs from before embeddings), read off job.json."""
    body = read_job_file(job).get("config", {})
    return str(body.get("task", "answer")) if isinstance(body, dict) else "answer"


def job_format(job: Path) -> str:
    """"openai" if the job was submitted from an OpenAI batch file, else "vlmbatch"."""
    return read_job_file(job).get("format", "vlmbatch")


def load_config(job: Path) -> RunConfig:
    """The RunConfig a job was submitted with (version 1 files too: their layout is mapped)."""
    d = read_job_file(job)
    version = d.get("version", 1)
    if version > RunConfig.VERSION:
        raise ManifestError(f"{Path(job) / JOB_FILE} was written by a newer vlmbatch (job "
                            f"format {version}; this one reads up to {RunConfig.VERSION}); "
                            "run the job with that version")
    body = d["config"] if version >= 2 else _from_v1(d)
    if version < 4:
        body = _decode_timeout_to_executor(body)
    if version < 5:
        body = _prepare_apart(body)
    try:
        return from_json(RunConfig, body)
    except (ConfigError, TypeError, ValueError) as e:
        raise ManifestError(f"{Path(job) / JOB_FILE}: {e}; the job folder is damaged: "
                            "submit the job again") from None


def _decode_timeout_to_executor(body: dict) -> dict:
    """A version-2 or -3 config (decode_timeout among the Ray options) in version 4's layout."""
    executor = dict(body.get("executor") or {})
    ray = dict(executor.get("ray") or {})
    if "decode_timeout" in ray:
        executor["decode_timeout"] = ray.pop("decode_timeout")
        executor["ray"] = ray
    return {**body, "executor": executor} if executor else body


def _prepare_apart(body: dict) -> dict:
    """A version-4 (or earlier, mapped to 4) config in version 5's layout: ``max_pixels``,
    ``preprocess_threads`` and the executor's ``decode_timeout`` in ``prepare``."""
    body, executor = dict(body), dict(body.get("executor") or {})
    prepare = {k: body.pop(k) for k in ("max_pixels", "preprocess_threads") if k in body}
    if "decode_timeout" in executor:
        prepare["decode_timeout"] = executor.pop("decode_timeout")
    if "executor" in body:
        body["executor"] = executor
    return {**body, "prepare": prepare} if prepare else body


def _from_v1(d: dict) -> dict:
    """A version-1 job.json (flat model/engine/source keys) in version 2's layout."""
    engine = dict(d["engine"])
    if not engine.get("max_new_tokens"):  # jobs from before --ignore-eos needed it: no effect
        engine["ignore_eos"] = False
    src = d.get("source", {})
    return {"manifest": src.get("manifest"), "images": src.get("images"),
            "policy": src.get("policy"), "images_per_batch": d["images_per_batch"],
            "max_pixels": d["max_pixels"], "threads": d.get("threads"),
            "preprocess_threads": d.get("preprocess_threads"), "model": d["model"],
            "engine": engine}


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
    task: str = "answer"  # what the job does (jobs.config.TASKS); "embed": questions and
    # qpm count embeddings
    reused: int = 0  # answers copied from an earlier job (jobs/reuse.py), of ``questions``

    def text(self) -> str:
        per, unit = ("embeddings/min", "embeddings") if self.task == "embed" else (
            "QPM", "questions")
        rate = f"{self.qpm:.0f} {per}" if self.qpm else f"{per} n/a"
        eta = (f", ETA {self.eta_s:.0f}s" if self.eta_s is not None and self.pending
               and self.status == "running" else "")
        what = "items" if self.task == "embed" else "images"
        reused = (f" ({self.reused} reused, {self.questions - self.reused} computed)"
                  if self.reused else "")
        return (f"{self.status}{who(self.runner)}: {self.done + self.failed}/{self.items} "
                f"{what} ({self.failed} failed, {self.pending} pending), {self.questions} "
                f"{unit}{reused}, {rate}{eta}")

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
        st = state(store)
        runner = (runner_of(Path(job)) or recorded_runner(store)) if st == "running" else None
        return JobStatus(st, c.total, c.done, c.failed, c.pending, q, qpm, eta, runner=runner,
                         task=job_task_name(Path(job)),
                         reused=int(store.get("reused_answers") or 0))
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
        return state(store)
    finally:
        store.close()


def state(store: JobStore) -> str:
    """The job's status, ``interrupted`` for a run that died without saying so."""
    st = store.get("status") or "?"
    return "interrupted" if st == "running" and not run_alive(store) else st
