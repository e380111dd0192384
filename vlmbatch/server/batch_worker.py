"""The batch worker: one thread that validates new batches into jobs and writes finished
batches' output files, so neither holds up the engine thread (which answers requests and
runs the jobs' groups, ``serving/scheduler.py``); ``BookEvents`` moves a batch's record on
when its job is drained, has failed or was let go.

Validation reads the input file line by line (bounded memory) as ``vlmbatch submit`` would
(chat: ``inputs.manifest.iter_manifest``, OpenAI batch lines only, every image URL checked
against the server's media policy, ``media.py``: an http(s) URL under
``--allow-remote-media`` passes, its host checked by the SSRF guard when the job fetches it,
a refusal that line's ``source`` error; embeddings: ``inputs.openai_embeddings``, every
line checked and each ``dimensions`` against the embedding model), and then submits the
file as a job (an embeddings batch: task ``embed`` on the embedding model, one item per
request). Any problem fails the batch, its ``errors`` naming the lines (at most
``MAX_ERRORS``).

Finalizing writes the job's answered lines to ``file-<batch>-output`` and its failed lines to
``file-<batch>-errors``, as ``vlmbatch run`` writes them (``inputs.openai_batch.to_output``;
embeddings: ``inputs.openai_embeddings.to_embed_output``), in input order; doing it twice writes
the same files.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from vlmbatch.engine.config import ConfigError, EmbedConfig
from vlmbatch.engine.embed import check_embed_config
from vlmbatch.engine.loading import text_tokens
from vlmbatch.inputs.manifest import iter_manifest, manifest_format
from vlmbatch.inputs.openai_embeddings import iter_embed_requests
from vlmbatch.jobs.config import RunConfig
from vlmbatch.jobs.folder import STORE_FILE, is_job
from vlmbatch.jobs.job import submit
from vlmbatch.jobs.store import JobStore
from vlmbatch.outputs.export import embed_request_lines
from vlmbatch.outputs.lines import to_output
from vlmbatch.pipeline.questions import ManifestError, PromptLimits, PromptTooLong
from vlmbatch.server.batches import (
    CHAT,
    EMBEDDINGS,
    BatchBook,
    BatchRecord,
    job_counts,
)
from vlmbatch.server.config import ServerConfig
from vlmbatch.server.files import FileStore
from vlmbatch.server.media import MediaRefused, check_image_url, media_urls
from vlmbatch.serving.errors import APIError

log = logging.getLogger("vlmbatch.server")
MAX_ERRORS = 100


def line_error(message: str, line: int | None = None, code: str = "invalid_request") -> dict:
    return {"code": code, "message": message, "param": None, "line": line}


def input_errors(path: Path, cfg: ServerConfig) -> list[dict]:
    """What is wrong with a batch input file (empty: nothing), each naming its line."""
    if manifest_format(path) != "openai":
        return [line_error("the input file is not an OpenAI batch file: each line needs "
                           "custom_id, method, url and body", 1)]
    errors: list[dict] = []
    where = re.compile(re.escape(str(path)) + r":(\d+): ")
    count, context = text_tokens(cfg.model.path)  # a line's question: as chat's, and the model's
    limits = PromptLimits(cfg.max_prompt_chars, context, count)  # context, the line's error
    try:
        for lineno, item in iter_manifest(path, limits=limits):
            try:
                # an http(s) host is checked when the line is fetched: that line's error
                for url in media_urls(item.image):
                    check_image_url(url, cfg.allowed_local_media_path, cfg.remote_media,
                                    hosts=False)
            except MediaRefused as e:
                errors.append(line_error(str(e), lineno, "invalid_image_url"))
                if len(errors) >= MAX_ERRORS:
                    break
    except ManifestError as e:
        text = str(e)
        m = where.match(text)
        errors.append(line_error(text[m.end():] if m else text.replace(str(path), "input file"),
                                 int(m.group(1)) if m else None,
                                 "context_length_exceeded" if isinstance(e, PromptTooLong)
                                 else "invalid_request"))
    return errors


def embed_input_errors(path: Path, cfg: ServerConfig) -> list[dict]:
    """What is wrong with an embeddings batch file: every bad line (at most ``MAX_ERRORS``),
    read as ``vlmbatch submit --task embed`` reads it (``inputs/openai_embeddings.py``), and each
    ``dimensions`` checked against the sizes the embedding model declares."""
    if manifest_format(path) != "openai":
        return [line_error("the input file is not an OpenAI batch file: each line needs "
                           "custom_id, method, url and body", 1)]
    errors: list[dict] = []

    def bad(line: int, message: str) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append(line_error(message, line))

    sizes = check_embed_config(cfg.embed_model_dir, EmbedConfig()).spec.matryoshka_dims
    have = (f"declares the sizes {list(sizes)}: give one of them" if sizes
            else "declares no Matryoshka sizes")
    try:
        for lineno, req in iter_embed_requests(path, bad):
            if req.dimensions is not None and req.dimensions not in sizes:
                bad(lineno, f"body.dimensions {req.dimensions}: the embedding model {have}, "
                    "or leave dimensions out for its full size")
    except ManifestError as e:
        errors.append(line_error(str(e).replace(str(path), "input file")))
    return errors


def batch_run_config(path: Path, cfg: ServerConfig, endpoint: str = CHAT) -> RunConfig:
    """The job of a batch: the server's model and engine (for embeddings, its embedding
    model: task ``embed``), its group size, pixel limit and decode deadline."""
    embed = endpoint == EMBEDDINGS
    return RunConfig(manifest=path, images_per_batch=cfg.images_per_batch,
                     prepare=cfg.prepare, progress=False, max_prompt_chars=cfg.max_prompt_chars,
                     model=cfg.embed_model_config if embed else cfg.model,
                     engine=cfg.engine, task="embed" if embed else "answer",
                     # one pooled vector per string, as /v1/embeddings (not a multi-vector
                     # checkpoint's default)
                     embed=EmbedConfig(multi_vector=False) if embed else EmbedConfig())


def _lines(job: Path, failed: bool, endpoint: str, model: str) -> Iterator[str]:
    if endpoint == EMBEDDINGS:
        for line in embed_request_lines(job, model):
            if (line["error"] is not None) == failed:
                yield json.dumps(line, ensure_ascii=False) + "\n"
        return
    store = JobStore(job / STORE_FILE)
    try:
        for a in store.answers():
            if bool(a.error) == failed:
                yield json.dumps(to_output(a), ensure_ascii=False) + "\n"
    finally:
        store.close()


class BatchWorker:
    def __init__(self, cfg: ServerConfig, book: BatchBook, files: FileStore) -> None:
        self.cfg, self.book, self.files = cfg, book, files
        self.enqueue: Callable[[str], None] = lambda batch_id: None  # set by start
        self.tasks: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="vlmbatch-batches", daemon=True)

    def start(self, enqueue: Callable[[str], None]) -> None:
        """Run the tasks; a validated batch is handed to ``enqueue`` (the engine thread)."""
        self.enqueue = enqueue
        self.thread.start()

    def stop(self, timeout: float) -> None:
        self.tasks.put(None)
        self.thread.join(timeout)

    def validate(self, batch_id: str) -> None:
        self.tasks.put(("validate", batch_id))

    def finalize(self, batch_id: str) -> None:
        self.tasks.put(("finalize", batch_id))

    def _run(self) -> None:
        while (task := self.tasks.get()) is not None:
            kind, batch_id = task
            try:
                (self._validate if kind == "validate" else self._finalize)(batch_id)
            except Exception as e:  # noqa: BLE001  (one batch's trouble, not the server's)
                log.exception("batch %s: %s failed", batch_id, kind)
                err = line_error(f"server error while {kind}ing: {type(e).__name__}: {e}",
                                 None, "server_error")
                self.book.update(batch_id, lambda r: r.at("failed", errors=[err]))

    def _validate(self, batch_id: str) -> None:
        rec = self.book.get(batch_id)
        if rec.status != "validating":
            return self._finalize(batch_id) if rec.status == "cancelling" else None
        try:
            path = self.files.path(rec.input_file_id)
        except APIError:
            errors = [line_error(f"input file {rec.input_file_id} was deleted before the "
                                 "batch was validated", None, "file_not_found")]
        else:
            errors = (embed_input_errors(path, self.cfg) if rec.endpoint == EMBEDDINGS
                      else input_errors(path, self.cfg))
        if errors:
            self.book.update(batch_id, lambda r: r.at("failed", errors=errors,
                                                      counts=_zero()))
            return None
        job = self.book.job_of(batch_id)
        shutil.rmtree(job, ignore_errors=True)  # a submit cut short by a kill
        try:
            submit(batch_run_config(path, self.cfg, rec.endpoint), job)
        except (ManifestError, ConfigError) as e:  # e.g. a custom_id repeated (the store's
            # UNIQUE key), or a label set --choice-scoring first-token cannot tell apart
            msg = str(e).replace(str(path), "input file")
            self.book.update(batch_id, lambda r: r.at("failed", errors=[line_error(msg)],
                                                      counts=_zero()))
            return None
        rec = self.book.update(batch_id, lambda r: r.at("in_progress")
                               if r.status == "validating" else r)
        if rec.status == "cancelling":
            return self._finalize(batch_id)
        self.enqueue(batch_id)
        return None

    def _lines(self, job: Path, failed: bool, endpoint: str) -> Iterator[str]:
        return _lines(job, failed, endpoint, self.cfg.served_model_name)

    def _finalize(self, batch_id: str) -> None:
        rec = self.book.get(batch_id)
        if rec.status not in ("finalizing", "cancelling"):
            return
        job = self.book.job_of(batch_id)
        out = err = None
        counts = _zero()
        if is_job(job):
            counts = job_counts(job)
            hexid = batch_id.removeprefix("batch_")
            if counts["completed"]:
                out = self.files.write(f"file-{hexid}-output", f"{batch_id}_output.jsonl",
                                       self._lines(job, False, rec.endpoint)).id
            if counts["failed"]:
                err = self.files.write(f"file-{hexid}-errors", f"{batch_id}_errors.jsonl",
                                       self._lines(job, True, rec.endpoint)).id

        def done(r: BatchRecord) -> BatchRecord:
            final = "cancelled" if r.status == "cancelling" else "completed"
            return r.at(final, output_file_id=out, error_file_id=err, counts=counts)

        self.book.update(batch_id, done)


class BookEvents:
    """``serving.scheduler.BatchEvents`` on the batch records (the HTTP process alone writes
    ``batches/``): drained -> ``finalizing`` and the output files written (``finalize``);
    failed -> ``failed``, ``errors`` saying why; let go -> as it is, unless it was cancelled
    meanwhile (then finalized)."""

    def __init__(self, book: BatchBook, finalize: Callable[[str], None]) -> None:
        self.book, self.finalize = book, finalize

    def drained(self, batch_id: str, cancelled: bool) -> None:
        if not cancelled:
            self.book.update(batch_id, lambda r: r.at("finalizing")
                             if r.status == "in_progress" else r)
        self.finalize(batch_id)

    def failed(self, batch_id: str, message: str) -> None:
        err = line_error(message, None, "server_error")
        self.book.update(batch_id, lambda r: r.at("failed", errors=[err]))

    def released(self, batch_id: str) -> None:
        if self.book.get(batch_id).status == "cancelling":
            self.finalize(batch_id)


def _zero() -> dict[str, int]:
    return {"total": 0, "completed": 0, "failed": 0}
