"""The config root of a run and of a job: ``RunConfig`` (input, output, batching, threads)
holds the shared sub-configs ``ModelConfig``, ``EngineConfig`` and ``PrepareConfig``
(``pipeline/config.py``: the same records the other commands' roots hold, ``cli/config.py``,
``server/config.py``) and ``ExecutorConfig`` (where the run's stages execute, with the Ray
options). Each field a command line sets declares its option (``common/options.py``); the
CLI's parsers are derived from those declarations (``cli/args.py``). A job stores it
serialised (``to_json``/``from_json``, with ``RunConfig.VERSION``) and each run may change only
what does not change an answer: thread counts, the decode deadline and the executor
(``for_run``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar

from vlmbatch.common.options import COUNT, NOT_STORED, N, non_default, opt
from vlmbatch.engine.config import ConfigError, EmbedConfig, EngineConfig, ModelConfig
from vlmbatch.pipeline.config import PrepareConfig, PrepareOptions, check_threads
from vlmbatch.pipeline.questions import MAX_PROMPT_CHARS

EXECUTORS = ("local", "ray")
# the fetch stage's settings a run of a job may change (PrepareConfig fields; the size cap is
# fixed at submit, as the pixel limit is)
RUN_FETCH = ("fetch_concurrency", "fetch_timeout", "fetch_retries")
# what a run does with its items: answer their questions (yes/no), or embed them
TASKS = ("answer", "embed")
TABLES = "tables (Parquet, HF datasets)"  # the help section of a table input's options


@dataclass(frozen=True)
class RayOptions:
    OPTION_GROUP: ClassVar[str] = "executor"
    # None: $RAY_ADDRESS, else a new local instance for this run
    address: str | None = field(default=None, metadata=opt(
        "--address", metavar="ADDRESS", help="ray: join this cluster: HOST:PORT (its GCS), "
        "ray://HEAD:10001 (Ray Client) or auto (default: $RAY_ADDRESS, else a new local "
        "instance for the run)"))
    preprocess_workers: int = field(default=1, metadata=opt(  # concurrent CPU prepare tasks
        "--preprocess-workers", unit=COUNT, help="ray: concurrent decode/tile tasks (serve: per "
        "batch) (default %(default)s)"))
    model_workers: int = field(default=1, metadata=opt(  # model actors (one per GPU)
        "--model-workers", unit=COUNT, help="ray: model actors, one per GPU on a GPU cluster "
        "(serve: shared by the batches) (default %(default)s)"))
    # CPUs reserved per model actor (its torch threads, on CPU)
    model_cpus: float = field(default=1.0, metadata=opt(
        "--model-cpus", parse=float, metavar="CPUS", help="ray: CPUs per model actor = its "
        "torch threads on CPU (default %(default)s)"))

    def __post_init__(self) -> None:
        if self.preprocess_workers < 1 or self.model_workers < 1:
            raise ConfigError("--preprocess-workers and --model-workers must be >= 1")
        if not self.model_cpus > 0:
            raise ConfigError("--model-cpus must be > 0")


@dataclass(frozen=True)
class ExecutorConfig:
    OPTION_GROUP: ClassVar[str] = "executor"
    # one of EXECUTORS: this process, or Ray tasks and actors
    kind: str = field(default="local", metadata=opt(
        "--executor", choices=EXECUTORS, help="local: this process (serve: batches on the "
        "engine processes, between interactive requests) (default); ray: CPU preprocessing "
        "tasks feeding model actors (serve: each batch a job on Ray, several at once, sharing "
        "the actors) (pip install 'vlmbatch[ray]'; docs/jobs.md)"))
    ray: RayOptions = field(default_factory=RayOptions)

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise ConfigError(f"executor {self.kind!r} not one of {EXECUTORS}")
        if self.kind != "ray" and (given := non_default(self.ray)):
            raise ConfigError(f"{', '.join(given)}: Ray executor options; add --executor ray")


def check_ray_threads(executor: ExecutorConfig, threads: int | None,
                      preprocess_threads: int | None) -> None:
    """ConfigError for thread counts given to a run on Ray, where each model actor runs
    ``model_cpus`` torch threads (what Ray reserves) and decoding runs in Ray tasks."""
    given = [n for n, v in (("--threads", threads), ("--preprocess-threads",
                                                     preprocess_threads)) if v is not None]
    if executor.kind == "ray" and given:
        raise ConfigError(f"{', '.join(given)}: thread counts apply to in-process runs; with "
                          "--executor ray each model actor runs --model-cpus torch threads "
                          "(what Ray reserves) and decoding runs in Ray tasks: use "
                          "--preprocess-workers")


@dataclass(frozen=True)
class RunConfig:
    # of the serialised form (job.json); 3: task and embed; 4: decode_timeout moved from the
    # Ray options to the executor's; 5: max_pixels, preprocess_threads and decode_timeout in
    # the shared PrepareConfig; 6: tabular and sharded inputs (dataset and its columns), the
    # fetch stage's settings in PrepareConfig, engine.choice_scoring (versions 1-5 read it as
    # "exact", its default; jobs.folder.load_config reads versions 1-5); fields added since
    # (model.resize, prepare.max_video_seconds) read as their defaults where a file lacks them
    VERSION: ClassVar[int] = 6

    manifest: Path | None = field(default=None, metadata=opt(
        "manifest", nargs="?", help='JSONL, one image per line: {"id", "image", "questions"}; '
        "a Parquet file, folder or glob, or an HF dataset's save_to_disk folder "
        "(--image-column); WebDataset shards ('shards/{00000..00099}.tar', paths or URLs); "
        "run: or a job folder"))
    images: Path | None = field(default=None, metadata=opt(  # asked the policy's questions
        "--images", parse=Path, metavar="DIR", help="a folder of images instead of a "
        "manifest"))
    # Parquet (a file, folder or glob), an HF dataset's save_to_disk folder, or WebDataset
    # shards (a brace pattern of .tar paths or URLs), as typed (inputs/datasets.py)
    dataset: str | None = None
    # a table's column of bytes, {bytes, path} or paths/URLs
    image_column: str = field(default="image", metadata=opt(
        "--image-column", metavar="COLUMN", group=TABLES, help="the column of encoded bytes, "
        "{bytes, path} structs (HF datasets' Image) or paths/URLs (default %(default)s)"))
    id_column: str | None = field(default=None, metadata=opt(  # default FILE:ROW
        "--id-column", metavar="COLUMN", group=TABLES, help="the column of item ids (default: "
        "FILE:ROW)"))
    questions_column: str | None = field(default=None, metadata=opt(  # each row's own
        "--questions-column", metavar="COLUMN", group=TABLES, help="the column of each row's "
        "own questions (a string, or a list of strings or question objects), asked before "
        "the policy's"))
    policy: Path | None = field(default=None, metadata=opt(
        "--policy", parse=Path, metavar="FILE", help="YAML/TOML file of questions asked of "
        "every image"))
    out: Path | None = field(default=None, metadata=opt(  # None: standard output
        "--out", "-o", parse=Path, metavar="FILE", help="results file: JSONL, or CSV when it "
        "ends in .csv (default: JSONL on standard output)"))
    images_per_batch: int = field(default=16, metadata=opt(  # preprocessed, scored together
        "--images-per-batch", unit=COUNT, help="images preprocessed and scored together "
        "(embed: inputs per call) (default %(default)s)"))
    # checked as the items are read (at submit for a job), so not kept in job.json (NOT_STORED)
    max_prompt_chars: int = field(default=MAX_PROMPT_CHARS, metadata={**opt(
        "--max-prompt-chars", unit=COUNT, metavar="CHARS", help="longest question (text, "
        "prompt and system together): a longer one, or one longer than the model's context "
        "in tokens, is refused before any work (default %(default)s)"), NOT_STORED: True})
    threads: int | None = field(default=None, metadata=opt(  # None: torch's default
        "--threads", unit=N, show=lambda v: "torch's, one per core" if v is None else str(v),
        help="torch CPU threads (default: %(default)s)"))
    progress: bool = field(default=True, metadata=opt(
        "--no-progress", action="false", help="no progress bar"))
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    task: str = field(default="answer", metadata=opt(  # one of TASKS
        "--task", choices=TASKS, help="answer: the questions (default); embed: one embedding "
        'per line of a {"id", "image"?, "text"?} manifest or per image of --images DIR, with '
        "the embedding options (default model: the built-in embedding one)"))
    embed: EmbedConfig = field(default_factory=EmbedConfig)  # task "embed": how

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"task {self.task!r} not one of {TASKS}")
        if sum(x is not None for x in (self.manifest, self.images, self.dataset)) != 1:
            raise ConfigError("give exactly one input: a manifest, a Parquet/HF dataset or "
                              "WebDataset shards, or --images DIR" +
                              (" with --policy" if self.task == "answer" else ""))
        self._check_dataset()
        if self.max_prompt_chars < 1:
            raise ConfigError(f"--max-prompt-chars must be >= 1, got {self.max_prompt_chars}")
        if self.task == "embed" and self.policy is not None:
            raise ConfigError("--policy asks questions: it does not apply to --task embed")
        if self.task != "embed" and (given := non_default(self.embed)):
            raise ConfigError(f"{', '.join(given)}: embedding options; add --task embed")
        check_ray_threads(self.executor, self.threads, self.prepare.preprocess_threads)
        if self.task == "answer" and self.images is not None and self.policy is None:
            raise ConfigError("--images DIR needs --policy FILE to say which questions to ask")
        if self.images_per_batch < 1:
            raise ConfigError(f"images_per_batch must be >= 1, got {self.images_per_batch}")
        check_threads(self.threads, None)
        if self.out is not None:
            for name, src in (("manifest", self.manifest), ("policy", self.policy)):
                if src is not None and Path(src).resolve() == Path(self.out).resolve():
                    raise ConfigError(f"--out {self.out} is the {name}: writing results there "
                                      "would overwrite it; pick another file")

    def _check_dataset(self) -> None:
        columns = [o for o, v in (("--id-column", self.id_column),
                                  ("--questions-column", self.questions_column),
                                  ("--image-column", self.image_column != "image" or None))
                   if v is not None]
        if self.dataset is None:
            if columns:
                raise ConfigError(f"{', '.join(columns)}: options of a Parquet or HF dataset "
                                  "input (a manifest's lines name their own fields)")
            return
        if self.task != "answer":
            raise ConfigError("--task embed reads a manifest or --images DIR; Parquet, HF "
                              "datasets and WebDataset shards are inputs of yes/no jobs")
        if not self.image_column:
            raise ConfigError("--image-column must not be empty")

    @property
    def prepare_options(self) -> PrepareOptions:
        """Stage 1 of this run, resolved for its model's device."""
        return self.prepare.options(self.model.device)

    def for_run(self, threads: int | None = None, preprocess_threads: int | None = None,
                executor: ExecutorConfig | None = None,
                decode_timeout: float | None = None,
                fetch: dict[str, Any] | None = None) -> RunConfig:
        """This config with one run's thread counts, decode deadline, fetch settings
        (``fetch``: any of ``RUN_FETCH``) and executor in place of those stored (None: keep
        them). These change no answer, only speed, what a hung image or a slow server costs
        and where the work runs, and a job may run on another machine than the one it was
        submitted on. On Ray the stored thread counts do not apply (each model actor runs
        ``model_cpus`` threads): they are dropped, and this run's are refused."""
        check_threads(threads, preprocess_threads)
        if executor is not None and executor.kind == "ray":
            keep = dataclasses.replace(self, threads=None, prepare=dataclasses.replace(
                self.prepare, preprocess_threads=None))
            return keep._for_run(threads, preprocess_threads, executor, decode_timeout, fetch)
        return self._for_run(threads, preprocess_threads, executor, decode_timeout, fetch)

    def _for_run(self, threads: int | None, preprocess_threads: int | None,
                 executor: ExecutorConfig | None, decode_timeout: float | None,
                 fetch: dict[str, Any] | None) -> RunConfig:
        unknown = sorted(set(fetch or {}) - set(RUN_FETCH))
        if unknown:
            raise ConfigError(f"not settings a run may change: {unknown}")
        prepare = dataclasses.replace(
            self.prepare, preprocess_threads=(self.prepare.preprocess_threads
                                              if preprocess_threads is None
                                              else preprocess_threads),
            decode_timeout=(self.prepare.decode_timeout if decode_timeout is None
                            else decode_timeout),
            **{k: v for k, v in (fetch or {}).items() if v is not None})
        return dataclasses.replace(self, threads=self.threads if threads is None else threads,
                                   prepare=prepare, executor=executor or self.executor)


def to_json(obj: Any) -> Any:
    """A config dataclass as plain JSON values (paths as strings, tuples as lists)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in fields(obj)
                if not f.metadata.get(NOT_STORED)}
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, tuple):
        return [to_json(x) for x in obj]
    return obj


def from_json(cls: type, d: dict) -> Any:
    """``cls`` (a config dataclass) from ``to_json``'s output. Fields ``d`` lacks take their
    defaults (configs written before the field existed); unknown keys are refused."""
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} setting(s) {unknown}")
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _value(hints[f.name], d[f.name]) for f in fields(cls) if f.name in d})


def _value(tp: Any, v: Any) -> Any:
    if v is None:
        return None
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return _value(args[0], v)  # X | None
    if is_dataclass(tp):
        return from_json(tp, v)  # type: ignore[arg-type]
    if tp is Path:
        return Path(v)
    if typing.get_origin(tp) is tuple:
        return tuple(v)
    return v
