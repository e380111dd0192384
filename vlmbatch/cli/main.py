"""``vlmbatch`` command line: parse (``args.py``: what was typed), dispatch to the command
(``commands.HANDLERS``: its module is imported only when it runs; it builds its config root
once), turn errors into one-line messages and exit codes. Everything imported here is light
(no torch, transformers, fastapi or OpenCV): ``--help``, ``COMMAND --help``, ``status``,
``cancel`` and ``results`` pay for nothing else (``tests/cli/test_startup.py``,
``bench/startup.py``).

Exit codes: 0 all answered; 3 finished but some items failed (their lines carry ``error``),
or a job was cancelled with items left; 2 bad input or model, or a job another process
is running (message on stderr, nothing run);
1 a file could not be read or written (message on stderr), or an unexpected failure;
130 interrupted (Ctrl-C), 143 terminated (SIGTERM): results written so far are kept, a job
is left resumable.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
from collections.abc import Iterator

from vlmbatch.cli.args import CommandLine, parse
from vlmbatch.cli.commands import (
    EXIT_BAD_INPUT,
    EXIT_CRASH,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    HANDLERS,
    typed_job,
)
from vlmbatch.engine.config import AnswerWordsError, ConfigError
from vlmbatch.jobs.folder import is_job
from vlmbatch.models.config_io import ModelError
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.questions import ManifestError

# OSErrors reported as a message even without a file name (disk full, quota, read-only...)
USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def _quiet_opencv() -> None:
    """OpenCV logs its own line for every undecodable image; each is already that item's
    ``error``, so the CLI silences OpenCV unless OPENCV_LOG_LEVEL asks otherwise. Called once
    the command's module is imported: a command that decodes images has OpenCV loaded by then
    (cv2 is imported at module level wherever it is used: the layer rule), the others never
    load it, and this does not either."""
    cv2 = sys.modules.get("cv2")
    if cv2 is not None and "OPENCV_LOG_LEVEL" not in os.environ:
        cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)


def main(argv: list[str] | None = None, hooks: FaultHooks = NO_HOOKS) -> int:
    """Run one command line; ``hooks``: fault injection for tests (none otherwise)."""
    line = parse(sys.argv[1:] if argv is None else argv)
    with _sigterm_as_interrupt():
        return _main(line, hooks)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's preemption, `kill`, `docker stop`), raised in the main thread
    so that a run ends as after Ctrl-C: the job marked interrupted, its lock freed, the
    output file closed on whole lines; exit 143. Ray's blocking calls turn any
    KeyboardInterrupt into a plain one, so what was received is also kept in ``SIGTERMS``."""


SIGTERMS: list[int] = []  # one entry per SIGTERM received by this process's CLI


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    SIGTERMS.clear()
    inherited = signal.getsignal(signal.SIGTERM)
    if (threading.current_thread() is not threading.main_thread()
            or inherited in (signal.SIG_IGN, None)):
        yield  # handlers can only be set in the main thread; an ignored SIGTERM stays so
        return

    def raise_terminated(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, previous)  # a second SIGTERM is not held up by cleanup
        SIGTERMS.append(signum)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(line: CommandLine, hooks: FaultHooks) -> int:
    try:
        command = HANDLERS.get(line.command)  # imports its module (model_commands: torch)
        _quiet_opencv()
        return command(line, hooks)
    except (ConfigError, ManifestError, ModelError, AnswerWordsError, ImportError) as e:
        print(f"vlmbatch: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # e.g. `vlmbatch run ... | head`
        sys.stderr.close()
        return EXIT_OK
    except OSError as e:  # a path that cannot be written, a full disk...
        if not e.filename and e.errno not in USER_ERRNOS:
            raise  # not about a file the user named: keep the traceback
        where = f"{e.filename}: " if e.filename else ""
        print(f"vlmbatch: error: {where}{e.strerror or e}", file=sys.stderr)
        return EXIT_CRASH
    except KeyboardInterrupt:
        return _interrupted(line)


def _interrupted(line: CommandLine) -> int:
    """After Ctrl-C or SIGTERM: say what was kept and how to go on; exit 130 or 143."""
    what = "terminated (SIGTERM)" if SIGTERMS else "interrupted"
    kept = "results written so far are kept"
    hint = ""
    command = line.command
    if command == "run" and typed_job(line) is None:
        hint = ("; the same command starts over: for work that resumes, `vlmbatch submit "
                "... --job DIR` then `vlmbatch resume DIR`")
    elif command == "submit" and not ((job := line.typed.get("job")) and is_job(job)):
        hint = "; no job was created"
    elif command in ("run", "submit", "resume"):
        hint = "; `vlmbatch resume JOB` continues the job"
    elif command in ("results", "quantize", "export-vit"):
        kept = ("--out is left as it was (written whole or not at all); run the command "
                "again")
    elif command == "eval":
        kept = "nothing was written"
    print(f"vlmbatch: {what}; {kept}{hint}", file=sys.stderr)
    return EXIT_TERMINATED if SIGTERMS else EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
