"""``wait_until``: returns what the predicate returned once it holds, retries only the
exceptions it is told mean "not yet", and fails by name at its deadline."""

from __future__ import annotations

import time

import pytest

from tests.waiting import NeverHappened, wait_until


def test_returns_the_first_truthy_value() -> None:
    seen = iter([0, None, [], "ready"])
    assert wait_until(lambda: next(seen), 5, "ready", interval=0) == "ready"


def test_a_deadline_names_what_never_happened_and_the_last_value() -> None:
    start = time.monotonic()
    with pytest.raises(NeverHappened, match=r"the batch completes: not within 0.2 s "
                                            r"\(last seen: ''\)"):
        wait_until(lambda: "", 0.2, "the batch completes")
    assert time.monotonic() - start < 5


def test_only_the_named_exceptions_mean_not_yet() -> None:
    calls = []

    def flaky() -> bool:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not listening yet")
        return True

    assert wait_until(flaky, 5, "listening", interval=0, retry_on=(ConnectionError,))
    assert len(calls) == 3
    with pytest.raises(ValueError):
        wait_until(lambda: int("x"), 5, "never", retry_on=(ConnectionError,))
