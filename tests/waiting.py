"""The one way tests wait for something to happen: ``wait_until(predicate, timeout, what)``.

A test that polls writes the condition once, as a function returning a truthy value when it
holds; the deadline turns a hang into a failure that says what never happened, and the last
value seen (or the last error raised while polling) is in the message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class NeverHappened(AssertionError):
    """``what`` did not happen within the timeout."""


def wait_until(predicate: Callable[[], T], timeout: float, what: str,
               interval: float = 0.05, retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns a truthy value, and
    return that value. ``retry_on``: exceptions that mean "not yet" (a server still starting:
    ``ConnectionError``); any other exception propagates at once. Raises ``NeverHappened``
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            last = predicate()
        except retry_on as e:
            last = e
        else:
            if last:
                return last  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise NeverHappened(f"{what}: not within {timeout:g} s (last seen: {last!r})")
        time.sleep(interval)
