"""``vlmbatch`` command line: builds the config tree and calls one function per command.

Exit codes: 0 all answered; 3 finished but some items failed (their lines carry ``error``),
or a job was cancelled with items left; 2 bad input or model (message on stderr, nothing run);
1 a file could not be read or written (message on stderr), or an unexpected failure;
130 interrupted (Ctrl-C; results written so far are kept).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_OK, EXIT_CRASH, EXIT_BAD_INPUT, EXIT_ITEM_ERRORS = 0, 1, 2, 3


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", type=Path, default=None,
                   help="HF-format InternVL directory (default: the built-in model)")
    g.add_argument("--engine", default="torch", choices=["torch", "lmdeploy"],
                   help="torch: ours (CPU/CUDA, default); lmdeploy: TurboMind, GPU env only, "
                   "never run by us yet")
    g.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    g.add_argument("--vit-backend", default="auto",
                   choices=["auto", "torch", "onnxruntime", "onnxruntime-int8", "tensorrt"],
                   help="vision encoder runner (default auto: tensorrt on CUDA when installed, "
                   "else torch); onnxruntime-int8: dynamic int8 ViT on CPU")
    g.add_argument("--llm-quant", default="none", choices=["none", "int8-dynamic"],
                   help="int8-dynamic: torch dynamic int8 linears for the language model (CPU). "
                   "For W4A16 pass a checkpoint made by `vlmbatch quantize`")
    g.add_argument("--no-cuda-graphs", action="store_true",
                   help="torch/tensorrt vision backends on CUDA: run without the CUDA graph pool")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations (default float32; bfloat16 on GPUs)")
    g.add_argument("--max-tiles", type=int, default=None,
                   help="cap tiles per image (default: the checkpoint's max_patches)")
    g.add_argument("--tiling", default="reduced", choices=["reduced", "reference"],
                   help="reduced (default): fewest tiles that keep the image's resolution, "
                   "letterboxed (docs/preprocessing.md); reference: InternVL's "
                   "dynamic_preprocess, for parity with the model card")
    g.add_argument("--upscale-limit", type=float, default=1.0,
                   help="reduced tiling: most a tile count may enlarge an image (default 1.0)")
    g.add_argument("--max-image-tokens", type=int, default=None,
                   help="per-image token budget the tiling must fit (thumbnail included)")
    g.add_argument("--max-batch-tokens", type=int, default=8192,
                   help="padded prompt tokens per LLM forward (default 8192)")
    g.add_argument("--images-per-batch", type=int, default=16,
                   help="images preprocessed and scored together (default 16)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's, one per core)")
    g.add_argument("--yes", default="yes,Yes,YES,是",
                   help="comma-separated answer words counted as yes; P(yes) sums their "
                   "first-token probabilities (default %(default)s)")
    g.add_argument("--no", default="no,No,NO,否",
                   help="comma-separated answer words counted as no (default %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=0,
                   help="also write a greedy text answer of up to N tokens (default 0: none)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="with --max-new-tokens: always generate N tokens (for benchmarks)")
    c = p.add_argument_group("prefix cache")
    c.add_argument("--no-prefix-cache", action="store_true",
                   help="recompute every prompt's image tokens (for comparison)")
    c.add_argument("--block-size", type=int, default=16,
                   help="tokens per cache block (default 16)")
    c.add_argument("--cache-mib", type=int, default=1024,
                   help="KV cache budget in MiB, least recently used blocks evicted first "
                   "(default 1024)")


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
                     max_pixels=a.max_pixels, progress=not a.no_progress, model=model,
                     engine=engine)


def _executor_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("executor (jobs)")
    g.add_argument("--executor", default="local", choices=["local", "ray"],
                   help="local: this process (default); ray: CPU preprocessing tasks feeding "
                   "model actors (pip install 'vlmbatch[ray]'; docs/jobs.md)")
    g.add_argument("--address", default=None,
                   help="ray: join this cluster (default: start a local one for the run)")
    g.add_argument("--preprocess-workers", type=int, default=1,
                   help="ray: concurrent decode/tile tasks (default 1)")
    g.add_argument("--model-workers", type=int, default=1,
                   help="ray: model actors, one per GPU on a GPU cluster (default 1)")
    g.add_argument("--model-cpus", type=float, default=1.0,
                   help="ray: CPUs per model actor = its torch threads on CPU (default 1)")
    g.add_argument("--decode-timeout", type=float, default=30.0,
                   help="ray: seconds per image before a hung decode is killed and that item "
                   "fails (default 30)")


RAY_ONLY = ("address", "preprocess_workers", "model_workers", "model_cpus", "decode_timeout")


def _ray_options(a: argparse.Namespace):  # noqa: ANN202
    if getattr(a, "executor", "local") != "ray":
        defaults = vars(build_parser().parse_args(["run"]))
        given = ["--" + k.replace("_", "-") for k in RAY_ONLY
                 if hasattr(a, k) and getattr(a, k) != defaults[k]]
        if given:
            from pipeline.config import ConfigError

            raise ConfigError(f"{', '.join(given)}: Ray executor options; add --executor ray")
        return None
    from jobs.ray_executor import RayOptions

    return RayOptions(a.address, a.preprocess_workers, a.model_workers, a.model_cpus,
                      a.decode_timeout)


def _job_exit(job: Path, progress: bool, a: argparse.Namespace | None = None) -> int:
    from jobs.job import run_job

    executor = getattr(a, "executor", "local") if a is not None else "local"
    st = run_job(job, progress, executor, _ray_options(a) if a is not None else None)
    print(f"vlmbatch: job {job}: {st.text()}", file=sys.stderr)
    if st.pending:
        return EXIT_ITEM_ERRORS  # cancelled with work left
    return EXIT_ITEM_ERRORS if st.failed else EXIT_OK


# `run JOB`: options that may change between runs of a job; the rest were fixed at submit
RUN_JOB_OPTIONS = {"command", "func", "manifest", "no_progress", "executor", "address",
                   "preprocess_workers", "model_workers", "model_cpus", "decode_timeout"}


def cmd_run(a: argparse.Namespace) -> int:
    from jobs.job import is_job
    from jobs.runner import run
    from pipeline.config import ConfigError

    if a.manifest is not None and is_job(a.manifest):
        defaults = vars(build_parser().parse_args(["run"]))
        fixed = sorted("--" + k.replace("_", "-") for k, v in vars(a).items()
                       if k not in RUN_JOB_OPTIONS and v != defaults.get(k))
        if fixed:
            raise ConfigError(
                f"{a.manifest} is a job: its input, model and engine settings were fixed at "
                f"submit, so {', '.join(fixed)} would be ignored. Submit a new job to change "
                "them; `vlmbatch results JOB -o FILE` writes the results to a file")
        return _job_exit(a.manifest, not a.no_progress, a)
    if a.out is not None and a.out.is_dir():
        raise ConfigError(f"--out {a.out} is a folder; give a file name, e.g. {a.out}/out.jsonl")
    if a.out is not None and a.out.suffix.lower() == ".parquet":
        raise ConfigError("`run` writes JSONL; for Parquet, `vlmbatch submit ... --job DIR "
                          "--wait`, then `vlmbatch results DIR -o FILE.parquet`")
    if a.executor == "ray":
        return _run_on_ray(a)
    summary = run(_run_config(a, a.out))
    print(f"vlmbatch: {summary.text()}", file=sys.stderr)
    if a.out:
        print(f"vlmbatch: results in {a.out}", file=sys.stderr)
    return EXIT_ITEM_ERRORS if summary.failed_images else EXIT_OK


def _run_on_ray(a: argparse.Namespace) -> int:
    """`run MANIFEST --executor ray`: a job in a temporary folder, run on Ray, exported."""
    import tempfile

    from jobs.job import export_results, submit

    with tempfile.TemporaryDirectory(prefix="vlmbatch-job-") as tmp:
        job = Path(tmp) / "job"
        submit(_run_config(a, None), job)
        rc = _job_exit(job, not a.no_progress, a)
        if a.out is None:
            export_results(job, sys.stdout)
        else:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            with open(a.out, "w") as f:
                export_results(job, f)
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
    from jobs.job import status

    print(status(a.job).text())
    return EXIT_OK


def cmd_results(a: argparse.Namespace) -> int:
    from jobs.job import export_parquet, export_results
    from pipeline.config import ConfigError

    fmt = a.format or ("parquet" if a.out is not None and a.out.suffix == ".parquet"
                       else "jsonl")
    if fmt == "parquet":
        if a.out is None:
            raise ConfigError("--format parquet needs --out FILE.parquet")
        a.out.parent.mkdir(parents=True, exist_ok=True)
        n = export_parquet(a.job, a.out)
    elif a.out is None:
        n = export_results(a.job, sys.stdout)
    else:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "w") as f:
            n = export_results(a.job, f)
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
    from jobs.job import retry_failed

    if a.retry_failed:
        n = retry_failed(a.job)
        print(f"vlmbatch: job {a.job}: {n} failed images queued again", file=sys.stderr)
    return _job_exit(a.job, not a.no_progress, a)


def cmd_eval(a: argparse.Namespace) -> int:
    import torch

    from pipeline.evaluate import evaluate

    if a.threads:
        torch.set_num_threads(a.threads)
    model, engine = _configs(a)
    r = evaluate(model, engine, a.split, a.limit, a.images_per_batch, not a.no_progress)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vlmbatch",
        description="Ask a vision-language model yes/no questions about many images, fast.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="answer a manifest's (or a folder's) questions -> JSONL; "
                       "or run a submitted job",
                       description="Answer every question about every image; one JSONL line per "
                       "(image, question) with answer, p_yes and error. Given a job folder "
                       "(from `submit`), run its pending items instead.")
    r.add_argument("manifest", type=Path, nargs="?",
                   help='JSONL, one image per line: {"id", "image", "questions"}; or a job '
                   "folder")
    r.add_argument("--images", type=Path, help="a folder of images instead of a manifest")
    r.add_argument("--policy", type=Path,
                   help="YAML/TOML file of questions asked of every image")
    r.add_argument("--out", "-o", type=Path, help="results JSONL (default: standard output)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--max-pixels", type=int, default=100_000_000,
                   help="images with more pixels (read from the header) are that item's error "
                   "(default 100,000,000)")
    _model_args(r)
    _executor_args(r)
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("submit", help="create a resumable job (SQLite store) from a manifest",
                       description="Validate the input and create a job folder: config + a "
                       "store of every item. Run it with `vlmbatch run JOB` (or --wait).")
    s.add_argument("manifest", type=Path, nargs="?", help="JSONL manifest")
    s.add_argument("--images", type=Path, help="a folder of images instead of a manifest")
    s.add_argument("--policy", type=Path, help="YAML/TOML file of questions")
    s.add_argument("--job", type=Path, help="the job folder to create")
    s.add_argument("--wait", action="store_true", help="run the job now")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--max-pixels", type=int, default=100_000_000)
    _model_args(s)
    _executor_args(s)
    s.set_defaults(func=cmd_submit)

    for name, func, text in [("status", cmd_status, "counts, QPM and ETA of a job"),
                             ("cancel", cmd_cancel, "stop a running job after its batch"),
                             ("resume", cmd_resume, "continue an interrupted job")]:
        c = sub.add_parser(name, help=text, description=text)
        c.add_argument("job", type=Path)
        if name == "resume":
            c.add_argument("--no-progress", action="store_true", help="no progress bar")
            c.add_argument("--retry-failed", action="store_true",
                           help="first queue the failed images again (e.g. after fixing a "
                           "missing file or an out-of-memory batch)")
            _executor_args(c)
        c.set_defaults(func=func)
    x = sub.add_parser("results", help="export a job's results as JSONL or Parquet",
                       description="Every recorded result line of a job, in manifest order.")
    x.add_argument("job", type=Path)
    x.add_argument("--out", "-o", type=Path, help="file (default: standard output)")
    x.add_argument("--format", choices=["jsonl", "parquet"], default=None,
                   help="default: parquet when --out ends in .parquet, else JSONL (OpenAI "
                   "batch output lines for a job submitted in that format)")
    x.set_defaults(func=cmd_results)

    e = sub.add_parser("eval", help="accuracy on easy-vqa's test split (yes/no questions)",
                       description="Accuracy of a model on easy-vqa's yes/no questions.")
    e.add_argument("--split", default="test", choices=["test", "train"])
    e.add_argument("--limit", type=positive_int, default=None, help="first N questions only")
    e.add_argument("--no-progress", action="store_true")
    _model_args(e)
    e.set_defaults(func=cmd_eval)

    q = sub.add_parser("quantize", help="write a W4A16 (AWQ/GPTQ) copy of a model, calibrated "
                       "on your images",
                       description="Quantise the language model's decoder linears to 4-bit "
                       "weights (symmetric, per group) with AWQ or GPTQ, calibrated on the "
                       "questions of a manifest, and write a compressed-tensors checkpoint that "
                       "`vlmbatch run --model OUT` serves. The vision encoder stays as it is "
                       "(see --vit-backend onnxruntime-int8).")
    q.add_argument("--model", type=Path, default=None,
                   help="HF-format InternVL directory (default: the built-in model)")
    q.add_argument("--method", required=True, choices=["awq", "gptq", "rtn"],
                   help="rtn: plain round-to-nearest, for comparison")
    q.add_argument("--calib", type=Path, required=True,
                   help="JSONL manifest of calibration images and questions")
    q.add_argument("--policy", type=Path, help="YAML/TOML questions asked of every image")
    q.add_argument("--samples", type=int, default=128,
                   help="calibration (image, question) pairs (default 128)")
    q.add_argument("--group-size", type=int, default=128,
                   help="input columns per scale (default 128)")
    q.add_argument("--out", type=Path, required=True, help="new model folder")
    q.add_argument("--device", default="cpu",
                   help="where calibration runs: cpu (default) or cuda; the model is float32")
    q.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's, one per core)")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=cmd_quantize)

    x = sub.add_parser("export-vit", help="export the vision encoder to ONNX and check it",
                       description="ONNX of the vision encoder (uint8 tiles in, embeddings out, "
                       "dynamic batch), checked with onnxruntime against torch. `run "
                       "--vit-backend onnxruntime` exports on the fly; this file is for other "
                       "runtimes, TensorRT's builder (docs/vision.md) or inspection.")
    x.add_argument("--model", type=Path, default=None,
                   help="HF-format InternVL directory (default: the built-in model)")
    x.add_argument("--out", type=Path, required=True, help="output folder")
    x.add_argument("--opset", type=int, default=17, choices=range(17, 21), metavar="{17..20}",
                   help="ONNX opset (default 17; SDPA exports as plain ops in 17-20)")
    x.set_defaults(func=cmd_export_vit)
    return p


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
    from jobs.manifest import ManifestError
    from pipeline.config import ConfigError
    from pipeline.model import ModelError
    from pipeline.scoring import AnswerWordsError

    args = build_parser().parse_args(argv)
    _quiet_opencv()
    try:
        if hasattr(args, "executor"):
            _ray_options(args)  # Ray-only options without --executor ray are an error
        return args.func(args)
    except (ConfigError, ManifestError, ModelError, AnswerWordsError, ImportError) as e:
        print(f"vlmbatch: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # e.g. `vlmbatch run ... | head`
        sys.stderr.close()
        return EXIT_OK
    except OSError as e:  # an output path that cannot be written, a full disk...
        where = f": {e.filename}" if e.filename else ""
        print(f"vlmbatch: error: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_CRASH
    except KeyboardInterrupt:
        hint = ""
        if args.func is cmd_run and not _is_job_arg(args):
            hint = ("; the same command starts over: for work that resumes, `vlmbatch submit "
                    "... --job DIR` then `vlmbatch resume DIR`")
        elif args.func in (cmd_run, cmd_submit, cmd_resume):
            hint = "; `vlmbatch resume JOB` continues the job"
        print(f"vlmbatch: interrupted; results written so far are kept{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
