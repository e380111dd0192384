"""The commands that load or run a model: ``run``, ``submit``, ``resume``, ``eval``,
``quantize``, ``export-vit`` and ``embed``, one function each (the command line
-> its config root, built once -> a call into ``jobs/`` or ``pipeline/``, and the exit
code). Imported only when one of them runs (``commands.HANDLERS``); ``vlmbatch/cli/main.py``
dispatches to them and turns errors into messages. ``serve`` is ``serve_command.py``'s: a
run imports nothing of the HTTP stack (FastAPI, uvicorn, pydantic).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from vlmbatch.cli.args import CommandLine
from vlmbatch.cli.commands import (
    EXIT_CRASH,
    EXIT_ITEM_ERRORS,
    EXIT_OK,
    _export_text,  # `run --executor ray` writes its job's lines as `results` does
    typed_job,
)
from vlmbatch.cli.config import (
    EmbedCommandConfig,
    EvalConfig,
    ExportVitConfig,
    QuantizeConfig,
    ResumeConfig,
    SubmitConfig,
)
from vlmbatch.cli.embed import run_embed
from vlmbatch.cli.evaluate import evaluate_easy_vqa, evaluate_labelled, policy_note
from vlmbatch.cli.quantize import quantize_model
from vlmbatch.cli.run import run
from vlmbatch.common.options import build, declared
from vlmbatch.engine.config import EMBED_GROUP, ConfigError, ModelConfig
from vlmbatch.engine.embed import embedding_checkpoint
from vlmbatch.engine.loading import load_model, vision_model
from vlmbatch.inputs.datasets import input_kind
from vlmbatch.inputs.manifest import read_manifest, read_policy
from vlmbatch.jobs.config import RunConfig
from vlmbatch.jobs.job import run_job, submit
from vlmbatch.labels.evaluation import report_text
from vlmbatch.models.paths import DEFAULT_EMBED_MODEL
from vlmbatch.outputs.sinks import check_writable, format_of
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.vit_trt.export import export_onnx

# `run JOB`: what a run of a job may change (ResumeConfig's options); the rest was fixed at
# submit
RUN_JOB_OPTIONS = {"manifest", *(d.option.key for d in declared(ResumeConfig))}


def typed_run_config(line: CommandLine) -> RunConfig:
    """``run``'s or ``submit``'s config root (``jobs/config.py``), from the command line: its
    input (a manifest, or a table or shards), and for ``--task embed`` the built-in
    embedding model and a larger group unless given."""
    typed = line.typed
    text = typed.get("manifest")
    given: dict = {"manifest": None if text is None else Path(text)}
    if text is not None and input_kind(text) is not None:  # a table or shards
        given.update(manifest=None, dataset=text)
    if typed.get("task") == "embed":
        if "model" not in typed:  # the built-in embedding model, not the chat one
            given["model"] = build(ModelConfig, typed, ModelConfig(path=DEFAULT_EMBED_MODEL))
        if "images_per_batch" not in typed:
            given["images_per_batch"] = EMBED_GROUP  # one prompt per input: larger groups
    cfg = build(RunConfig, typed, **given)
    if cfg.task == "answer":
        refuse_embedding_model(cfg.model.path)
    return cfg


def refuse_embedding_model(path: Path | None) -> None:
    """ConfigError, naming the commands that fit, for an embedding checkpoint asked yes/no
    questions (its LM head was not trained for answers)."""
    if path is not None and embedding_checkpoint(path):
        raise ConfigError(f"{path} is an embedding model (its files declare an embedding "
                          "pooling, Matryoshka sizes or a projection layer, e.g. ColQwen2's "
                          "embedding_proj_layer): embed with it (`vlmbatch embed --model DIR`, "
                          "`vlmbatch submit --task embed`); yes/no questions need a chat model, "
                          "e.g. the default (leave out --model)")


def _job_exit(cfg: ResumeConfig, hooks: FaultHooks) -> int:
    """Run a job folder (after re-queueing its failed items with --retry-failed)."""
    st = run_job(cfg.job, cfg.progress, cfg.executor, retry_failed=cfg.retry_failed,
                 threads=cfg.threads, preprocess_threads=cfg.preprocess_threads,
                 decode_timeout=cfg.decode_timeout, hooks=hooks, fetch=cfg.fetch,
                 reuse=cfg.reuse)
    if cfg.retry_failed:
        print(f"vlmbatch: job {cfg.job}: {st.requeued} failed images were queued again",
              file=sys.stderr)
    print(f"vlmbatch: job {cfg.job}: {st.text()}", file=sys.stderr)
    if st.pending:
        return EXIT_ITEM_ERRORS  # cancelled with work left
    return EXIT_ITEM_ERRORS if st.failed else EXIT_OK


def cmd_run(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    if (job := typed_job(line)) is not None:
        fixed = line.names(set(line.typed) - RUN_JOB_OPTIONS)
        if fixed:
            raise ConfigError(
                f"{job} is a job: its input, model and engine settings were fixed at "
                f"submit, so {', '.join(fixed)} would be ignored. Submit a new job to change "
                "them; `vlmbatch results JOB -o FILE` writes the results to a file")
        return _job_exit(build(ResumeConfig, line.typed, job=job), hooks)
    if line.typed.get("retry_failed"):
        raise ConfigError("--retry-failed applies to a job folder (`vlmbatch run JOB "
                          "--retry-failed`); a plain run has nothing recorded to retry")
    cfg = typed_run_config(line)  # validates, --out included, before any work
    out = cfg.out
    if out is not None and out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file name, e.g. {out}/out.jsonl")
    if format_of(out) == "parquet":
        raise ConfigError("`run` streams JSONL or CSV (a Parquet file is readable only once "
                          "closed, so a killed run would leave nothing); for Parquet, "
                          "`vlmbatch submit ... --job DIR --wait`, then `vlmbatch results DIR "
                          "-o FILE.parquet`")
    if out is not None:
        check_writable(out)  # a read-only --out fails here, before any work
    reuse = line.typed.get("reuse")
    if cfg.executor.kind == "ray" or reuse is not None:
        return _run_on_ray(cfg, hooks, reuse)
    summary = run(cfg, hooks=hooks)
    print(f"vlmbatch: {summary.text()}; {cfg.model.dtype_note()}", file=sys.stderr)
    if out:
        print(f"vlmbatch: results in {out}", file=sys.stderr)
    return EXIT_ITEM_ERRORS if summary.failed_images else EXIT_OK


def _run_on_ray(cfg: RunConfig, hooks: FaultHooks, reuse: Path | None = None) -> int:
    """`run MANIFEST --executor ray` (or `--reuse OLD_JOB`): a job in a temporary folder, run
    on Ray (or here, copying what it can from OLD_JOB), exported."""
    with tempfile.TemporaryDirectory(prefix="vlmbatch-job-") as tmp:
        job = Path(tmp) / "job"
        submit(dataclasses.replace(cfg, out=None), job, reuse=reuse)
        try:
            rc = _job_exit(ResumeConfig(job, progress=cfg.progress, executor=cfg.executor),
                           hooks)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the lines answered so far, as in-process
            _export_text(job, cfg.out, format_of(cfg.out))
            raise
        _export_text(job, cfg.out, format_of(cfg.out))
        if cfg.out is not None:
            print(f"vlmbatch: results in {cfg.out}", file=sys.stderr)
    return rc


def cmd_submit(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    sub = build(SubmitConfig, line.typed)
    job = sub.job
    assert job is not None  # SubmitConfig refuses a submit without --job
    cfg = typed_run_config(line)
    n = submit(cfg, job, hooks, reuse=sub.reuse)
    what = "inputs" if cfg.task == "embed" else "images"
    print(f"vlmbatch: job {job}: {n} {what} submitted; run it with `vlmbatch run {job}`",
          file=sys.stderr)
    if not sub.wait:
        return EXIT_OK
    return _job_exit(ResumeConfig(job, progress=cfg.progress, executor=cfg.executor), hooks)


def cmd_embed(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    return run_embed(build(EmbedCommandConfig, line.typed), hooks)


def cmd_resume(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    return _job_exit(build(ResumeConfig, line.typed), hooks)


def cmd_eval(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    cfg = build(EvalConfig, line.typed)
    refuse_embedding_model(cfg.model.path)
    if cfg.manifest is not None:
        return _eval_labelled(cfg, hooks)
    r = evaluate_easy_vqa(cfg.model, cfg.engine, cfg.split, cfg.limit, cfg.images_per_batch,
                 cfg.progress, cfg.prepare.options(cfg.model.device), hooks, cfg.threads,
                 cfg.open_questions)
    kind = f"open (label sets, {cfg.engine.choice_scoring})" if cfg.open_questions else "yes/no"
    print(f"easy-vqa {cfg.split} {kind} accuracy: {r.accuracy:.4f} ({r.correct}/"
          f"{r.questions}) in {r.seconds:.1f}s ({60 * r.questions / r.seconds:.0f} QPM; "
          f"{cfg.model.dtype_note()})")
    return EXIT_OK


def _eval_labelled(cfg: EvalConfig, hooks: FaultHooks) -> int:
    """``eval MANIFEST``: the metrics on stdout (text or JSON), the run's summary on stderr."""
    run_cfg = RunConfig(manifest=cfg.manifest, policy=cfg.policy,
                        images_per_batch=cfg.images_per_batch, threads=cfg.threads,
                        progress=cfg.progress, model=cfg.model, engine=cfg.engine,
                        prepare=cfg.prepare)
    summary, report = evaluate_labelled(run_cfg, hooks)
    print(f"vlmbatch: {summary.text()}; {cfg.model.dtype_note()}", file=sys.stderr)
    if cfg.policy is not None:
        print(f"vlmbatch: {policy_note(cfg.policy, report)}", file=sys.stderr)
    print(json.dumps(report.as_json()) if cfg.json else report_text(report))
    return EXIT_ITEM_ERRORS if summary.failed_images else EXIT_OK


def cmd_export_vit(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    cfg = build(ExportVitConfig, line.typed)
    r = export_onnx(vision_model(load_model(cfg.model)), cfg.out, opset=cfg.opset)
    print(f"wrote {r.onnx_path} (+ vision.json); onnxruntime vs torch max abs error "
          f"{r.max_abs_err:.2e}")
    if r.max_abs_err > 1e-4:
        print("vlmbatch: error: the exported model disagrees with torch", file=sys.stderr)
        return EXIT_CRASH
    return EXIT_OK


def cmd_quantize(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    cfg = build(QuantizeConfig, line.typed)
    items = read_manifest(cfg.calib, read_policy(cfg.policy) if cfg.policy else ())
    r = quantize_model(cfg.model, cfg.out, cfg.method, items, cfg.samples, cfg.group_size,
                       cfg.device, progress=cfg.progress, threads=cfg.threads)
    if r.method == "awq":
        for e in r.report:
            print(f"  layer {e['layer']} {e['linears']}: output MSE {e['mse']:.3e} "
                  f"(round-to-nearest {e['mse_rtn']:.3e})", file=sys.stderr)
    print(f"wrote {r.out}: {r.linears} linears W4A16 ({r.method}, group size "
          f"{cfg.group_size}), calibrated on {r.samples} questions")
    return EXIT_OK

