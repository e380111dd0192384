"""The functions fault hooks call (``tests/faults.py`` binds them with ``functools.partial``).

Apart from ``tests/faults.py`` because some run in a decoder process, which imports no torch
(``preprocessing/decoder_process.py``): this module imports nothing of ours. Ray pickles them
into its workers too, which import them from the repo root.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path


def sleep(seconds: float, *_: object) -> None:
    time.sleep(seconds)


def hang_on(text: str, source: str) -> None:
    """Hang on a source containing ``text`` (or one of its ``|``-separated parts)."""
    if any(part in source for part in text.split("|")):
        time.sleep(10**6)  # a decoder stuck forever


def crash_on(text: str, source: str) -> None:
    if text in source:
        os._exit(11)  # as a decoder segfault would end the process


def segfault_on(text: str, source: str) -> None:
    if text in source:
        ctypes.string_at(0)  # a real SIGSEGV: reads address 0


def kill_model_at(n: int, marker: str, call: int) -> None:
    if call == n and not Path(marker).exists():
        Path(marker).write_text("killed once\n")
        os._exit(1)  # as if the process were killed mid-batch


def pause_at(n: int, marker: str, count: int) -> None:
    """At the ``n``-th call: write ``marker`` and wait there (a window for a signal)."""
    if count == n:
        Path(marker).write_text(f"{os.getpid()}\n")
        time.sleep(120)


def pause(marker: str) -> None:
    pause_at(1, marker, 1)


def note_node(folder: str, seconds: float, source: str) -> None:
    """Leave a file naming the node this runs on (``VLMBATCH_TEST_NODE`` of its raylet's
    environment, else "head") and the item, holding its network namespace (``net:[N]``),
    then take ``seconds``: a slow prepare task."""
    node = os.environ.get("VLMBATCH_TEST_NODE", "head")
    Path(folder, f"{node}-{os.getpid()}-{Path(source).name}").write_text(
        os.readlink("/proc/self/ns/net"))
    time.sleep(seconds)


def note_model(folder: str, seconds: float, call: int) -> None:
    """``note_node`` for a model actor's ``call``-th group: ``NODE-model-PID-CALL``."""
    note_node(folder, seconds, f"model-{call}")
