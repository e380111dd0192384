"""Fault-injection hooks for tests (``pipeline.hooks.FaultHooks`` fields), and a way to hand
them to a CLI run in a subprocess: ``python -m tests.faults SPEC -- vlmbatch args...``
where SPEC is JSON naming the hooks, e.g. ``{"group_delay": 0.2}``.

The hooks are ``functools.partial``s of ``tests/fault_points.py``'s functions, so that they
pickle into decoder processes and Ray workers.
"""

from __future__ import annotations

import functools
import json
import sys

from tests import fault_points as fp
from vlmbatch.pipeline.hooks import FaultHooks


def hooks_from(spec: dict) -> FaultHooks:
    """``{"group_delay": s, "hang_on": text, "crash_on": text, "segfault_on": text,
    "note_node": [folder, s], "note_model": [folder, s], "kill_model_at": [n, marker],
    "slow_score": s, "pause_at": {WHERE: [n, marker]}}`` (any subset; one decoder fault, one
    model fault) as hooks.
    ``pause_at`` writes ``marker`` and waits at the n-th call of each named window:
    ``after_submit_line``, ``before_load`` (n unused), ``after_export_line``."""
    before_prepare = before_score = after_group = None
    if "group_delay" in spec:
        after_group = functools.partial(fp.sleep, float(spec["group_delay"]))
    for name, fn in (("hang_on", fp.hang_on), ("crash_on", fp.crash_on),
                     ("segfault_on", fp.segfault_on)):
        if name in spec:
            before_prepare = functools.partial(fn, str(spec[name]))
    if "note_node" in spec:
        folder, seconds = spec["note_node"]
        before_prepare = functools.partial(fp.note_node, str(folder), float(seconds))
    if "kill_model_at" in spec:
        n, marker = spec["kill_model_at"]
        before_score = functools.partial(fp.kill_model_at, int(n), str(marker))
    if "note_model" in spec:
        folder, seconds = spec["note_model"]
        before_score = functools.partial(fp.note_model, str(folder), float(seconds))
    if "slow_score" in spec:
        before_score = functools.partial(fp.sleep, float(spec["slow_score"]))
    windows = {}
    for where, (n, marker) in spec.get("pause_at", {}).items():  # a window for a signal
        windows[where] = (functools.partial(fp.pause, str(marker)) if where == "before_load"
                          else functools.partial(fp.pause_at, int(n), str(marker)))
    return FaultHooks(before_prepare, before_score, after_group, **windows)


if __name__ == "__main__":
    from vlmbatch.cli.main import main

    spec, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: python -m tests.faults SPEC -- ARGS..."
    sys.exit(main(argv, hooks=hooks_from(json.loads(spec))))
