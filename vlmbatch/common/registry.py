"""Name -> implementation registries (engines, vision runners, model families).

Each registry is a module-level ``Registry`` in the package that owns the interface; an
implementation registers itself where it is defined (``@ENGINES.register("torch")``), and
the package's ``__init__`` imports its implementations so that importing the package fills
the registry. The CLI's ``choices`` and the error for an unknown name both read ``names()``,
so a choice list is written once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar, cast

T = TypeVar("T")
S = TypeVar("S")


class UnknownName(KeyError):
    """No implementation registered under that name; the message lists the ones there are."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind  # "engine", "vision runner", ... (for messages)
        self._items: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[S], S]:
        """Decorator: register the object under each of ``names``; it is returned with its own
        type (a ``T``, which the registry does not check at run time)."""
        def add(obj: S) -> S:
            for name in names:
                if name in self._items:
                    raise ValueError(f"{self.kind} {name!r} is registered twice")
                self._items[name] = cast(T, obj)
            return obj
        return add

    def get(self, name: str) -> T:
        if name not in self._items:
            raise UnknownName(f"unknown {self.kind} {name!r}; one of: {', '.join(self.names())}")
        return self._items[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
