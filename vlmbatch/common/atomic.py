"""Outputs written whole or not at all: a file or folder is built under a temporary name
beside its destination and renamed onto it only when complete, so an interrupted command
(Ctrl-C, SIGTERM, a full disk, an error) leaves the destination as it was.

Used by what can simply be run again: ``vlmbatch results -o`` (``outputs/export.py``),
``quantize`` (``cli/quantize.py``) and ``export-vit`` (``vit_trt/export.py``). Not by
``run``'s streamed output, whose lines written so far are the point of streaming.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replaced_on_success(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write a whole file or folder to; renamed onto
    ``path`` when the block ends normally (an existing empty folder there is replaced),
    deleted on any exception. The rename is atomic on one file system."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    # one left by a killed process that had this pid (a container restarted: pids repeat);
    # no live process but this one can own the name
    if part.is_dir() and not part.is_symlink():
        shutil.rmtree(part)
    else:
        part.unlink(missing_ok=True)
    try:
        yield part
        if part.is_dir() and path.is_dir() and not any(path.iterdir()):
            path.rmdir()  # rename() replaces a file, not a folder
        os.replace(part, path)
    finally:
        if part.is_dir() and not part.is_symlink():
            shutil.rmtree(part, ignore_errors=True)
        else:
            part.unlink(missing_ok=True)
