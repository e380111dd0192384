"""Command-line options declared on the config fields they fill.

A field of a frozen config dataclass carries its option in its metadata::

    cache_bytes: int = field(default=1 << 30, metadata=opt(
        "--cache-mib", unit=MIB, help="KV cache budget in MiB ... (default %(default)s)"))

``cli/args.py`` derives each command's parser from its config roots: every declared field
of a root and of its sub-configs (walked recursively) is one argument, and ``build`` makes
the root from what the command line typed. An option is declared once: a field of another
root that takes the same option says so with ``reuse(Cls, "field", default)`` (the same
``Option`` object), so its flags, help and parsing cannot drift apart.

Invariants: an ``Option`` is compared by identity (one declaration); what a parser puts in
its namespace is only what was typed, under ``Option.key``; ``build`` takes every other
field from its default (or from the sub-config instance a root's field defaults to), and
each config's ``__post_init__`` checks the result, whichever way it was made. Light: no
import beyond the standard library.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any, TypeVar

C = TypeVar("C")
OPTION = "vlmbatch.option"  # a field's metadata key: its Option
# a field's metadata key: a setting used before the job exists, left out of job.json (which
# then reads as it did before the setting existed, in this version and earlier ones)
NOT_STORED = "not_stored"
SHOWN = "vlmbatch.shown"  # ... how its default reads in the help, where not ``show(default)``
HIDDEN = "vlmbatch.hidden"  # ... accepted but not listed (kept for old command lines)
# what a parse function raises for text it refuses: the parser prints the message as it is
BadValue = argparse.ArgumentTypeError


def positive_int(text: str, least: int = 1) -> int:
    """argparse type: an integer >= 1 (>= ``least``)."""
    try:
        v = int(text)
    except ValueError:
        raise BadValue(f"not an integer: {text!r}") from None
    if v < least:
        raise BadValue(f"must be >= {least}, got {v}")
    return v


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return positive_int(text, least=0)


def probability(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise BadValue(f"not a number: {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise BadValue(f"must be in [0, 1], got {v}")
    return v


def words(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated words (empty ones dropped)."""
    return tuple(w for w in text.split(",") if w)


def _show_words(v: tuple[str, ...]) -> str:
    return ",".join(v)


@dataclass(frozen=True)
class Unit:
    """How an option's text becomes its field's value (``parse``) and the field's default
    reads in the help (``show``), with the metavar naming the unit typed: ``--cache-mib MIB``
    fills ``cache_bytes`` with MIB << 20."""
    parse: Callable[[str], Any]
    show: Callable[[Any], str]
    metavar: str


MIB = Unit(lambda t: non_negative_int(t) << 20, lambda b: str(b >> 20), "MIB")  # bytes
MS = Unit(lambda t: float(t) / 1000, lambda s: f"{1000 * s:g}", "MS")  # seconds
SECONDS = Unit(float, str, "SECONDS")
WORDS = Unit(words, _show_words, "WORD,WORD")
N = Unit(positive_int, str, "N")  # a count >= 1
N0 = Unit(non_negative_int, str, "N")  # a count >= 0
COUNT = Unit(int, str, "N")  # an integer whose range the config checks (naming the option)


@dataclass(frozen=True, eq=False)  # eq=False: compared and hashed by identity
class Option:
    """One command-line option (or positional argument) and the field it fills.

    ``flags``: ``("--out", "-o")``; a positional: its name alone (``("manifest",)``).
    ``help``: ``%(default)s`` in it reads the field's default as ``show`` writes it.
    ``action``: ``store`` (a value), ``true``/``false`` (a switch storing that value: ``--f1``,
    ``--no-progress``), ``both`` (``--x`` / ``--no-x``), ``append`` (repeatable: a tuple of
    the values parsed). ``group``: the help section (None: the class's ``OPTION_GROUP``,
    else the command's own options). ``exclusive``: options of one name form a mutually
    exclusive group (required if any of them is)."""
    flags: tuple[str, ...]
    help: str
    parse: Callable[[str], Any] | None = None
    metavar: str | tuple[str, ...] | None = None
    choices: tuple[Any, ...] | None = None
    action: str = "store"
    nargs: str | int | None = None
    show: Callable[[Any], str] = str
    group: str | None = None
    required: bool = False
    exclusive: str | None = None

    @property
    def positional(self) -> bool:
        return not self.flags[0].startswith("-")

    @property
    def name(self) -> str:
        """How messages name it: its first long flag (``--out``), or a positional's name."""
        return next((f for f in self.flags if f.startswith("--")), self.flags[0])

    @property
    def key(self) -> str:
        """The namespace attribute a parser stores what was typed under."""
        return self.name.lstrip("-").replace("-", "_")


def opt(*flags: str, help: str, unit: Unit | None = None, **kw: Any) -> dict[str, Option]:
    """A field's ``metadata`` declaring its option (``Option``'s fields as keywords; ``unit``
    sets ``parse``, ``show`` and ``metavar`` at once)."""
    if unit is not None:
        kw = {"parse": unit.parse, "show": unit.show, "metavar": unit.metavar, **kw}
    return {OPTION: Option(tuple(flags), help, **kw)}


def option_of(cls: type, name: str) -> Option:
    """The option declared on field ``name`` of config dataclass ``cls``."""
    f = next(f for f in fields(cls) if f.name == name)  # type: ignore[arg-type]
    return f.metadata[OPTION]


def reuse(cls: type, name: str, default: Any = MISSING, *, shown: str | None = None,
          hidden: bool = False) -> Any:
    """A field taking the option declared on ``cls.name`` (the same declaration), with its
    own default; ``shown``: how that default reads in the help; ``hidden``: accepted, not
    listed."""
    meta: dict[str, Any] = {OPTION: option_of(cls, name)}
    if shown is not None:
        meta[SHOWN] = shown
    if hidden:
        meta[HIDDEN] = True
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Declared:
    """A declared field reached from a config root: its dotted path (``engine.cache_bytes``),
    its option, its default as the help reads it, and whether the help lists it."""
    path: str
    option: Option
    default: str
    hidden: bool
    group: str | None  # the help section: the option's, else its class's OPTION_GROUP


def declared(cls: type, base: Any = None, prefix: str = "") -> Iterator[Declared]:
    """Every declared field of config dataclass ``cls`` and of its sub-configs, in field
    order (a sub-config's where the field holding it is); ``base``: the instance defaults
    are read from (a root's sub-config field may default to a particular one)."""
    subs = sub_configs(cls)
    for f in fields(cls):  # type: ignore[arg-type]
        default = _default(f, base)
        o = f.metadata.get(OPTION)
        if o is not None:
            shown = f.metadata.get(SHOWN)
            text = shown if shown is not None else (
                "" if default is MISSING else o.show(default))
            yield Declared(prefix + f.name, o, text, bool(f.metadata.get(HIDDEN)),
                           o.group or getattr(cls, "OPTION_GROUP", None))
        elif (sub := subs.get(f.name)) is not None:
            yield from declared(sub, None if default is MISSING else default,
                                f"{prefix}{f.name}.")


def build(cls: type[C], typed: Mapping[str, Any], base: Any = None, **given: Any) -> C:
    """``cls`` from what a command line typed (``Option.key`` -> value): each declared field
    from the value typed for its option, a sub-config built the same way, every other field
    from ``base`` (an instance of ``cls``) or its default; ``given`` (field name -> value)
    overrides at the top level. Lists become tuples (the configs' sequences)."""
    subs = sub_configs(typing.cast(type, cls))
    kwargs: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        o = f.metadata.get(OPTION)
        if f.name in given:
            kwargs[f.name] = given[f.name]
        elif o is not None and o.key in typed:
            v = typed[o.key]
            kwargs[f.name] = tuple(v) if isinstance(v, list) else v
        elif o is None and (sub := subs.get(f.name)) is not None:
            sub_base = _default(f, base)
            kwargs[f.name] = build(sub, typed, None if sub_base is MISSING else sub_base)
        elif base is not None:
            kwargs[f.name] = getattr(base, f.name)
    return cls(**kwargs)


def _default(f: dataclasses.Field, base: Any) -> Any:
    if base is not None:
        return getattr(base, f.name)
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


@functools.cache
def sub_configs(cls: type) -> dict[str, type]:
    """Field name -> the config dataclass it holds, for each field of ``cls`` that holds one
    (its annotations resolved once per class)."""
    hints = typing.get_type_hints(cls)
    return {f.name: sub for f in fields(cls)  # type: ignore[arg-type]
            if (sub := config_type(hints[f.name])) is not None}


def config_type(tp: Any) -> type | None:
    """The config dataclass a field's type names (``X`` or ``X | None``), else None."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else None
    return tp if isinstance(tp, type) and is_dataclass(tp) else None


def non_default(cfg: Any) -> list[str]:
    """The options (their names) of ``cfg``'s declared fields that differ from the class's
    defaults: what a check naming "options that do not apply" names."""
    return [o.name for f in fields(cfg)
            if (o := f.metadata.get(OPTION)) is not None and f.default is not MISSING
            and getattr(cfg, f.name) != f.default]
