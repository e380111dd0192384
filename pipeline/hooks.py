"""Fault-injection points, passed in (never read from the environment): tests hand a
``FaultHooks`` to the runners to make a decoder hang or crash, a model worker die, or a run
slow enough to interrupt deterministically; production passes none. Hooks cross process
boundaries (Ray tasks and actors), so they must be picklable: module-level functions or
``functools.partial`` of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.records import ImageItem


@dataclass(frozen=True)
class FaultHooks:
    # before an item is prepared (in a Ray prepare task), e.g. to hang or to kill the worker
    before_prepare: Callable[[ImageItem], None] | None = None
    # before a model worker's n-th scoring call (1-based; Ray model actors)
    before_score: Callable[[int], None] | None = None
    # after each group is answered and recorded (in-process runs and jobs)
    after_group: Callable[[], None] | None = None

    def prepare(self, item: ImageItem) -> None:
        if self.before_prepare is not None:
            self.before_prepare(item)

    def score(self, call: int) -> None:
        if self.before_score is not None:
            self.before_score(call)

    def group_done(self) -> None:
        if self.after_group is not None:
            self.after_group()


NO_HOOKS = FaultHooks()
