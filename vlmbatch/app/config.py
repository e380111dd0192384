"""The config roots of the commands, and how each is built from the command line.

One frozen record per command, the shared sub-configs once each (``engine/config.py``:
``ModelConfig``, ``EngineConfig``, ``EmbedConfig``; ``pipeline/config.py``: ``PrepareConfig``;
``jobs/config.py``: ``ExecutorConfig``)::

    run / submit   jobs.config.RunConfig      input, output, task; model, engine, prepare,
                                              executor, embed  (a job stores it: job.json)
    serve          server.config.ServerConfig listen, limits, batches; model, engine, prepare
    embed          EmbedCommandConfig         inputs, outputs; model, engine, prepare, embed
    eval           EvalConfig                 split, limit (or a labelled manifest); model,
                                              engine, prepare
    calibrate      CalibrateConfig            results, labels, target, outputs
    report         ReportConfig               job, output, contact sheet size
    quantize       QuantizeConfig             method, calibration, output
    export-vit     ExportVitConfig            output, opset

``from_args`` fills a root from argparse's namespace by field name, recursing into the
sub-configs (the parser's ``dest`` of each option is its field's name, its ``type`` converts
units: ``app/args.py``), so a new option is one field and one ``add_argument``. Every check
of a root's values is in its ``__post_init__``: a bad combination fails before any model is
loaded, whichever way the root was built (the CLI, the API, a test). Light: no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from vlmbatch.engine.config import EMBED_GROUP, ConfigError, EmbedConfig, EngineConfig, ModelConfig
from vlmbatch.pipeline.config import PrepareConfig, check_threads
from vlmbatch.quant import GROUP_SIZE, METHODS, SAMPLES
from vlmbatch.vit_trt import OPSET

C = TypeVar("C")
SPLITS = ("test", "train")


def from_args(cls: type[C], ns: argparse.Namespace, **given: Any) -> C:
    """``cls`` (a config dataclass) from an argparse namespace: each field from the attribute
    of its name, a field that is itself a config dataclass built the same way from the same
    namespace, a field the namespace lacks left at its default; ``given`` (field name ->
    value) overrides the namespace at the top level."""
    hints = typing.get_type_hints(cls)
    values = vars(ns)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in given:
            kwargs[f.name] = given[f.name]
        elif (sub := _config_type(hints[f.name])) is not None:
            kwargs[f.name] = from_args(sub, ns)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def _config_type(tp: Any) -> type | None:
    """The config dataclass a field's type names (``X`` or ``X | None``), else None."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else None
    return tp if isinstance(tp, type) and is_dataclass(tp) else None


@dataclass(frozen=True)
class EvalConfig:
    """``vlmbatch eval``: accuracy on easy-vqa's yes/no questions (``open_questions``: its
    open ones, asked as label sets), or, given a manifest whose questions carry ``expected``,
    the metrics of a labelled evaluation on it."""
    split: str = "test"  # one of SPLITS
    open_questions: bool = False
    limit: int | None = None  # the first N questions only
    images_per_batch: int = 16
    threads: int | None = None  # torch threads (None: torch's default)
    progress: bool = True
    manifest: Path | None = None  # a labelled manifest instead of easy-vqa
    policy: Path | None = None  # with a manifest: questions asked of every image
    json: bool = False  # with a manifest: the metrics as one JSON object
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
    texts: tuple[str, ...] = ()
    images: tuple[Path, ...] | None = None  # image files (or one folder)
    manifest: Path | None = None
    out: Path | None = None  # JSONL (None: standard output), .parquet or .npy
    sim: bool = False  # print the cosine-similarity matrix instead
    maxsim: tuple[Path, Path] | None = None  # QUERIES, DOCS: late-interaction scores
    eval: bool = False  # easy-vqa retrieval figures
    limit: int | None = None  # --eval: the first N labelled images
    images_per_batch: int = EMBED_GROUP  # inputs per embedder call
    threads: int | None = None
    model: ModelConfig = field(default_factory=ModelConfig)  # path None: the embedding model
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
    method: str  # one of quant.METHODS
    calib: Path  # JSONL manifest of calibration images and questions
    out: Path  # the new model folder
    model: Path | None = None  # None: the built-in model
    policy: Path | None = None
    samples: int = SAMPLES
    group_size: int = GROUP_SIZE
    device: str = "cpu"
    threads: int | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method {self.method!r} not one of {METHODS}")
        if self.samples < 1 or self.group_size < 1:
            raise ConfigError("--samples and --group-size must be >= 1")
        check_threads(self.threads, None)


@dataclass(frozen=True)
class ExportVitConfig:
    """``vlmbatch export-vit``: the vision encoder as ONNX, checked with onnxruntime."""
    out: Path
    model: Path | None = None
    opset: int = OPSET

    def __post_init__(self) -> None:
        if not 17 <= self.opset <= 20:
            raise ConfigError(f"--opset must be in 17..20, got {self.opset}")


@dataclass(frozen=True)
class CalibrateConfig:
    """``vlmbatch calibrate``: per yes/no question, the threshold meeting one target."""
    results: Path  # a results JSONL file or a job folder
    labels: Path  # a labels JSONL file or a manifest with `expected` on its questions
    precision: float | None = None
    recall: float | None = None
    max_fpr: float | None = None
    f1: bool = False
    plots: Path | None = None  # a folder for pr.png and roc.png
    write_policy: Path | None = None
    json: bool = False

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
    job: Path
    out: Path
    borderline: int = 8  # thumbnails per question
    thumb_size: int = 128  # pixels, the longer side

    def __post_init__(self) -> None:
        if self.borderline < 0 or not 16 <= self.thumb_size <= 512:
            raise ConfigError("--borderline must be >= 0 and --thumb-size in 16..512")
        if self.out.suffix.lower() not in (".html", ".htm"):
            raise ConfigError(f"-o {self.out}: give an .html file")
