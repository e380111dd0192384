"""Profiling of every thread of every process of a run, for ``bench/serve.py --profile DIR``:
this folder is put first on ``PYTHONPATH``, so each interpreter started with it (the server,
its engine processes: they inherit the path, ``common/children.py``) imports this
module at start-up. With ``VLMBATCH_BENCH_PROFILE=DIR`` set, every thread runs under its own
``cProfile.Profile`` (the main thread's from now, the others' from their start), and at exit
the process writes them merged to ``DIR/<pid>.prof`` (``pstats``), with its command line in
``DIR/<pid>.cmd``; SIGUSR1 clears the counts so far (the bench sends it when its measured
window starts). Call counts are what to read: they do not depend on the machine's load."""

from __future__ import annotations

import atexit
import cProfile
import os
import pstats
import signal
import sys
import threading
from pathlib import Path

OUT = os.environ.get("VLMBATCH_BENCH_PROFILE")
_profiles: list[cProfile.Profile] = []


def _start(frame: object, event: str, arg: object) -> None:
    sys.setprofile(None)
    p = cProfile.Profile()
    _profiles.append(p)
    p.enable()


def _dump() -> None:
    assert OUT is not None
    main = _profiles[0]
    main.disable()
    stats: pstats.Stats | None = None
    for p in _profiles[1:] + [main]:
        try:
            stats = pstats.Stats(p) if stats is None else stats.add(p)  # type: ignore[arg-type]
        except (TypeError, ValueError):  # a thread that never ran profiled code
            continue
    if stats is not None:
        stats.dump_stats(str(Path(OUT) / f"{os.getpid()}.prof"))
        (Path(OUT) / f"{os.getpid()}.cmd").write_text(" ".join(sys.argv))


def _clear(signum: int, frame: object) -> None:
    """SIGUSR1: forget what was counted so far (the bench's measured window starts)."""
    for p in _profiles:
        p.clear()


if OUT:
    Path(OUT).mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGUSR1, _clear)
    threading.setprofile(_start)
    _profiles.append(cProfile.Profile())
    _profiles[0].enable()
    atexit.register(_dump)
