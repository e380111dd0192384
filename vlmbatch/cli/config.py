"""The config roots of the commands: one frozen record per command line, holding the shared
sub-configs once each (``engine/config.py``: ``ModelConfig``, ``EngineConfig``,
``EmbedConfig``; ``pipeline/config.py``: ``PrepareConfig``; ``jobs/config.py``:
``ExecutorConfig``)::

    run / submit   jobs.config.RunConfig      input, output, task; model, engine, prepare,
                                              executor, embed  (a job stores it: job.json)
    run JOB,       ResumeConfig               a job's run: threads, deadlines, fetching,
    resume                                    executor (the rest was fixed at submit)
    submit         SubmitConfig               the job folder, --wait (beside RunConfig)
    status, cancel JobConfig                  the job folder
    results        ResultsConfig              the job folder, output, format
    serve          server.config.ServerConfig listen, limits, batches; model, engine, prepare,
                                              executor
    embed          EmbedCommandConfig         inputs, outputs; model, engine, prepare, embed
    eval           EvalConfig                 split, limit (or a labelled manifest); model,
                                              engine, prepare
    calibrate      CalibrateConfig            results, labels, target, outputs
    report         ReportConfig               job, output, contact sheet size, labels
    review         ReviewConfig               export (job, filters) or import (an export)
    quantize       QuantizeConfig             method, calibration, output
    export-vit     ExportVitConfig            output, opset

Each field a command line sets declares its option in its metadata
(``common/options.py``), a field taking another root's option names that declaration
(``reuse``); ``cli/args.py`` derives the parsers from them and ``common.options.build``
fills a root from what was typed. Every check of a root's values is in its
``__post_init__``: a bad combination fails before any model is loaded, whichever way the
root was built (the CLI, the API, a test). Light: no torch.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from vlmbatch.common.options import COUNT, WORDS, N, Unit, opt, probability, reuse
from vlmbatch.engine.config import EMBED_GROUP, ConfigError, EmbedConfig, EngineConfig, ModelConfig
from vlmbatch.jobs.config import ExecutorConfig, RunConfig, check_ray_threads
from vlmbatch.models.paths import DEFAULT_EMBED_MODEL
from vlmbatch.outputs.export import PARQUET_ROWS_PER_FILE
from vlmbatch.pipeline.config import PrepareConfig, check_threads
from vlmbatch.quant import GROUP_SIZE, METHODS, SAMPLES
from vlmbatch.vit_trt import OPSET

SPLITS = ("test", "train")
# a job folder, the positional argument of the commands about one
JOB = opt("job", parse=Path, help="a job folder (`vlmbatch submit`)")
PROBABILITY = Unit(probability, str, "P")
LABELS_HELP = ('labels: a JSONL file, one line per (image id, question id): {"id": "a1", '
               '"question_id": "red", "expected": "yes"} (other keys ignored); or the '
               'manifest itself, its questions carrying "expected" ("yes"/"no", or one of a '
               "label-set question's choices). Told apart by the first line (a manifest's "
               'has "image")')
AS_SUBMITTED = "as submitted"  # a job's run: what None means for a setting it may change


@dataclass(frozen=True)
class JobConfig:
    """``vlmbatch status JOB`` and ``cancel JOB``."""
    job: Path = field(metadata=JOB)
    json: bool = field(default=False, metadata=opt(
        "--json", action="true", help="one JSON object: status, items, done, failed, pending, "
        "questions, qpm, eta_s, runner ({pid, host} or null)"))
    # accepted as before, does nothing
    progress: bool = reuse(RunConfig, "progress", True, hidden=True)


@dataclass(frozen=True)
class ResumeConfig:
    """A run of a job (``resume JOB``, ``run JOB``, ``submit --wait``): what a run may change
    (``RunConfig.for_run``, where the job's config checks the new values); None keeps what
    was submitted."""
    job: Path = field(metadata=JOB)
    retry_failed: bool = field(default=False, metadata=opt(
        "--retry-failed", action="true", help="a job: first queue its failed images again "
        "(e.g. after fixing a missing file or an out-of-memory batch)"))
    progress: bool = reuse(RunConfig, "progress", True)
    threads: int | None = reuse(RunConfig, "threads", None, shown=AS_SUBMITTED)
    preprocess_threads: int | None = reuse(PrepareConfig, "preprocess_threads", None,
                                           shown=AS_SUBMITTED)
    decode_timeout: float | None = reuse(PrepareConfig, "decode_timeout", None,
                                         shown=AS_SUBMITTED)
    fetch_concurrency: int | None = reuse(PrepareConfig, "fetch_concurrency", None,
                                          shown=AS_SUBMITTED)
    fetch_timeout: float | None = reuse(PrepareConfig, "fetch_timeout", None, shown=AS_SUBMITTED)
    fetch_retries: int | None = reuse(PrepareConfig, "fetch_retries", None, shown=AS_SUBMITTED)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    reuse: Path | None = field(default=None, metadata=opt(  # jobs/reuse.py
        "--reuse", parse=Path, metavar="OLD_JOB", help="copy the answers of an earlier job "
        "where the image's content, the question (text, choices, instruction, system turn) "
        "and the model (fingerprint, tiling, answer settings) are the same, re-deciding a "
        "changed threshold from its P(yes); compute only the rest (submit: kept for the "
        "job's runs)"))

    def __post_init__(self) -> None:
        check_threads(self.threads, self.preprocess_threads)
        check_ray_threads(self.executor, self.threads, self.preprocess_threads)

    @property
    def fetch(self) -> dict[str, int | float]:
        """The fetch settings this run changes (``jobs.config.RUN_FETCH``)."""
        return {k: v for k in ("fetch_concurrency", "fetch_timeout", "fetch_retries")
                if (v := getattr(self, k)) is not None}


@dataclass(frozen=True)
class SubmitConfig:
    """``vlmbatch submit``'s own options, beside the job's ``RunConfig``."""
    job: Path | None = field(default=None, metadata=opt(
        "--job", parse=Path, metavar="DIR", help="the job folder to create"))
    wait: bool = field(default=False, metadata=opt(
        "--wait", action="true", help="run the job now"))
    reuse: Path | None = reuse(ResumeConfig, "reuse", None)

    def __post_init__(self) -> None:
        if self.job is None:
            raise ConfigError("submit needs --job DIR: the folder the job is kept in")


@dataclass(frozen=True)
class ResultsConfig:
    """``vlmbatch results JOB``: a job's recorded lines (or vectors) exported."""
    job: Path = field(metadata=JOB)
    out: str | None = field(default=None, metadata=opt(  # None: standard output
        "--out", "-o", metavar="PATH", help="file (default: standard output); a folder (a name "
        "ending in /, or an existing folder) for Parquet: a dataset of several files"))
    rows_per_file: int | None = field(default=None, metadata=opt(
        "--rows-per-file", unit=N, help="Parquet into the folder --out as files of at most N "
        f"rows each (default {PARQUET_ROWS_PER_FILE:,} when --out is a folder)"))
    format: str | None = field(default=None, metadata=opt(
        "--format", choices=("jsonl", "csv", "parquet", "npy"), help="default: from --out's "
        "suffix (.parquet, .csv, .npy), else JSONL (OpenAI batch output lines for a job "
        "submitted in that format); CSV and Parquet have one row per result line, in our "
        "columns for either format; an embedding job: JSONL, Parquet or .npy"))

    @property
    def out_path(self) -> Path | None:
        return None if self.out is None else Path(self.out)

    @property
    def to_folder(self) -> bool:
        """``--out`` names a folder: a Parquet dataset (``-o DIR/``, an existing folder)."""
        return self.out is not None and (self.out.endswith(("/", os.sep))
                                         or Path(self.out).is_dir())


@dataclass(frozen=True)
class EvalConfig:
    """``vlmbatch eval``: accuracy on easy-vqa's yes/no questions (``open_questions``: its
    open ones, asked as label sets), or, given a manifest whose questions carry ``expected``,
    the metrics of a labelled evaluation on it."""
    manifest: Path | None = field(default=None, metadata=opt(  # a labelled manifest
        "manifest", parse=Path, nargs="?", help='a labelled manifest: questions {"id", '
        '"text", "expected": "yes"|"no"|a choice}; only questions with expected are asked'))
    # with a manifest: its questions of a line's ids at its thresholds, the others asked of
    # every image (labels/read.py labelled_manifest)
    policy: Path | None = field(default=None, metadata=opt(
        "--policy", parse=Path, metavar="FILE", help="with MANIFEST: a policy (e.g. `calibrate "
        "--write-policy`'s). A policy question with the id of a line's question is that "
        "question, evaluated at the policy's threshold (its text and label set must match the "
        "line's; system, prompt, expected: the line's where it sets them, else the policy's; a "
        "conflict is refused); the policy's other questions are asked of every image (their "
        "expected holds for every image)"))
    json: bool = field(default=False, metadata=opt(  # with a manifest: one JSON object
        "--json", action="true", help="with MANIFEST: one JSON object"))
    split: str = field(default="test", metadata=opt(  # one of SPLITS
        "--split", choices=SPLITS, help="easy-vqa's split (default %(default)s)"))
    limit: int | None = field(default=None, metadata=opt(  # the first N questions only
        "--limit", unit=N, help="first N questions only"))
    open_questions: bool = field(default=False, metadata=opt(
        "--open", action="true", help="easy-vqa's open questions instead, asked as label sets: "
        "the 3 shapes (\"what is the red shape?\") or the 8 colours (\"what color is the "
        "triangle?\") as choices (see --choice-scoring)"))
    images_per_batch: int = reuse(RunConfig, "images_per_batch", 16)
    threads: int | None = reuse(RunConfig, "threads", None)  # None: torch's default
    progress: bool = reuse(RunConfig, "progress", True)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"split {self.split!r} not one of {SPLITS}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
        if self.manifest is None and (self.policy is not None or self.json):
            raise ConfigError("--policy and --json apply to `vlmbatch eval MANIFEST` (a "
                              "labelled manifest); plain `eval` runs easy-vqa")
        if self.manifest is not None and (self.limit is not None or self.split != "test"):
            raise ConfigError("--split and --limit choose easy-vqa's questions; a manifest's "
                              "are all asked")
        if self.images_per_batch < 1:
            raise ConfigError(f"images_per_batch must be >= 1, got {self.images_per_batch}")
        check_threads(self.threads, None)


@dataclass(frozen=True)
class EmbedCommandConfig:
    """``vlmbatch embed``: exactly one input (texts, image files or a manifest; none: texts
    from standard input), or ``--maxsim QUERIES DOCS``, or ``--eval``."""
    texts: tuple[str, ...] = field(default=(), metadata=opt(
        "texts", nargs="*", help="texts to embed"))
    images: tuple[Path, ...] | None = field(default=None, metadata=opt(  # files or one folder
        "--images", parse=Path, nargs="+", metavar="IMAGE", help="image files (or one "
        "folder)"))
    manifest: Path | None = field(default=None, metadata=opt(
        "--manifest", parse=Path, metavar="FILE", help='JSONL: {"id", "image"?, "text"?} per '
        "line"))
    out: Path | None = field(default=None, metadata=opt(  # JSONL (None: stdout), Parquet, .npy
        "--out", "-o", parse=Path, metavar="FILE", help="JSONL (default, standard output), "
        ".parquet or .npy"))
    sim: bool = field(default=False, metadata=opt(  # print the cosine-similarity matrix
        "-sim", "--sim", action="true", help="print the cosine-similarity matrix (input order, "
        "4 decimals)"))
    maxsim: tuple[Path, Path] | None = field(default=None, metadata=opt(  # QUERIES, DOCS
        "--maxsim", parse=Path, nargs=2, metavar=("QUERIES", "DOCS"), help="late-interaction "
        "(MaxSim) scores of multi-vector embeddings: each a text file (one per line) or a "
        "JSONL manifest; prints a QUERIES x DOCS matrix"))
    eval: bool = field(default=False, metadata=opt(  # easy-vqa retrieval figures
        "--eval", action="true", help="text->image precision@10 and image->image top-1 on "
        "easy-vqa's test images"))
    limit: int | None = field(default=None, metadata=opt(  # --eval: the first N images
        "--limit", unit=COUNT, help="--eval: first N labelled images"))
    images_per_batch: int = reuse(RunConfig, "images_per_batch", EMBED_GROUP)
    threads: int | None = reuse(RunConfig, "threads", None)
    # the built-in embedding model unless --model says otherwise
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=DEFAULT_EMBED_MODEL))
    engine: EngineConfig = field(default_factory=EngineConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)

    def __post_init__(self) -> None:
        if len([x for x in (self.texts or None, self.images, self.manifest) if x is not None]) > 1:
            raise ConfigError("give texts, --images or --manifest, not several")
        other = [n for n, on in (("--eval", self.eval), ("--maxsim", self.maxsim is not None),
                                 ("-sim", self.sim)) if on]
        if len(other) > 1:
            raise ConfigError(f"{' and '.join(other)} are different outputs: give one")
        if (self.eval or self.maxsim) and (self.texts or self.images or self.manifest):
            raise ConfigError(f"{other[0]} reads its own inputs: drop the texts, --images and "
                              "--manifest")
        if self.limit is not None and (self.limit < 1 or not self.eval):
            raise ConfigError("--limit N (N >= 1) applies to --eval")
        if self.images_per_batch < 1:
            raise ConfigError(f"images_per_batch must be >= 1, got {self.images_per_batch}")
        check_threads(self.threads, None)

    @property
    def embed_config(self) -> EmbedConfig:
        """What is embedded: ``--maxsim`` compares multi-vectors."""
        return dataclasses.replace(self.embed, multi_vector=True) if self.maxsim else self.embed


@dataclass(frozen=True)
class QuantizeConfig:
    """``vlmbatch quantize``: a W4A16 copy of a checkpoint, calibrated on a manifest."""
    method: str = field(metadata=opt(  # one of quant.METHODS
        "--method", required=True, choices=METHODS, help="rtn: plain round-to-nearest, for "
        "comparison"))
    calib: Path = field(metadata=opt(  # JSONL manifest of calibration images and questions
        "--calib", parse=Path, required=True, metavar="FILE", help="JSONL manifest of "
        "calibration images and questions"))
    out: Path = field(metadata=opt(  # the new model folder
        "--out", parse=Path, required=True, metavar="DIR", help="new model folder"))
    model: Path | None = reuse(ModelConfig, "path", None)  # None: the built-in model
    policy: Path | None = reuse(RunConfig, "policy", None)
    samples: int = field(default=SAMPLES, metadata=opt(
        "--samples", unit=COUNT, help="calibration (image, question) pairs (default %(default)s)"))
    group_size: int = field(default=GROUP_SIZE, metadata=opt(
        "--group-size", unit=COUNT, help="input columns per scale (default %(default)s)"))
    # where calibration runs (the model is float32)
    device: str = reuse(ModelConfig, "device", "cpu")
    threads: int | None = reuse(RunConfig, "threads", None)
    progress: bool = reuse(RunConfig, "progress", True)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method {self.method!r} not one of {METHODS}")
        if self.samples < 1 or self.group_size < 1:
            raise ConfigError("--samples and --group-size must be >= 1")
        check_threads(self.threads, None)


@dataclass(frozen=True)
class ExportVitConfig:
    """``vlmbatch export-vit``: the vision encoder as ONNX, checked with onnxruntime."""
    out: Path = field(metadata=opt(
        "--out", parse=Path, required=True, metavar="DIR", help="output folder"))
    model: Path | None = reuse(ModelConfig, "path", None)
    opset: int = field(default=OPSET, metadata=opt(
        "--opset", parse=int, choices=tuple(range(17, 21)), metavar="{17..20}",
        help="ONNX opset (default %(default)s; SDPA exports as plain ops in 17-20)"))

    def __post_init__(self) -> None:
        if not 17 <= self.opset <= 20:
            raise ConfigError(f"--opset must be in 17..20, got {self.opset}")


@dataclass(frozen=True)
class CalibrateConfig:
    """``vlmbatch calibrate``: per yes/no question, the threshold meeting one target."""
    results: Path = field(metadata=opt(  # a results JSONL file or a job folder
        "results", parse=Path, help="result lines: a results .jsonl (`vlmbatch run -o`, "
        "`vlmbatch results JOB`) or a job folder"))
    # a labels JSONL file or a manifest with `expected` on its questions
    labels: Path = field(metadata=opt(
        "--labels", parse=Path, required=True, metavar="FILE", help=LABELS_HELP))
    precision: float | None = field(default=None, metadata=opt(
        "--precision", unit=PROBABILITY, metavar="P", exclusive="target", required=True,
        help="target: precision >= P"))
    recall: float | None = field(default=None, metadata=opt(
        "--recall", unit=PROBABILITY, metavar="R", exclusive="target", required=True,
        help="target: recall >= R"))
    max_fpr: float | None = field(default=None, metadata=opt(
        "--max-fpr", unit=PROBABILITY, metavar="F", exclusive="target", required=True,
        help="target: false-positive rate <= F"))
    f1: bool = field(default=False, metadata=opt(
        "--f1", action="true", exclusive="target", required=True, help="target: the best F1"))
    plots: Path | None = field(default=None, metadata=opt(  # a folder for pr.png and roc.png
        "--plots", parse=Path, metavar="DIR", help="folder for pr.png and roc.png, each "
        "question in its own colour, line style and marker, its AUROC in the legend, the "
        "target as a line (matplotlib: pip install 'vlmbatch[plots]')"))
    write_policy: Path | None = field(default=None, metadata=opt(
        "--write-policy", parse=Path, metavar="P.yaml", help="write a policy asking each "
        "calibrated question with its threshold"))
    json: bool = field(default=False, metadata=opt(
        "--json", action="true", help="the table as one JSON object"))

    def __post_init__(self) -> None:
        given = [n for n, v in (("--precision", self.precision), ("--recall", self.recall),
                                ("--max-fpr", self.max_fpr)) if v is not None]
        if len(given) + self.f1 != 1:
            raise ConfigError("give exactly one target: --precision P, --recall R, "
                              "--max-fpr F or --f1")
        for name, v in (("--precision", self.precision), ("--recall", self.recall),
                        ("--max-fpr", self.max_fpr)):
            if v is not None and not 0.0 <= v <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {v}")
        if self.write_policy is not None and self.write_policy.suffix not in (".yaml", ".yml"):
            raise ConfigError(f"--write-policy {self.write_policy}: give a .yaml file")

    @property
    def target(self) -> tuple[str, float | None]:
        """(kind, value) of the one target given: ``labels/calibration.py``'s ``Target``."""
        for kind in ("precision", "recall", "max_fpr"):
            if (v := getattr(self, kind)) is not None:
                return kind, v
        return "f1", None


@dataclass(frozen=True)
class ReportConfig:
    """``vlmbatch report``: one self-contained HTML page about a job."""
    job: Path = field(metadata=JOB)
    out: Path = field(metadata=opt(
        "--out", "-o", parse=Path, required=True, metavar="FILE", help="the .html file to "
        "write"))
    borderline: int = field(default=8, metadata=opt(  # thumbnails per question
        "--borderline", unit=COUNT, help="images per question's contact sheet (default "
        "%(default)s)"))
    thumb_size: int = field(default=128, metadata=opt(  # pixels, the longer side
        "--thumb-size", parse=int, metavar="PIXELS", help="thumbnail size in pixels, the longer "
        "side (default %(default)s)"))
    labels: Path | None = field(default=None, metadata=opt(  # `review import`'s file
        "--labels", parse=Path, metavar="FILE", help="reviewed labels (`vlmbatch review "
        "import`): the page counts per question the answers reviewed and how many the "
        "reviewer changed"))

    def __post_init__(self) -> None:
        if self.borderline < 0 or not 16 <= self.thumb_size <= 512:
            raise ConfigError("--borderline must be >= 0 and --thumb-size in 16..512")
        if self.out.suffix.lower() not in (".html", ".htm"):
            raise ConfigError(f"-o {self.out}: give an .html file")


REVIEW_ACTIONS = ("export", "import")


@dataclass(frozen=True)
class ReviewConfig:
    """``vlmbatch review export JOB`` (Label Studio tasks of a job's answers) and ``review
    import EXPORT`` (what people decided, as a labels file): ``labels/review/``."""
    action: str = field(metadata=opt(  # one of REVIEW_ACTIONS
        "action", choices=REVIEW_ACTIONS, help="export: a job's answers as Label Studio tasks; "
        "import: a Label Studio export as a labels file for `calibrate --labels` and `eval`"))
    source: Path | None = field(default=None, metadata=opt(  # None: import --url
        "source", parse=Path, nargs="?", metavar="JOB|EXPORT", help="export: the job folder; "
        "import: a Label Studio JSON or JSON_MIN export (or --url and --project instead)"))
    out: Path | None = field(default=None, metadata=opt(  # None: standard output
        "--out", "-o", parse=Path, metavar="FILE", help="export: the tasks (.json); import: "
        "the labels (.jsonl) (default: standard output)"))
    config_out: Path | None = field(default=None, metadata=opt(
        "--config-out", parse=Path, metavar="FILE", help="export: the labelling configuration "
        "(XML) to create the project with"))
    questions: tuple[str, ...] = field(default=(), metadata=opt(
        "--questions", unit=WORDS, help="export: only these question ids (default: all)"))
    borderline: float | None = field(default=None, metadata=opt(
        "--borderline", parse=float, metavar="D", help="export: only images with an answer "
        "within D of its threshold in log-odds (1: a factor e in odds)"))
    limit: int | None = field(default=None, metadata=opt(
        "--limit", unit=N, help="export: at most N images, the most borderline"))
    document_root: Path = field(default=Path("/"), metadata=opt(
        "--document-root", parse=Path, metavar="DIR", help="export: Label Studio's "
        "LOCAL_FILES_DOCUMENT_ROOT; local images become /data/local-files/?d=PATH URLs "
        "relative to it (default %(default)s)"))
    url: str | None = field(default=None, metadata=opt(
        "--url", metavar="URL", help="a running Label Studio: export imports the tasks into "
        "the project --project (created, or reused by title); import pulls its JSON export"))
    token: str | None = field(default=None, metadata=opt(  # None: $LABEL_STUDIO_API_KEY
        "--token", metavar="TOKEN", help="with --url: an access token (default: "
        "$LABEL_STUDIO_API_KEY)"))
    project: str | None = field(default=None, metadata=opt(
        "--project", metavar="TITLE|ID", help="with --url: the project's title (export: "
        "default the job folder's name) or id"))

    def __post_init__(self) -> None:
        export = self.action == "export"
        if self.action not in REVIEW_ACTIONS:
            raise ConfigError(f"review {self.action!r}: give export or import")
        if self.source is None and (export or self.url is None):
            raise ConfigError("review export JOB: give the job folder" if export else
                              "review import: give an export file, or --url and --project")
        if self.url is None and (self.token is not None or self.project is not None):
            raise ConfigError("--token and --project go with --url (a running Label Studio)")
        if not export and self.url is not None and self.project is None:
            raise ConfigError("review import --url: give --project (its title or id)")
        given = [n for n, v in (("--config-out", self.config_out), ("--borderline",
                 self.borderline), ("--limit", self.limit), ("--questions",
                 self.questions or None)) if v is not None]
        if not export and given:
            raise ConfigError(f"{', '.join(given)} apply to `review export`")
        if self.borderline is not None and not self.borderline >= 0:
            raise ConfigError(f"--borderline must be >= 0 (a log-odds distance), got "
                              f"{self.borderline}")

    @property
    def api_key(self) -> str | None:
        return self.token if self.token is not None else os.environ.get("LABEL_STUDIO_API_KEY")
