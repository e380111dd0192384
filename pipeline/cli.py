"""``vlmbatch`` command line: builds the config tree and calls one function per command
(``COMMANDS``); the options themselves are in ``pipeline/cli_args.py``.

Exit codes: 0 all answered; 3 finished but some items failed (their lines carry ``error``),
or a job was cancelled with items left; 2 bad input or model, or a job another process
is running (message on stderr, nothing run);
1 a file could not be read or written (message on stderr), or an unexpected failure;
130 interrupted (Ctrl-C), 143 terminated (SIGTERM): results written so far are kept, a job
is left resumable.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from pipeline.cli_args import build_parser, given_options

EXIT_OK, EXIT_CRASH, EXIT_BAD_INPUT, EXIT_ITEM_ERRORS = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # 128 + SIGINT, 128 + SIGTERM
# OSErrors reported as a message even without a file name (disk full, quota, read-only...)
USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def _configs(a: argparse.Namespace):  # noqa: ANN202
    from pipeline.config import EngineConfig, ModelConfig

    model = ModelConfig(a.model, a.device, a.dtype, a.max_tiles, a.tiling, a.upscale_limit,
                        a.max_image_tokens, a.llm_quant)
    engine = EngineConfig(engine=a.engine, vit_backend=a.vit_backend,
                          cuda_graphs=not a.no_cuda_graphs, max_batch_tokens=a.max_batch_tokens,
                          prefix_cache=not a.no_prefix_cache, block_size=a.block_size,
                          cache_bytes=a.cache_mib << 20, max_new_tokens=a.max_new_tokens,
                          ignore_eos=a.ignore_eos,
                          yes_words=tuple(w for w in a.yes.split(",") if w),
                          no_words=tuple(w for w in a.no.split(",") if w))
    return model, engine


def _run_config(a: argparse.Namespace, out: Path | None):  # noqa: ANN202
    from pipeline.config import RunConfig

    model, engine = _configs(a)
    return RunConfig(manifest=a.manifest, images=a.images, policy=a.policy, out=out,
                     images_per_batch=a.images_per_batch, threads=a.threads,
                     preprocess_threads=a.preprocess_threads,
                     max_pixels=a.max_pixels, progress=not a.no_progress, model=model,
                     engine=engine)


RAY_ONLY = ("address", "preprocess_workers", "model_workers", "model_cpus", "decode_timeout")


def _ray_options(a: argparse.Namespace):  # noqa: ANN202
    """``RayOptions`` for ``--executor ray``, else None; options typed for the other
    executor are refused (``ConfigError``), not ignored."""
    from pipeline.config import ConfigError

    given: set[str] = getattr(a, "given", set())
    if getattr(a, "executor", "local") != "ray":
        ray_only = ["--" + k.replace("_", "-") for k in RAY_ONLY if k in given]
        if ray_only:
            raise ConfigError(f"{', '.join(ray_only)}: Ray executor options; add --executor ray")
        return None
    if "preprocess_threads" in given:
        raise ConfigError("--preprocess-threads applies to in-process runs; with --executor "
                          "ray, decoding runs in Ray tasks: use --preprocess-workers")
    if "threads" in given:
        raise ConfigError("--threads applies to in-process runs; with --executor ray, each "
                          "model actor runs --model-cpus torch threads (what Ray reserves)")
    from jobs.ray_executor import RayOptions

    return RayOptions(a.address, a.preprocess_workers, a.model_workers, a.model_cpus,
                      a.decode_timeout)


def _job_exit(job: Path, progress: bool, a: argparse.Namespace | None = None) -> int:
    """Run a job folder (after re-queueing its failed items with --retry-failed)."""
    from jobs.job import run_job

    executor = getattr(a, "executor", "local") if a is not None else "local"
    retry = getattr(a, "retry_failed", False)
    st = run_job(job, progress, executor, _ray_options(a) if a is not None else None,
                 retry_failed=retry, threads=getattr(a, "threads", None),
                 preprocess_threads=getattr(a, "preprocess_threads", None))
    if retry:
        print(f"vlmbatch: job {job}: {st.requeued} failed images were queued again",
              file=sys.stderr)
    print(f"vlmbatch: job {job}: {st.text()}", file=sys.stderr)
    if st.pending:
        return EXIT_ITEM_ERRORS  # cancelled with work left
    return EXIT_ITEM_ERRORS if st.failed else EXIT_OK


# `run JOB`: options that may change between runs of a job; the rest were fixed at submit
RUN_JOB_OPTIONS = {"manifest", "no_progress", "retry_failed", "executor", "address",
                   "preprocess_workers", "model_workers", "model_cpus", "decode_timeout",
                   "threads", "preprocess_threads"}


def cmd_run(a: argparse.Namespace) -> int:
    from jobs.runner import run
    from jobs.sinks import format_of
    from pipeline.config import ConfigError

    if _is_job_arg(a):
        fixed = sorted("--" + k.replace("_", "-") for k in a.given - RUN_JOB_OPTIONS)
        if fixed:
            raise ConfigError(
                f"{a.manifest} is a job: its input, model and engine settings were fixed at "
                f"submit, so {', '.join(fixed)} would be ignored. Submit a new job to change "
                "them; `vlmbatch results JOB -o FILE` writes the results to a file")
        return _job_exit(a.manifest, not a.no_progress, a)
    if a.retry_failed:
        raise ConfigError("--retry-failed applies to a job folder (`vlmbatch run JOB "
                          "--retry-failed`); a plain run has nothing recorded to retry")
    cfg = _run_config(a, a.out)  # validates, --out included, before any work
    if a.out is not None and a.out.is_dir():
        raise ConfigError(f"--out {a.out} is a folder; give a file name, e.g. {a.out}/out.jsonl")
    if format_of(a.out) == "parquet":
        raise ConfigError("`run` streams JSONL or CSV (a Parquet file is readable only once "
                          "closed, so a killed run would leave nothing); for Parquet, "
                          "`vlmbatch submit ... --job DIR --wait`, then `vlmbatch results DIR "
                          "-o FILE.parquet`")
    if a.executor == "ray":
        return _run_on_ray(a, cfg)
    summary = run(cfg)
    print(f"vlmbatch: {summary.text()}", file=sys.stderr)
    if a.out:
        print(f"vlmbatch: results in {a.out}", file=sys.stderr)
    return EXIT_ITEM_ERRORS if summary.failed_images else EXIT_OK


def _run_on_ray(a: argparse.Namespace, cfg) -> int:  # noqa: ANN001
    """`run MANIFEST --executor ray`: a job in a temporary folder, run on Ray, exported."""
    import dataclasses
    import tempfile

    from jobs.job import submit
    from jobs.sinks import format_of

    def export(job: Path) -> None:
        _export_text(job, a.out, format_of(a.out))

    with tempfile.TemporaryDirectory(prefix="vlmbatch-job-") as tmp:
        job = Path(tmp) / "job"
        submit(dataclasses.replace(cfg, out=None), job)
        try:
            rc = _job_exit(job, not a.no_progress, a)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the lines answered so far, as in-process
            export(job)
            raise
        export(job)
        if a.out is not None:
            print(f"vlmbatch: results in {a.out}", file=sys.stderr)
    return rc


def cmd_submit(a: argparse.Namespace) -> int:
    from jobs.job import submit
    from pipeline.config import ConfigError

    if a.job is None:
        raise ConfigError("submit needs --job DIR: the folder the job is kept in")
    n = submit(_run_config(a, None), a.job)
    print(f"vlmbatch: job {a.job}: {n} images submitted; run it with `vlmbatch run {a.job}`",
          file=sys.stderr)
    return _job_exit(a.job, not a.no_progress, a) if a.wait else EXIT_OK


def cmd_status(a: argparse.Namespace) -> int:
    import json

    from jobs.job import status

    st = status(a.job)
    print(json.dumps({"job": str(a.job), **st.as_json()}) if a.json else st.text())
    return EXIT_OK


def _export_text(job: Path, out: Path | None, fmt: str) -> int:
    """A job's result lines as JSONL or CSV to ``out`` (standard output for None)."""
    from jobs.export import export_text
    from jobs.sinks import open_text

    if out is None:
        return export_text(job, sys.stdout, fmt)
    with open_text(out, fmt) as f:
        return export_text(job, f, fmt)


def cmd_results(a: argparse.Namespace) -> int:
    from jobs.export import export_parquet
    from jobs.sinks import format_of
    from pipeline.atomic import replaced_on_success
    from pipeline.config import ConfigError

    fmt = a.format or format_of(a.out)
    if fmt == "parquet" and a.out is None:
        raise ConfigError("--format parquet needs --out FILE.parquet")
    if a.out is None:
        n = _export_text(a.job, None, fmt)
    else:  # all or nothing: an interrupted export leaves --out as it was
        with replaced_on_success(a.out) as part:
            n = (export_parquet(a.job, part) if fmt == "parquet"
                 else _export_text(a.job, part, fmt))
    print(f"vlmbatch: {n} result lines", file=sys.stderr)
    return EXIT_OK


def cmd_cancel(a: argparse.Namespace) -> int:
    from jobs.job import cancel

    state = cancel(a.job)
    if state == "running":
        print(f"vlmbatch: job {a.job}: cancel requested; the running job stops after its "
              "current batch; `vlmbatch resume` continues it", file=sys.stderr)
    else:
        print(f"vlmbatch: job {a.job} is not running ({state}); nothing to cancel",
              file=sys.stderr)
    return EXIT_OK


def cmd_resume(a: argparse.Namespace) -> int:
    return _job_exit(a.job, not a.no_progress, a)


def cmd_eval(a: argparse.Namespace) -> int:
    import torch

    from pipeline.evaluate import evaluate

    if a.threads:
        torch.set_num_threads(a.threads)
    model, engine = _configs(a)
    r = evaluate(model, engine, a.split, a.limit, a.images_per_batch, not a.no_progress,
                 a.preprocess_threads)
    print(f"easy-vqa {a.split} yes/no accuracy: {r.accuracy:.4f} ({r.correct}/{r.questions}) "
          f"in {r.seconds:.1f}s ({60 * r.questions / r.seconds:.0f} QPM)")
    return EXIT_OK


def cmd_export_vit(a: argparse.Namespace) -> int:
    from pipeline.model import load_model
    from vit_trt.export import export_onnx

    r = export_onnx(load_model(a.model), a.out, opset=a.opset)
    print(f"wrote {r.onnx_path} (+ vision.json); onnxruntime vs torch max abs error "
          f"{r.max_abs_err:.2e}")
    if r.max_abs_err > 1e-4:
        print("vlmbatch: error: the exported model disagrees with torch", file=sys.stderr)
        return EXIT_CRASH
    return EXIT_OK


def cmd_quantize(a: argparse.Namespace) -> int:
    import torch

    from jobs.manifest import read_manifest, read_policy
    from quant.quantize import quantize_model

    if a.threads:
        torch.set_num_threads(a.threads)
    items = read_manifest(a.calib, read_policy(a.policy) if a.policy else ())
    r = quantize_model(a.model, a.out, a.method, items, a.samples, a.group_size, a.device,
                       progress=not a.no_progress)
    if r.method == "awq":
        for e in r.report:
            print(f"  layer {e['layer']} {e['linears']}: output MSE {e['mse']:.3e} "
                  f"(round-to-nearest {e['mse_rtn']:.3e})", file=sys.stderr)
    print(f"wrote {r.out}: {r.linears} linears W4A16 ({r.method}, group size {a.group_size}), "
          f"calibrated on {r.samples} questions")
    return EXIT_OK


COMMANDS = {"run": cmd_run, "submit": cmd_submit, "status": cmd_status, "cancel": cmd_cancel,
            "resume": cmd_resume, "results": cmd_results, "eval": cmd_eval,
            "quantize": cmd_quantize, "export-vit": cmd_export_vit}


def _is_job_arg(a: argparse.Namespace) -> bool:
    from jobs.job import is_job

    return getattr(a, "manifest", None) is not None and is_job(a.manifest)


def _quiet_opencv() -> None:
    """OpenCV logs its own line for every undecodable image; each is already that item's
    ``error``, so the CLI silences OpenCV unless OPENCV_LOG_LEVEL asks otherwise."""
    import os

    if "OPENCV_LOG_LEVEL" not in os.environ:
        import cv2

        cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.given = given_options(argv)
    _quiet_opencv()
    with _sigterm_as_interrupt():
        return _main(args)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's preemption, `kill`, `docker stop`), raised in the main thread
    so that a run ends as after Ctrl-C: the job marked interrupted, its lock freed, the
    output file closed on whole lines; exit 143. Ray's blocking calls turn any
    KeyboardInterrupt into a plain one, so what was received is also kept in ``SIGTERMS``."""


SIGTERMS: list[int] = []  # one entry per SIGTERM received by this process's CLI


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    SIGTERMS.clear()
    inherited = signal.getsignal(signal.SIGTERM)
    if (threading.current_thread() is not threading.main_thread()
            or inherited in (signal.SIG_IGN, None)):
        yield  # handlers can only be set in the main thread; an ignored SIGTERM stays so
        return

    def raise_terminated(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, previous)  # a second SIGTERM is not held up by cleanup
        SIGTERMS.append(signum)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace) -> int:
    from jobs.manifest import ManifestError
    from pipeline.config import ConfigError
    from pipeline.model import ModelError
    from pipeline.scoring import AnswerWordsError

    try:
        if hasattr(args, "executor"):
            _ray_options(args)  # Ray-only options without --executor ray are an error
        return COMMANDS[args.command](args)
    except (ConfigError, ManifestError, ModelError, AnswerWordsError, ImportError) as e:
        print(f"vlmbatch: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # e.g. `vlmbatch run ... | head`
        sys.stderr.close()
        return EXIT_OK
    except OSError as e:  # a path that cannot be written, a full disk...
        if not e.filename and e.errno not in USER_ERRNOS:
            raise  # not about a file the user named: keep the traceback
        where = f": {e.filename}" if e.filename else ""
        print(f"vlmbatch: error: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_CRASH
    except KeyboardInterrupt:
        return _interrupted(args)


def _interrupted(args: argparse.Namespace) -> int:
    """After Ctrl-C or SIGTERM: say what was kept and how to go on; exit 130 or 143."""
    from jobs.job import is_job

    what = "terminated (SIGTERM)" if SIGTERMS else "interrupted"
    kept = "results written so far are kept"
    hint = ""
    if args.command == "run" and not _is_job_arg(args):
        hint = ("; the same command starts over: for work that resumes, `vlmbatch submit "
                "... --job DIR` then `vlmbatch resume DIR`")
    elif args.command == "submit" and not (args.job and is_job(args.job)):
        hint = "; no job was created"
    elif args.command in ("run", "submit", "resume"):
        hint = "; `vlmbatch resume JOB` continues the job"
    elif args.command in ("results", "quantize", "export-vit"):
        kept = ("--out is left as it was (written whole or not at all); run the command "
                "again")
    elif args.command == "eval":
        kept = "nothing was written"
    print(f"vlmbatch: {what}; {kept}{hint}", file=sys.stderr)
    return EXIT_TERMINATED if SIGTERMS else EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
