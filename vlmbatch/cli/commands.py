"""The ``vlmbatch`` commands by name, the exit codes, and the commands that need no model.

``HANDLERS`` names each command's function as ``"module:attr"``: the CLI imports only the
module of the command it runs, so ``--help``, ``status``, ``cancel`` and ``results`` (this
module: the command line -> its config root, built once -> a call into ``jobs/``) import no
torch, transformers, fastapi or OpenCV; the commands that load or run a model are
``model_commands.py``'s.
``vlmbatch/cli/main.py`` dispatches to them and turns errors into messages.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from vlmbatch.cli.args import CommandLine
from vlmbatch.cli.config import JobConfig, ResultsConfig
from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.common.options import build
from vlmbatch.common.registry import Registry
from vlmbatch.engine.config import ConfigError
from vlmbatch.jobs.folder import cancel, is_job, job_format, job_task_name, status
from vlmbatch.outputs.embed_sinks import JsonlSink, NpySink, ParquetSink, embed_format_of
from vlmbatch.outputs.export import (
    PARQUET_ROWS_PER_FILE,
    export_embed_requests,
    export_embeddings,
    export_parquet,
    export_text,
    recorded_results,
)
from vlmbatch.outputs.sinks import check_writable, format_of, naming, open_text
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks

EXIT_OK, EXIT_CRASH, EXIT_BAD_INPUT, EXIT_ITEM_ERRORS = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # 128 + SIGINT, 128 + SIGTERM


def typed_job(line: CommandLine) -> Path | None:
    """The job folder ``run JOB`` was given, else None (a manifest, a table, ``--images``)."""
    given = line.typed.get("manifest")
    return Path(given) if given is not None and is_job(given) else None


def cmd_status(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    cfg = build(JobConfig, line.typed)
    st = status(cfg.job)
    print(json.dumps({"job": str(cfg.job), **st.as_json()}) if cfg.json else st.text())
    return EXIT_OK


def _export_text(job: Path, out: Path | None, fmt: str) -> int:
    """A job's result lines as JSONL or CSV to ``out`` (standard output for None)."""
    if out is None:
        return export_text(job, sys.stdout, fmt)
    with naming(out), open_text(out, fmt) as f:
        return export_text(job, f, fmt)


def cmd_results(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    cfg = build(ResultsConfig, line.typed)
    job, out = cfg.job, cfg.out_path
    if cfg.to_folder or cfg.rows_per_file is not None:
        return _results_dataset(cfg, hooks)
    fmt = cfg.format or format_of(out)
    if job_task_name(job) == "embed":
        return embed_results(cfg)
    if fmt == "npy" or embed_format_of(out) == "npy":  # -o x.npy: not JSONL under that name
        asked = "--format npy" if fmt == "npy" else f"--out {out}"
        raise ConfigError(f"{asked}: a yes/no job's results are lines (JSONL, CSV, Parquet); "
                          ".npy holds an embedding job's vectors")
    if fmt == "parquet" and out is None:
        raise ConfigError("--format parquet needs --out FILE.parquet")
    if out is None:
        n = _export_text(job, None, fmt)
    else:  # all or nothing: an interrupted export (a signal, a full disk) leaves --out as it was
        check_writable(out)
        with naming(out), replaced_on_success(out) as part:  # errors name --out
            if fmt == "parquet":
                n = export_parquet(job, part, hooks=hooks)
            else:
                with open_text(part, fmt) as f:
                    n = export_text(job, f, fmt, hooks)
    print(f"vlmbatch: {n} result lines", file=sys.stderr)
    return EXIT_OK


def _results_dataset(cfg: ResultsConfig, hooks: FaultHooks) -> int:
    """``results JOB -o DIR/ [--rows-per-file N]``: a Parquet dataset, written whole or not
    at all (the folder is built beside DIR and renamed onto it; an existing empty DIR is
    replaced, a DIR with files is refused)."""
    out = cfg.out_path
    if out is None or (cfg.format or "parquet") != "parquet" or job_task_name(cfg.job) == "embed":
        raise ConfigError("a folder --out and --rows-per-file write a yes/no job's results as "
                          "a Parquet dataset: give -o DIR/ (and --format parquet, if any)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already holds files: give a new or empty folder")
    check_writable(out)
    with naming(out), replaced_on_success(out) as part:
        n = export_parquet(cfg.job, part, hooks=hooks,
                           rows_per_file=cfg.rows_per_file or PARQUET_ROWS_PER_FILE)
    files = len(list(out.glob("*.parquet")))
    print(f"vlmbatch: {n} result lines in {files} Parquet files under {out}",
          file=sys.stderr)
    return EXIT_OK


def embed_results(cfg: ResultsConfig) -> int:
    """An embedding job's vectors: JSONL (standard output without -o), Parquet or .npy; a job
    of OpenAI embedding requests gives OpenAI batch output lines as its JSONL."""
    job, out = cfg.job, cfg.out_path
    fmt = cfg.format or ("csv" if format_of(out) == "csv" else embed_format_of(out))
    if fmt == "csv":
        raise ConfigError("an embedding job's results are vectors: JSONL, Parquet or .npy")
    if fmt != "jsonl" and out is None:
        raise ConfigError(f"--format {fmt} needs --out FILE.{fmt}")
    openai = fmt == "jsonl" and job_format(job) == "openai"  # OpenAI output lines
    if out is None:
        n = (export_embed_requests(job, sys.stdout) if openai
             else export_embeddings(job, JsonlSink(sys.stdout)))
    else:  # all or nothing, errors naming --out (as a yes/no job's `results`)
        check_writable(out)
        with naming(out), replaced_on_success(out) as part:
            if fmt == "jsonl":
                with open(part, "w", encoding="utf-8") as f:
                    n = (export_embed_requests(job, f) if openai
                         else export_embeddings(job, JsonlSink(f)))
            else:
                n = export_embeddings(job, ParquetSink(part) if fmt == "parquet"
                                      else NpySink(part, recorded_results(job)))
    print(f"vlmbatch: {n} {'requests' if openai else 'embeddings'}", file=sys.stderr)
    return 0


def cmd_cancel(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    job = build(JobConfig, line.typed).job
    state = cancel(job)
    if state == "running":
        print(f"vlmbatch: job {job}: cancel requested; the running job stops after its "
              "current batch; `vlmbatch resume` continues it", file=sys.stderr)
    else:
        print(f"vlmbatch: job {job} is not running ({state}); nothing to cancel",
              file=sys.stderr)
    return EXIT_OK


Handler = Callable[[CommandLine, FaultHooks], int]

_MODEL = "vlmbatch.cli.model_commands"  # the commands that load or run a model
_LIGHT = "vlmbatch.cli.commands"  # this module
_LABELS = "vlmbatch.cli.label_commands"  # calibrate, report, review: no model
_SERVE = "vlmbatch.cli.serve_command"  # the only one that loads the HTTP stack
HANDLERS: Registry[Handler] = Registry("command", {
    "run": f"{_MODEL}:cmd_run", "submit": f"{_MODEL}:cmd_submit",
    "status": f"{_LIGHT}:cmd_status", "cancel": f"{_LIGHT}:cmd_cancel",
    "resume": f"{_MODEL}:cmd_resume", "results": f"{_LIGHT}:cmd_results",
    "eval": f"{_MODEL}:cmd_eval", "calibrate": f"{_LABELS}:cmd_calibrate",
    "report": f"{_LABELS}:cmd_report", "review": f"{_LABELS}:cmd_review",
    "quantize": f"{_MODEL}:cmd_quantize",
    "export-vit": f"{_MODEL}:cmd_export_vit", "embed": f"{_MODEL}:cmd_embed",
    "serve": f"{_SERVE}:cmd_serve", "bench": "vlmbatch.cli.bench.command:cmd_bench"})
