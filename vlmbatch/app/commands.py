"""The ``vlmbatch`` commands by name, the exit codes, and the commands that need no model.

``COMMANDS`` names each command's function as ``"module:attr"``: the CLI imports only the
module of the command it runs, so ``--help``, ``status``, ``cancel`` and ``results`` (this
module: argparse namespace -> a call into ``jobs/``) import no torch, transformers, fastapi
or OpenCV; the commands that load or run a model are ``model_commands.py``'s.
``vlmbatch/app/cli.py`` dispatches to them and turns errors into messages.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from vlmbatch.app.config import from_args
from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.common.registry import Registry
from vlmbatch.engine.config import ConfigError
from vlmbatch.jobs.config import ExecutorConfig, RayOptions
from vlmbatch.jobs.embed_sinks import JsonlSink, NpySink, ParquetSink, embed_format_of
from vlmbatch.jobs.export import (
    PARQUET_ROWS_PER_FILE,
    export_embed_requests,
    export_embeddings,
    export_parquet,
    export_text,
    recorded_results,
)
from vlmbatch.jobs.folder import cancel, is_job, job_format, job_task, status
from vlmbatch.jobs.sinks import check_writable, format_of, naming, open_text
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks

EXIT_OK, EXIT_CRASH, EXIT_BAD_INPUT, EXIT_ITEM_ERRORS = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # 128 + SIGINT, 128 + SIGTERM

# options of the Ray executor only
RAY_ONLY = ("address", "preprocess_workers", "model_workers", "model_cpus")


def executor_config(a: argparse.Namespace) -> ExecutorConfig:
    """The run's executor; options typed for the other executor are refused (``ConfigError``),
    not ignored."""
    given: dict[str, str] = getattr(a, "given", {})
    kind = getattr(a, "executor", "local")
    if kind != "ray":
        ray_only = [given[k] for k in RAY_ONLY if k in given]
        if ray_only:
            raise ConfigError(f"{', '.join(ray_only)}: Ray executor options; add --executor ray")
        return ExecutorConfig(kind)
    if "preprocess_threads" in given:
        raise ConfigError("--preprocess-threads applies to in-process runs; with --executor "
                          "ray, decoding runs in Ray tasks: use --preprocess-workers")
    if "threads" in given:
        raise ConfigError("--threads applies to in-process runs; with --executor ray, each "
                          "model actor runs --model-cpus torch threads (what Ray reserves)")
    return ExecutorConfig(kind, from_args(RayOptions, a))


def is_job_arg(a: argparse.Namespace) -> bool:
    return getattr(a, "manifest", None) is not None and is_job(a.manifest)


def cmd_status(a: argparse.Namespace, hooks: FaultHooks = NO_HOOKS) -> int:
    st = status(a.job)
    print(json.dumps({"job": str(a.job), **st.as_json()}) if a.json else st.text())
    return EXIT_OK


def _export_text(job: Path, out: Path | None, fmt: str) -> int:
    """A job's result lines as JSONL or CSV to ``out`` (standard output for None)."""
    if out is None:
        return export_text(job, sys.stdout, fmt)
    with naming(out), open_text(out, fmt) as f:
        return export_text(job, f, fmt)


def cmd_results(a: argparse.Namespace, hooks: FaultHooks = NO_HOOKS) -> int:
    folder = a.out is not None and (a.out.endswith(("/", os.sep)) or Path(a.out).is_dir())
    a.out = Path(a.out) if a.out is not None else None
    if folder or a.rows_per_file is not None:
        return _results_dataset(a, hooks)
    fmt = a.format or format_of(a.out)
    if job_task(a.job) == "embed":
        return embed_results(a)
    if fmt == "npy":
        raise ConfigError("--format npy: a yes/no job's results are lines (JSONL, CSV, "
                          "Parquet); .npy holds an embedding job's vectors")
    if fmt == "parquet" and a.out is None:
        raise ConfigError("--format parquet needs --out FILE.parquet")
    if a.out is None:
        n = _export_text(a.job, None, fmt)
    else:  # all or nothing: an interrupted export (a signal, a full disk) leaves --out as it was
        check_writable(a.out)
        with naming(a.out), replaced_on_success(a.out) as part:  # errors name --out
            if fmt == "parquet":
                n = export_parquet(a.job, part, hooks=hooks)
            else:
                with open_text(part, fmt) as f:
                    n = export_text(a.job, f, fmt, hooks)
    print(f"vlmbatch: {n} result lines", file=sys.stderr)
    return EXIT_OK


def _results_dataset(a: argparse.Namespace, hooks: FaultHooks) -> int:
    """``results JOB -o DIR/ [--rows-per-file N]``: a Parquet dataset, written whole or not
    at all (the folder is built beside DIR and renamed onto it; an existing empty DIR is
    replaced, a DIR with files is refused)."""
    if a.out is None or (a.format or "parquet") != "parquet" or job_task(a.job) == "embed":
        raise ConfigError("a folder --out and --rows-per-file write a yes/no job's results as "
                          "a Parquet dataset: give -o DIR/ (and --format parquet, if any)")
    if a.out.exists() and (not a.out.is_dir() or any(a.out.iterdir())):
        raise ConfigError(f"--out {a.out} already holds files: give a new or empty folder")
    check_writable(a.out)
    with naming(a.out), replaced_on_success(a.out) as part:
        n = export_parquet(a.job, part, hooks=hooks,
                           rows_per_file=a.rows_per_file or PARQUET_ROWS_PER_FILE)
    files = len(list(a.out.glob("*.parquet")))
    print(f"vlmbatch: {n} result lines in {files} Parquet files under {a.out}",
          file=sys.stderr)
    return EXIT_OK


def embed_results(a: argparse.Namespace) -> int:
    """An embedding job's vectors: JSONL (standard output without -o), Parquet or .npy; a job
    of OpenAI embedding requests gives OpenAI batch output lines as its JSONL."""
    fmt = a.format or ("csv" if format_of(a.out) == "csv" else embed_format_of(a.out))
    if fmt == "csv":
        raise ConfigError("an embedding job's results are vectors: JSONL, Parquet or .npy")
    if fmt != "jsonl" and a.out is None:
        raise ConfigError(f"--format {fmt} needs --out FILE.{fmt}")
    openai = fmt == "jsonl" and job_format(a.job) == "openai"  # OpenAI output lines
    if a.out is None:
        n = (export_embed_requests(a.job, sys.stdout) if openai
             else export_embeddings(a.job, JsonlSink(sys.stdout)))
    else:  # all or nothing, errors naming --out (as a yes/no job's `results`)
        check_writable(a.out)
        with naming(a.out), replaced_on_success(a.out) as part:
            if fmt == "jsonl":
                with open(part, "w", encoding="utf-8") as f:
                    n = (export_embed_requests(a.job, f) if openai
                         else export_embeddings(a.job, JsonlSink(f)))
            else:
                n = export_embeddings(a.job, ParquetSink(part) if fmt == "parquet"
                                      else NpySink(part, recorded_results(a.job)))
    print(f"vlmbatch: {n} {'requests' if openai else 'embeddings'}", file=sys.stderr)
    return 0


def cmd_cancel(a: argparse.Namespace, hooks: FaultHooks = NO_HOOKS) -> int:
    state = cancel(a.job)
    if state == "running":
        print(f"vlmbatch: job {a.job}: cancel requested; the running job stops after its "
              "current batch; `vlmbatch resume` continues it", file=sys.stderr)
    else:
        print(f"vlmbatch: job {a.job} is not running ({state}); nothing to cancel",
              file=sys.stderr)
    return EXIT_OK


Command = Callable[[argparse.Namespace, FaultHooks], int]

_MODEL = "vlmbatch.app.model_commands"  # the commands that load or run a model
_LIGHT = "vlmbatch.app.commands"  # this module
_LABELS = "vlmbatch.app.label_commands"  # calibrate and report: no model
COMMANDS: Registry[Command] = Registry("command", {
    "run": f"{_MODEL}:cmd_run", "submit": f"{_MODEL}:cmd_submit",
    "status": f"{_LIGHT}:cmd_status", "cancel": f"{_LIGHT}:cmd_cancel",
    "resume": f"{_MODEL}:cmd_resume", "results": f"{_LIGHT}:cmd_results",
    "eval": f"{_MODEL}:cmd_eval", "calibrate": f"{_LABELS}:cmd_calibrate",
    "report": f"{_LABELS}:cmd_report", "quantize": f"{_MODEL}:cmd_quantize",
    "export-vit": f"{_MODEL}:cmd_export_vit", "embed": f"{_MODEL}:cmd_embed",
    "serve": f"{_MODEL}:cmd_serve"})
