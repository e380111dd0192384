"""One batch's job, run a group at a time by the engine thread with the server's engine
(the chat engine for a chat batch, the embedding model's for an embedding batch: the job's
task, ``jobs/tasks.py``, says which and how).

It is what ``vlmbatch run JOB`` does (``jobs/job.py``), cut into steps so that the engine
thread can answer interactive requests between groups: the job's lock (``run.lock``: one
process per job, so ``vlmbatch run`` on the same folder is refused meanwhile), the store's
run marks (``status`` reads them), pending items prepared ahead on preprocessing threads
(``pipeline.drive.prepared_groups``), and each group's answers recorded with their state
change in one transaction, only for items still pending. A server killed mid-batch loses
at most the group in flight; started again it continues with the items still pending.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path

from vlmbatch.app.server.config import ServerConfig
from vlmbatch.jobs.errors import ManifestError
from vlmbatch.jobs.folder import STORE_FILE, load_config
from vlmbatch.jobs.lock import host_id, run_lock
from vlmbatch.jobs.store import JobStore
from vlmbatch.jobs.tasks import task_of
from vlmbatch.pipeline.config import ConfigError, ModelConfig, preprocess_threads_for
from vlmbatch.pipeline.engine import Engine


class JobRunError(Exception):
    """The job cannot be run by this server now (another process runs it, its folder is
    damaged, it was submitted with another model, it embeds and this server has no
    embedding model): the batch is left as it is."""


def _absolute(m: ModelConfig) -> ModelConfig:
    return dataclasses.replace(m, path=Path(m.path).absolute() if m.path else None)


class JobRun:
    def __init__(self, batch_id: str, job: Path, engines: Mapping[str, Engine],
                 cfg: ServerConfig) -> None:
        """``engines``: the server's engine per task (``jobs/tasks.py``: answer, embed)."""
        self.batch_id = batch_id
        self._exit = ExitStack()
        try:
            run = load_config(job)
            engine = engines.get(run.task)
            if engine is None:
                raise JobRunError(f"the batch's job has task {run.task!r}, which this server "
                                  "does not run (started with --no-embeddings?); start it "
                                  "with embeddings to finish the batch")
            want = cfg.embed_model_config if run.task == "embed" else cfg.model
            if (_absolute(run.model), run.engine) != (_absolute(want), cfg.engine):
                raise JobRunError("the batch was submitted to a server with another model or "
                                  "engine settings; start the server with those to finish it")
            self._exit.enter_context(run_lock(job))
            self.store = JobStore(job / STORE_FILE)
            self._exit.callback(self.store.close)
            self.task = task_of(run)
            self.stage2 = self.task.model(engine, run)
        except (ManifestError, ConfigError) as e:  # JobBusy included: `vlmbatch run` has it
            self._exit.close()
            raise JobRunError(str(e)) from None
        except BaseException:
            self._exit.close()
            raise
        self.store.begin_run(self.store.counts(), host_id())
        threads = preprocess_threads_for(cfg.preprocess_threads, cfg.model.device)
        # pending items are read from the store in this (the engine) thread only
        pending = self.store.pending(run.images_per_batch, self.task.from_json)
        # decoder processes under the job's --decode-timeout, as `vlmbatch run JOB`: a hung
        # or crashing image fails that item, never the engine thread (or the server)
        self.groups = self.task.prepared(pending, engine.image_plan, run.max_pixels, threads,
                                         decode_timeout=run.executor.decode_timeout)
        self._exit.callback(self.groups.close)

    def step(self) -> bool:
        """Answer (or embed) and record the next group; False when none is left."""
        pg = next(self.groups, None)
        if pg is None:
            return False
        self.store.record(self.task.by_item(self.stage2(pg)))
        return True

    def close(self, final: str) -> None:
        """End the run: the store says ``final`` (``done`` when nothing is pending)."""
        try:
            self.store.end_run(final)
        finally:
            self._exit.close()
