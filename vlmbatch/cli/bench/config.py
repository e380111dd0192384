"""``vlmbatch bench``'s config root and its sweep: which images, how many questions, which
engine options are varied, how many rounds. Light (``--help`` imports it): no torch.

A sweep names a field of ``ModelConfig`` (``dtype``, ``quant``, ``max_tiles``, ...), of
``EngineConfig`` (``prefix_cache``, ``vit_backend``, ``max_batch_tokens``, ...) or
``images_per_batch``, by its field name or its option (``prefix-cache``), with the values
to try; each value is read as that field's option reads it (``on``/``off`` for a switch),
and every combination of the sweeps is one row, each checked by its config's
``__post_init__`` before any model loads.
"""

from __future__ import annotations

import dataclasses
import itertools
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from vlmbatch.common.options import OPTION, BadValue, N, Option, opt, reuse
from vlmbatch.engine.config import ConfigError, EngineConfig, ModelConfig
from vlmbatch.jobs.config import RunConfig

BASELINES = ("none", "transformers")
SWITCH = {"on": True, "off": False, "true": True, "false": False, "yes": True, "no": False,
          "1": True, "0": False}
# the sweepable configs: a sweep's field is looked up in them, in this order
SWEPT: tuple[tuple[str, type], ...] = (("model", ModelConfig), ("engine", EngineConfig))


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``"448x448,1344x896"`` -> ((448, 448), (1344, 896)) (width x height)."""
    out = []
    for part in text.split(","):
        w, sep, h = part.strip().lower().partition("x")
        if not (sep and w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0):
            raise BadValue(f"{part.strip()!r} is not WIDTHxHEIGHT (e.g. 448x448)")
        out.append((int(w), int(h)))
    return tuple(out)


def sweep_text(text: str) -> tuple[str, tuple[str, ...]]:
    """``"prefix_cache=on,off"`` -> ("prefix_cache", ("on", "off"))."""
    name, sep, values = text.partition("=")
    vals = tuple(v.strip() for v in values.split(",") if v.strip())
    if not sep or not name.strip() or not vals:
        raise BadValue(f"{text!r} is not FIELD=VALUE,VALUE (e.g. prefix_cache=on,off)")
    return name.strip().replace("-", "_"), vals


@dataclass(frozen=True)
class Sweep:
    """One swept field: where it lives (``model``, ``engine`` or ``run``: the bench's own
    ``images_per_batch``), its name, and its values as the field holds them."""
    where: str
    name: str
    values: tuple[Any, ...]


def _value(cls: type, f: dataclasses.Field, text: str) -> Any:
    """``text`` as field ``f``'s option reads it (a switch: on/off), else by its type."""
    o: Option | None = f.metadata.get(OPTION)
    if o is not None and o.parse is not None:
        return o.parse(text)
    tp = typing.get_type_hints(cls)[f.name]
    if tp is bool or (o is not None and o.action != "store"):
        if text.lower() not in SWITCH:
            raise BadValue(f"{text!r} is not on or off")
        return SWITCH[text.lower()]
    if "int" in str(tp) and text.lower() != "none":
        return int(text)
    return None if text.lower() == "none" and "None" in str(tp) else text


def make_sweep(name: str, texts: tuple[str, ...]) -> Sweep:
    """The sweep of field ``name`` (ConfigError naming the fields that can be swept, or the
    value that does not read)."""
    where_cls = (("run", RunConfig),) if name == "images_per_batch" else SWEPT
    for where, cls in where_cls:
        f = _field(cls, name)
        if f is None:
            continue
        values = []
        for t in texts:
            try:
                values.append(_value(cls, f, t))
            except (BadValue, ValueError) as e:
                why = str(e) if isinstance(e, BadValue) else f"{t!r} is not an integer"
                raise ConfigError(f"--sweep {name}: {why}") from None
        return Sweep(where, name, tuple(values))
    known = sorted(f.name for _, c in SWEPT for f in fields(c)) + ["images_per_batch"]
    raise ConfigError(f"--sweep {name}: not a model or engine field; one of {known}")


def _field(cls: type, name: str) -> Any:
    return next((f for f in fields(cls) if f.name == name), None)


@dataclass(frozen=True)
class BenchConfig:
    """``vlmbatch bench``: QPM of the engine on the user's model, device, dtype and images,
    for each combination of the sweeps (``variants``)."""
    images: Path | None = field(default=None, metadata=opt(
        "images", parse=Path, nargs="?", help="a manifest (JSONL) or a folder of images "
        "(default: generated shape scenes, --scene-sizes)"))
    policy: Path | None = reuse(RunConfig, "policy", None)
    count: int | None = field(default=None, metadata=opt(
        "--count", unit=N, help="images answered per round (default: 32 scenes; of a "
        "manifest or folder: all of it)"))
    questions: int = field(default=4, metadata=opt(
        "--questions", unit=N, metavar="K", help="yes/no questions per image: of a scene or a "
        "folder's image (without --policy), or the first K of a manifest line's (default "
        "%(default)s)"))
    scene_sizes: tuple[tuple[int, int], ...] = field(default=((448, 448), (896, 448)),
                                                     metadata=opt(
        "--scene-sizes", parse=parse_sizes, metavar="WxH,...", show=lambda v: ",".join(
            f"{w}x{h}" for w, h in v), help="sizes the generated scenes cycle through "
        "(default %(default)s)"))
    sweep: tuple[tuple[str, tuple[str, ...]], ...] = field(default=(), metadata=opt(
        "--sweep", parse=sweep_text, action="append", metavar="FIELD=V,V", help="vary a "
        "model or engine option (its field name: dtype, quant, vit_backend, prefix_cache, "
        "images_per_batch, max_batch_tokens, ...) over these values; repeat for more fields: "
        "one row per combination (e.g. --sweep images_per_batch=8,16 --sweep "
        "prefix_cache=on,off)"))
    rounds: int = field(default=2, metadata=opt(
        "--rounds", unit=N, help="timed rounds per row, interleaved across rows, best kept "
        "(after one untimed warm-up group per row) (default %(default)s)"))
    baseline: str = field(default="none", metadata=opt(
        "--baseline", choices=BASELINES, help="transformers: add the batched transformers "
        "row (left-padded prompts, each image encoded once; docs/bench.md) (default "
        "%(default)s)"))
    json_out: Path | None = field(default=None, metadata=opt(
        "--json", parse=Path, metavar="FILE", help="also write the rows, the machine, the "
        "versions and the options as JSON"))
    images_per_batch: int = reuse(RunConfig, "images_per_batch", 16)
    threads: int | None = reuse(RunConfig, "threads", None)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.images_per_batch < 1:
            raise ConfigError(f"--images-per-batch must be >= 1, got {self.images_per_batch}")
        if self.images is not None and not self.images.exists():
            raise ConfigError(f"{self.images} not found: give a manifest (JSONL) or a folder "
                              "of images, or leave it out for generated scenes")
        names = [n for n, _ in self.sweep]
        if len(set(names)) != len(names):
            raise ConfigError(f"--sweep names a field twice: {sorted(names)}")
        self.variants()  # every combination checked now, before any model loads

    @property
    def sweeps(self) -> tuple[Sweep, ...]:
        return tuple(make_sweep(n, v) for n, v in self.sweep)

    def variants(self) -> list[Variant]:
        """One per combination of the sweeps' values (one with none swept)."""
        sweeps = self.sweeps
        out = []
        for combo in itertools.product(*(s.values for s in sweeps)):
            by = {w: {s.name: v for s, v in zip(sweeps, combo) if s.where == w}
                  for w in ("model", "engine", "run")}
            try:
                out.append(Variant(
                    tuple((s.name, v) for s, v in zip(sweeps, combo)),
                    dataclasses.replace(self.model, **by["model"]),
                    dataclasses.replace(self.engine, **by["engine"]),
                    by["run"].get("images_per_batch", self.images_per_batch)))
            except (ConfigError, TypeError, ValueError) as e:
                raise ConfigError(f"--sweep: {e}") from None
        return out


@dataclass(frozen=True)
class Variant:
    """One row: the swept values it has, and the configs they make."""
    swept: tuple[tuple[str, Any], ...]
    model: ModelConfig
    engine: EngineConfig
    images_per_batch: int

    @property
    def name(self) -> str:
        return " ".join(f"{k}={_shown(v)}" for k, v in self.swept) or "default"


def _shown(v: Any) -> str:
    return {True: "on", False: "off"}.get(v, str(v)) if isinstance(v, bool) else str(v)
