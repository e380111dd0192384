"""Fault-injection hooks for tests (``pipeline.hooks.FaultHooks`` fields), and a way to hand
them to a CLI run in a subprocess: ``python -m tests.faults SPEC -- vlmbatch args...``
where SPEC is JSON naming the hooks, e.g. ``{"group_delay": 0.2}``.

Module-level functions (through ``functools.partial``) so that Ray can pickle them into its
workers, which import this module from the repo root.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

from pipeline.hooks import FaultHooks
from pipeline.records import ImageItem


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _hang_on(text: str, item: ImageItem) -> None:
    if isinstance(item.image, str) and text in item.image:
        time.sleep(10**6)  # a decoder stuck forever


def _crash_on(text: str, item: ImageItem) -> None:
    if isinstance(item.image, str) and text in item.image:
        os._exit(11)  # as a decoder segfault would end the process


def _kill_model_at(n: int, marker: str, call: int) -> None:
    if call == n and not Path(marker).exists():
        Path(marker).write_text("killed once\n")
        os._exit(1)  # as if the process were killed mid-batch


def _slow_score(seconds: float, call: int) -> None:
    time.sleep(seconds)


def hooks_from(spec: dict) -> FaultHooks:
    """``{"group_delay": s, "hang_on": text, "crash_on": text, "kill_model_at": [n, marker],
    "slow_score": s}`` (any subset) as hooks."""
    before_prepare = before_score = after_group = None
    if "group_delay" in spec:
        after_group = functools.partial(_sleep, float(spec["group_delay"]))
    if "hang_on" in spec:
        before_prepare = functools.partial(_hang_on, spec["hang_on"])
    if "crash_on" in spec:
        before_prepare = functools.partial(_crash_on, spec["crash_on"])
    if "kill_model_at" in spec:
        n, marker = spec["kill_model_at"]
        before_score = functools.partial(_kill_model_at, int(n), str(marker))
    if "slow_score" in spec:
        before_score = functools.partial(_slow_score, float(spec["slow_score"]))
    return FaultHooks(before_prepare, before_score, after_group)


if __name__ == "__main__":
    from vlmbatch.cli import main

    spec, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: python -m tests.faults SPEC -- ARGS..."
    sys.exit(main(argv, hooks=hooks_from(json.loads(spec))))
