"""The ``vlmbatch`` argument parser: every command's options, their defaults and help.

It only parses: ``vlmbatch/app/cli.py`` maps ``args.command`` to the function that builds the
command's config root and runs it (``commands.COMMANDS``). Each option's ``dest`` is the
name of the config field it fills (``app/config.py`` ``from_args``), its ``type`` converts
units (``--cache-mib`` to ``cache_bytes``, ``--yes a,b`` to ``yes_words``), and a ``--no-X``
switch stores False into field ``X``. Option names follow vLLM/LMDeploy where
they exist (``--max-new-tokens``, ``--dtype``, ``--device``). Every default is read from the
config dataclasses (or the light constants of the package that owns it: ``quant``'s methods
and sizes, ``vit_trt.OPSET``) and every choice list from the registry or tuple that owns it,
so neither is written twice. Light: it imports no torch, no model code and no server, so
``--help`` costs only the interpreter and these modules.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmbatch.app.config import SPLITS
from vlmbatch.app.embed_args import add_embed_parser, embed_option_args
from vlmbatch.app.label_args import add_calibrate_parser, add_report_parser
from vlmbatch.app.server.config import add_executor_args, add_server_args
from vlmbatch.engine.build import ENGINES
from vlmbatch.engine.config import (
    CHOICE_SCORING,
    DTYPES,
    LLM_QUANT,
    QUANT,
    EngineConfig,
    ModelConfig,
    default_of,
    vit_backends,
)
from vlmbatch.jobs.config import EXECUTORS, TASKS, RayOptions, RunConfig
from vlmbatch.jobs.export import PARQUET_ROWS_PER_FILE
from vlmbatch.pipeline.config import PrepareConfig
from vlmbatch.preprocessing.tiling import TILING_MODES
from vlmbatch.quant import GROUP_SIZE, METHODS, SAMPLES
from vlmbatch.vit_trt import OPSET

M, E, R, P = ModelConfig(), EngineConfig(), RayOptions(), PrepareConfig()  # the defaults


def positive_int(text: str, least: int = 1) -> int:
    """argparse type: an integer >= 1 (>= ``least``)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {v}")
    return v


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return positive_int(text, least=0)


def mib(text: str) -> int:
    """argparse type: MiB (an integer >= 0) as bytes."""
    return positive_int(text, least=0) << 20


def words(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated words (empty ones dropped)."""
    return tuple(w for w in text.split(",") if w)


def _model_args(p: argparse.ArgumentParser) -> None:
    """The model, its images and the engine: ``ModelConfig`` and ``EngineConfig``."""
    g = p.add_argument_group("model")
    g.add_argument("--model", dest="path", type=Path, default=M.path,
                   help="HF-format checkpoint directory, e.g. an InternVL '-hf' release "
                   "(default: the built-in model)")
    g.add_argument("--device", default=M.device,
                   help="torch device, e.g. cpu or cuda (default %(default)s)")
    g.add_argument("--dtype", default=M.dtype, choices=list(DTYPES),
                   help="weights and activations (default float32; bfloat16 on GPUs)")
    g.add_argument("--llm-quant", default=M.llm_quant, choices=LLM_QUANT,
                   help="int8-dynamic: torch dynamic int8 linears for the language model (CPU). "
                   "For W4A16 pass a checkpoint made by `vlmbatch quantize`")
    g.add_argument("--quant", default=M.quant, choices=QUANT,
                   help="fp8: e4m3 W8A8 linears in the decoder and the vision encoder "
                   "(torch._scaled_mm; CUDA compute capability >= 8.9; on the CPU a slow "
                   "reference of the same arithmetic, for accuracy checks)")
    g.add_argument("--max-tiles", type=int, default=M.max_tiles,
                   help="cap tiles per image (default: the checkpoint's max_patches)")
    g.add_argument("--tiling", default=M.tiling, choices=TILING_MODES,
                   help="reduced (default): fewest tiles that keep the image's resolution, "
                   "letterboxed (docs/preprocessing.md); reference: InternVL's "
                   "dynamic_preprocess, for parity with the model card")
    g.add_argument("--upscale-limit", type=float, default=M.upscale_limit,
                   help="reduced tiling: most a tile count may enlarge an image (default "
                   "%(default)s)")
    g.add_argument("--max-image-tokens", type=int, default=M.max_image_tokens,
                   help="per-image token budget the tiling must fit (thumbnail included)")
    g.add_argument("--images-per-batch", type=int,
                   default=default_of(RunConfig, "images_per_batch"),
                   help="images preprocessed and scored together (default %(default)s)")
    _thread_args(g)
    _engine_args(p.add_argument_group("engine"))
    _cache_args(p.add_argument_group("prefix cache"))


def _engine_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--engine", default=E.engine, choices=ENGINES.names(),
                   help="torch: ours (CPU/CUDA, default); lmdeploy: TurboMind, GPU env only, "
                   "never run by us yet")
    g.add_argument("--vit-backend", default=E.vit_backend, choices=vit_backends(),
                   help="vision encoder runner (default auto: tensorrt on CUDA when installed, "
                   "else torch); onnxruntime-int8: dynamic int8 ViT on CPU")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="torch/tensorrt vision backends on CUDA: run without the CUDA graph pool")
    g.add_argument("--vit-max-batch", type=positive_int, default=E.vit_max_batch,
                   help="largest vision batch prepared for: the CUDA graph pool's largest "
                   "bucket and the TensorRT profile's maximum (default %(default)s)")
    g.add_argument("--max-batch-tiles", type=positive_int, default=E.max_batch_tiles,
                   help="tiles per vision-encoder forward (default %(default)s)")
    g.add_argument("--compile-llm", action="store_true",
                   help="run the language model's prefill through torch.compile (dynamic "
                   "shapes; the first batches pay the compilation)")
    g.add_argument("--max-batch-tokens", type=int, default=E.max_batch_tokens,
                   help="padded prompt tokens per LLM forward (default %(default)s)")
    g.add_argument("--yes", dest="yes_words", type=words, default=E.yes_words,
                   help="comma-separated answer words counted as yes; P(yes) sums their "
                   f"first-token probabilities (default {','.join(E.yes_words)})")
    g.add_argument("--no", dest="no_words", type=words, default=E.no_words,
                   help="comma-separated answer words counted as no (default "
                   f"{','.join(E.no_words)})")
    g.add_argument("--choice-scoring", default=E.choice_scoring, choices=CHOICE_SCORING,
                   help="label-set questions (choices): exact (default) scores each choice's "
                   "whole token sequence after the prompt, sum of log P(token | prompt, the "
                   "choice's tokens before it), in one continuation forward after the "
                   "prompt's KV; first-token scores its first token only (cheaper; refused, "
                   "naming them, when two choices start with the same token)")
    g.add_argument("--max-new-tokens", type=int, default=E.max_new_tokens,
                   help="also write a greedy text answer of up to N tokens (default 0: none); "
                   "a question's own max_new_tokens (policy/manifest) overrides it")
    g.add_argument("--ignore-eos", action="store_true",
                   help="with --max-new-tokens: always generate N tokens (for benchmarks)")


def _cache_args(c: argparse._ArgumentGroup) -> None:
    c.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="recompute every prompt's image tokens (for comparison)")
    c.add_argument("--block-size", type=int, default=E.block_size,
                   help="tokens per cache block (default %(default)s)")
    c.add_argument("--cache-mib", dest="cache_bytes", type=mib, default=E.cache_bytes,
                   help="KV cache budget in MiB: one pool of this size (on CUDA taken when the "
                   "engine starts), least recently used blocks evicted first (default "
                   f"{E.cache_bytes >> 20})")


def _thread_args(g: argparse._ActionsContainer, note: str = "") -> None:
    """``--threads`` and ``--preprocess-threads``: speed only, so a job's run may change them."""
    torch_default = note or "torch's, one per core"
    g.add_argument("--threads", type=positive_int, default=None,
                   help=f"torch CPU threads (default: {torch_default})")
    g.add_argument("--preprocess-threads", type=non_negative_int, default=None,
                   help="decoder processes (threads with --decode-timeout 0) decoding and "
                   "tiling the next image groups while the model answers the current one, "
                   "in-process (Ray: --preprocess-workers); 0: none ahead (one decoder "
                   f"process, or this thread) (default: {note or '2 on CPU, up to 8 on CUDA'})")


def _executor_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("executor (jobs)")
    g.add_argument("--executor", default=EXECUTORS[0], choices=EXECUTORS,
                   help="local: this process (default); ray: CPU preprocessing tasks feeding "
                   "model actors (pip install 'vlmbatch[ray]'; docs/jobs.md)")
    g.add_argument("--address", default=R.address,
                   help="ray: join this cluster: HOST:PORT (its GCS), ray://HEAD:10001 (Ray "
                   "Client) or auto (default: $RAY_ADDRESS, else a new local instance for the "
                   "run)")
    g.add_argument("--preprocess-workers", type=int, default=R.preprocess_workers,
                   help="ray: concurrent decode/tile tasks (default %(default)s)")
    g.add_argument("--model-workers", type=int, default=R.model_workers,
                   help="ray: model actors, one per GPU on a GPU cluster (default %(default)s)")
    g.add_argument("--model-cpus", type=float, default=R.model_cpus,
                   help="ray: CPUs per model actor = its torch threads on CPU (default "
                   "%(default)s)")
    decode_timeout_arg(g)


def decode_timeout_arg(g: argparse._ActionsContainer) -> None:
    """``--decode-timeout``: every command that decodes images has it (run, jobs, eval,
    embed; the server's batches take their job's)."""
    g.add_argument("--decode-timeout", type=float, default=P.decode_timeout,
                   help="seconds one image may take to read and decode before its worker (a "
                   "decoder process, or a Ray prepare task) is killed and that item fails "
                   "(default %(default)s); 0: no limit, and in-process decoding runs on "
                   "threads of this process, where a hung or crashing decoder stops the run")


def fetch_args(g: argparse._ActionsContainer, at_submit: bool = True) -> None:
    """The fetch stage's options (``PrepareConfig``): remote images (http(s), s3/gs/az),
    table rows and shard members. ``at_submit``: also the size cap, fixed with the job."""
    g.add_argument("--fetch-concurrency", type=positive_int, default=P.fetch_concurrency,
                   help="remote images (http(s)://, s3://, gs://, az://), table rows and shard "
                   "members read at once, ahead of decoding (default %(default)s)")
    g.add_argument("--fetch-timeout", type=float, default=P.fetch_timeout,
                   help="seconds a fetch attempt may wait to connect or between two reads "
                   "(default %(default)s); apart from --decode-timeout")
    g.add_argument("--fetch-retries", type=non_negative_int, default=P.fetch_retries,
                   help="more attempts after a 429, a 5xx or a connection error, backing off "
                   "(Retry-After honoured up to 60 s) (default %(default)s)")
    if at_submit:
        g.add_argument("--max-image-mib", dest="max_image_bytes", type=mib,
                       default=P.max_image_bytes,
                       help="an encoded image larger than this many MiB is that item's error, "
                       "refused before it is read whole (default "
                       f"{P.max_image_bytes >> 20})")


def dataset_args(p: argparse.ArgumentParser) -> None:
    """A table input's columns (``RunConfig``)."""
    g = p.add_argument_group("tables (Parquet, HF datasets)")
    g.add_argument("--image-column", default=default_of(RunConfig, "image_column"),
                   help="the column of encoded bytes, {bytes, path} structs (HF datasets' "
                   "Image) or paths/URLs (default %(default)s)")
    g.add_argument("--id-column", default=None,
                   help="the column of item ids (default: FILE:ROW)")
    g.add_argument("--questions-column", default=None,
                   help="the column of each row's own questions (a string, or a list of "
                   "strings or question objects), asked before the policy's")


def given_options(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, str]:
    """Each option ``argv`` (one command line, already parsed by ``parser``) actually types,
    whatever its value: its ``dest`` -> the option's long name (``-o`` -> ``--out``), read
    off the command's parser (abbreviations resolved as argparse does)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    at = next((i for i, tok in enumerate(argv) if tok in sub.choices), None)
    if at is None:
        return {}
    table = sub.choices[argv[at]]._option_string_actions
    out: dict[str, str] = {}
    for tok in argv[at + 1:]:
        if tok == "--":
            break
        opt = tok.split("=", 1)[0]
        action = table.get(opt)
        if action is None and opt.startswith("--"):  # an abbreviation argparse accepted
            found = {a for s, a in table.items() if s.startswith(opt)}
            action = found.pop() if len(found) == 1 else None
        if action is not None and action.dest not in out:
            out[action.dest] = next((s for s in action.option_strings if s.startswith("--")),
                                    opt)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vlmbatch",
        description="Ask a vision-language model yes/no questions about many images, fast.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_run, _add_submit, _add_job_commands, _add_eval, add_calibrate_parser,
                add_report_parser, _add_quantize, _add_export_vit, _add_serve):
        add(sub)
    add_embed_parser(sub, _model_args, decode_timeout_arg)
    return p


def _add_run(sub: argparse._SubParsersAction) -> None:
    """``run MANIFEST | --images DIR | JOB``."""
    r = sub.add_parser("run", help="answer a manifest's (or a folder's) questions -> JSONL; "
                       "or run a submitted job",
                       description="Answer every question about every image; one JSONL line per "
                       "(image, question) with answer, p_yes and error. Given a job folder "
                       "(from `submit`), run its pending items instead: with a job only --threads, "
                       "--preprocess-threads (default: as submitted), --retry-failed and the "
                       "executor options may be given; the rest was fixed at submit.")
    r.add_argument("manifest", nargs="?",
                   help='JSONL, one image per line: {"id", "image", "questions"}; a Parquet '
                   "file, folder or glob, or an HF dataset's save_to_disk folder "
                   "(--image-column); WebDataset shards ('shards/{00000..00099}.tar', paths "
                   "or URLs); or a job folder")
    r.add_argument("--images", type=Path, help="a folder of images instead of a manifest")
    r.add_argument("--policy", type=Path,
                   help="YAML/TOML file of questions asked of every image")
    r.add_argument("--out", "-o", type=Path, help="results file: JSONL, or CSV when it ends "
                   "in .csv (default: JSONL on standard output)")
    r.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    r.add_argument("--retry-failed", action="store_true",
                   help="a job: first queue its failed images again (as `resume --retry-failed`)")
    r.add_argument("--max-pixels", type=int, default=P.max_pixels,
                   help="images with more pixels (read from the header) are that item's error "
                   "(default %(default)s)")
    dataset_args(r)
    fetch_args(r.add_argument_group("fetching"))
    _model_args(r)
    _executor_args(r)


def _add_submit(sub: argparse._SubParsersAction) -> None:
    """``submit``: a resumable job folder."""
    s = sub.add_parser("submit", help="create a resumable job (SQLite store) from a manifest",
                       description="Validate the input and create a job folder: config + a "
                       "store of every item. Run it with `vlmbatch run JOB` (or --wait).")
    s.add_argument("manifest", nargs="?",
                   help="JSONL manifest; a Parquet file, folder or glob, or an HF dataset's "
                   "save_to_disk folder; or WebDataset shards (a brace pattern of .tar paths "
                   "or URLs)")
    s.add_argument("--images", type=Path, help="a folder of images instead of a manifest")
    s.add_argument("--policy", type=Path, help="YAML/TOML file of questions")
    s.add_argument("--task", default=TASKS[0], choices=TASKS,
                   help="answer: the questions (default); embed: one embedding per line of "
                   'a {"id", "image"?, "text"?} manifest or per image of --images DIR, with '
                   "the embedding options below (default model: the built-in embedding one)")
    s.add_argument("--job", type=Path, help="the job folder to create")
    s.add_argument("--wait", action="store_true", help="run the job now")
    s.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    s.add_argument("--max-pixels", type=int, default=P.max_pixels,
                   help="images with more pixels are that item's error (default %(default)s)")
    dataset_args(s)
    fetch_args(s.add_argument_group("fetching"))
    _model_args(s)
    _executor_args(s)
    embed_option_args(s)


def _add_job_commands(sub: argparse._SubParsersAction) -> None:
    """``status``, ``cancel``, ``resume`` and ``results`` of a job folder."""
    for name, text in [("status", "counts, QPM and ETA of a job"),
                       ("cancel", "stop a running job after its batch"),
                       ("resume", "continue an interrupted job")]:
        c = sub.add_parser(name, help=text, description=text)
        c.add_argument("job", type=Path)
        if name == "status":
            c.add_argument("--json", action="store_true",
                           help="one JSON object: status, items, done, failed, pending, "
                           "questions, qpm, eta_s, runner ({pid, host} or null)")
        if name != "resume":  # accepted as before, does nothing
            c.add_argument("--no-progress", dest="progress", action="store_false",
                           help=argparse.SUPPRESS)
        else:
            c.add_argument("--no-progress", dest="progress", action="store_false",
                           help="no progress bar")
            c.add_argument("--retry-failed", action="store_true",
                           help="first queue the failed images again (e.g. after fixing a "
                           "missing file or an out-of-memory batch)")
            _thread_args(c, "as submitted")
            fetch_args(c.add_argument_group("fetching (default: as submitted)"),
                       at_submit=False)
            _executor_args(c)
    x = sub.add_parser("results", help="export a job's results as JSONL, CSV or Parquet",
                       description="Every recorded result line of a job, in manifest order.")
    x.add_argument("job", type=Path)
    x.add_argument("--out", "-o",
                   help="file (default: standard output); a folder (a name ending in /, or an "
                   "existing folder) for Parquet: a dataset of several files")
    x.add_argument("--rows-per-file", type=positive_int, default=None,
                   help="Parquet into the folder --out as files of at most N rows each "
                   f"(default {PARQUET_ROWS_PER_FILE:,} when --out is a folder)")
    x.add_argument("--format", choices=["jsonl", "csv", "parquet", "npy"], default=None,
                   help="default: from --out's suffix (.parquet, .csv, .npy), else JSONL "
                   "(OpenAI batch output lines for a job submitted in that format); CSV and "
                   "Parquet have one row per result line, in our columns for either format; "
                   "an embedding job: JSONL, Parquet or .npy")


def _add_eval(sub: argparse._SubParsersAction) -> None:
    """``eval [MANIFEST]``: easy-vqa accuracy, or a labelled evaluation."""
    e = sub.add_parser("eval", help="accuracy on easy-vqa's test split (yes/no questions), or "
                       "metrics on your own labelled manifest",
                       description="Without MANIFEST: accuracy of a model on easy-vqa's yes/no "
                       "questions. With MANIFEST (questions carrying \"expected\"): ask its "
                       "labelled questions and print accuracy and, per question, precision, "
                       "recall, F1, AUROC and expected calibration error (10 bins), with a "
                       "confusion matrix for label-set questions; --json for scripts. With "
                       "--policy, at the policy's thresholds: calibrate on one labelled set, "
                       "check the written policy on another.")
    e.add_argument("manifest", type=Path, nargs="?",
                   help='a labelled manifest: questions {"id", "text", "expected": "yes"|"no"|'
                   "a choice}; only questions with expected are asked")
    e.add_argument("--policy", type=Path, help="with MANIFEST: a policy (e.g. `calibrate "
                   "--write-policy`'s). A policy question with the id of a line's question is "
                   "that question, evaluated at the policy's threshold (its text and label set "
                   "must match the line's; system, prompt, expected: the line's where it sets "
                   "them, else the policy's; a conflict is refused); the policy's other "
                   "questions are asked of every image (their expected holds for every image)")
    e.add_argument("--json", action="store_true", help="with MANIFEST: one JSON object")
    e.add_argument("--split", default="test", choices=SPLITS)
    e.add_argument("--limit", type=positive_int, default=None, help="first N questions only")
    e.add_argument("--open", dest="open_questions", action="store_true",
                   help="easy-vqa's open questions instead, asked as label sets: the 3 shapes "
                   "(\"what is the red shape?\") or the 8 colours (\"what color is the "
                   "triangle?\") as choices (see --choice-scoring)")
    e.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    decode_timeout_arg(e)
    _model_args(e)


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    """``quantize``: a W4A16 checkpoint."""
    q = sub.add_parser("quantize", help="write a W4A16 (AWQ/GPTQ) copy of a model, calibrated "
                       "on your images",
                       description="Quantise the language model's decoder linears to 4-bit "
                       "weights (symmetric, per group) with AWQ or GPTQ, calibrated on the "
                       "questions of a manifest, and write a compressed-tensors checkpoint that "
                       "`vlmbatch run --model OUT` serves. The vision encoder stays as it is "
                       "(see --vit-backend onnxruntime-int8).")
    q.add_argument("--model", type=Path, default=None,
                   help="HF-format checkpoint directory (default: the built-in model)")
    q.add_argument("--method", required=True, choices=METHODS,
                   help="rtn: plain round-to-nearest, for comparison")
    q.add_argument("--calib", type=Path, required=True,
                   help="JSONL manifest of calibration images and questions")
    q.add_argument("--policy", type=Path, help="YAML/TOML questions asked of every image")
    q.add_argument("--samples", type=int, default=SAMPLES,
                   help="calibration (image, question) pairs (default %(default)s)")
    q.add_argument("--group-size", type=int,
                   default=GROUP_SIZE,
                   help="input columns per scale (default %(default)s)")
    q.add_argument("--out", type=Path, required=True, help="new model folder")
    q.add_argument("--device", default="cpu",
                   help="where calibration runs: cpu (default) or cuda; the model is float32")
    q.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's, one per core)")
    q.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")


def _add_export_vit(sub: argparse._SubParsersAction) -> None:
    """``export-vit``: the vision encoder as ONNX."""
    x = sub.add_parser("export-vit", help="export the vision encoder to ONNX and check it",
                       description="ONNX of the vision encoder (uint8 tiles in, embeddings out, "
                       "dynamic batch), checked with onnxruntime against torch. `run "
                       "--vit-backend onnxruntime` exports on the fly; this file is for other "
                       "runtimes, TensorRT's builder (docs/vision.md) or inspection.")
    x.add_argument("--model", type=Path, default=None,
                   help="HF-format checkpoint directory (default: the built-in model)")
    x.add_argument("--out", type=Path, required=True, help="output folder")
    x.add_argument("--opset", type=int, default=OPSET,
                   choices=range(17, 21), metavar="{17..20}",
                   help="ONNX opset (default %(default)s; SDPA exports as plain ops in 17-20)")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    """``serve``: the OpenAI-compatible server (its options: ``vlmbatch/app/server/config.py``)."""
    s = sub.add_parser("serve", help="an OpenAI-compatible server: chat completions with "
                       "P(yes), embeddings, files and batches (docs/server.md)",
                       description="Serve the model over HTTP: /v1/chat/completions (yes/no "
                       "with P(yes) in logprobs), /v1/embeddings (--embed-model), /v1/files + "
                       "/v1/batches of either (each batch a resumable job), /v1/models, "
                       "/health. --images-per-batch is a batch "
                       "job's group, the most an interactive request waits behind.")
    _model_args(s)
    add_server_args(s)
    fetch_args(s.add_argument_group("fetching http(s) images (--allow-remote-media)"))
    add_executor_args(s)
