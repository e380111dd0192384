"""Child interpreters that import the same ``vlmbatch`` as this process, whatever the
working directory.

``python -m pkg.mod`` puts the working directory first on ``sys.path``: started from a
folder that holds another ``vlmbatch/`` (a clone's root), a child would import that one while
its parent runs the installed one, and the two disagree on paths (the built-in models'),
records and protocols. Every child we start (the server's engine processes, the decoder
processes, Ray's workers) is therefore started here:

- ``python_module(module, *args)``: ``python -P -m module args`` (``-P``: no working
  directory on ``sys.path``), with ``child_env()``: ``PYTHONPATH`` = the folder holding this
  ``vlmbatch/`` first, then this process's own ``sys.path``;
- Ray's workers cannot be started so (Ray puts the driver's working directory first on a
  worker's ``sys.path`` when it runs its first task): ``RAY_SETUP_HOOK`` names this module
  as their ``worker_process_setup_hook``, run before any task, so ``vlmbatch`` is imported
  from ``PYTHONPATH`` (``ROOT`` first) and later imports of its modules go through that
  package, not ``sys.path``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding this vlmbatch/
RAY_SETUP_HOOK = "vlmbatch.common.children.pinned"


def search_path() -> str:
    """``PYTHONPATH`` for a child: ``ROOT``, then this process's ``sys.path`` (absolute,
    without the empty entry that stands for the working directory)."""
    entries = [ROOT, *(os.path.abspath(p) for p in sys.path if p)]
    return os.pathsep.join(dict.fromkeys(entries))


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with ``PYTHONPATH`` = ``search_path()`` (and ``extra``)."""
    return {**os.environ, "PYTHONPATH": search_path(), **extra}


def python_module(module: str, *args: str) -> list[str]:
    """The command that runs ``module`` as ``__main__`` in a fresh interpreter, the working
    directory kept off its ``sys.path`` (run it with ``child_env()``)."""
    return [sys.executable, "-P", "-m", module, *args]


def pinned() -> None:
    """Ray's ``worker_process_setup_hook``: importing this module (by name, from the
    worker's ``PYTHONPATH``) has imported ``vlmbatch`` from ``ROOT``; nothing else to do."""
