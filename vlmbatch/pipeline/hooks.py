"""Fault-injection points, passed in (never read from the environment): tests hand a
``FaultHooks`` to the runners to make a decoder hang or crash, a model worker die, or a run
slow enough to interrupt deterministically; production passes none. Hooks cross process
boundaries (decoder processes, Ray tasks and actors), so they must be picklable:
module-level functions or ``functools.partial`` of them; ``before_prepare`` runs in a
decoder process, which imports no torch, so its function's module must not either
(``tests/fault_points.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Named(Protocol):
    """An item or image as messages name it: its path or URL, else ``image ID``."""

    @property
    def source(self) -> str: ...


@dataclass(frozen=True)
class FaultHooks:
    # before an item is read and decoded, where that happens (a decoder process, a Ray
    # prepare task, a preprocessing thread), with the item's source (path or URL): e.g. to
    # hang or to end the process
    before_prepare: Callable[[str], None] | None = None
    # before a model worker's n-th scoring call (1-based; Ray model actors)
    before_score: Callable[[int], None] | None = None
    # after each group is answered and recorded (in-process runs and jobs)
    after_group: Callable[[], None] | None = None
    # windows for a signal, in the main thread: after the n-th manifest line is read into a
    # new job's store (submit; 1-based), just before a run loads its model (in-process runs
    # and jobs; on Ray before the model actors are made), after the n-th result line is
    # written by `vlmbatch results` (1-based)
    after_submit_line: Callable[[int], None] | None = None
    before_load: Callable[[], None] | None = None
    after_export_line: Callable[[int], None] | None = None

    def prepare(self, item: Named) -> None:
        if self.before_prepare is not None:
            self.before_prepare(item.source)

    def score(self, call: int) -> None:
        if self.before_score is not None:
            self.before_score(call)

    def group_done(self) -> None:
        if self.after_group is not None:
            self.after_group()

    def submitted(self, line: int) -> None:
        if self.after_submit_line is not None:
            self.after_submit_line(line)

    def loading(self) -> None:
        if self.before_load is not None:
            self.before_load()

    def exported(self, line: int) -> None:
        if self.after_export_line is not None:
            self.after_export_line(line)


NO_HOOKS = FaultHooks()
