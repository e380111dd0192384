"""Name -> implementation registries (engines, vision runners, model families, commands).

Each registry is a module-level ``Registry`` in a light module of the package that owns the
interface, built with its table of ``"module:attr"`` strings: listing the names (the CLI's
``choices``, the error for an unknown name) imports no implementation, and ``get`` imports
the named module on first use. ``register`` adds an object itself (a test's fake, a plugin).

Invariant: ``names()`` is every entry, in the order given, whether imported yet or not.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

T = TypeVar("T")
S = TypeVar("S")


class UnknownName(KeyError):
    """No implementation registered under that name; the message lists the ones there are."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Lazy:
    """An entry not imported yet: attribute ``attr`` of module ``module``."""
    module: str
    attr: str

    @classmethod
    def parse(cls, target: str) -> Lazy:
        module, sep, attr = target.partition(":")
        if not (sep and module and attr) or ":" in attr:
            raise ValueError(f"{target!r} is not a 'module:attr' string")
        return cls(module, attr)

    def load(self) -> object:
        return getattr(importlib.import_module(self.module), self.attr)


class Registry(Generic[T]):
    def __init__(self, kind: str, lazy: Mapping[str, str] | None = None) -> None:
        """``lazy``: name -> ``"module:attr"``, imported when ``get`` first asks for it."""
        self.kind = kind  # "engine", "vision runner", ... (for messages)
        self._items: dict[str, T | Lazy] = {}
        for name, target in (lazy or {}).items():
            self._add(name, Lazy.parse(target))

    def _add(self, name: str, entry: T | Lazy) -> None:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._items[name] = entry

    def register(self, *names: str) -> Callable[[S], S]:
        """Decorator: register the object under each of ``names``; it is returned with its own
        type (a ``T``, which the registry does not check at run time)."""
        def add(obj: S) -> S:
            for name in names:
                self._add(name, cast(T, obj))
            return obj
        return add

    def get(self, name: str) -> T:
        """The entry ``name``; a lazy one is the module's attribute as it is now (its module
        imported on the first call; later calls are a lookup in ``sys.modules``)."""
        if name not in self._items:
            raise UnknownName(f"unknown {self.kind} {name!r}; one of: {', '.join(self.names())}")
        entry = self._items[name]
        return cast(T, entry.load()) if isinstance(entry, Lazy) else entry

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
