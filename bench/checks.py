"""What the benchmarks' checks share: each check's verdict is printed beside its measured value
(with the table, on stdout); after the table, every check that failed is named on stderr and
the script exits 1, so a script or CI running a benchmark sees the failure, not only a word
in its output (``bench/gpu_check.sh`` tables each step's exit code)."""

from __future__ import annotations

import sys
from pathlib import Path


class Checks:
    """The verdicts of one benchmark run; ``exit()`` once its table is printed."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def verdict(self, ok: bool, what: str) -> str:
        """Record the check ``what`` (a sentence with the bound and the measured value);
        returns the word to print beside it."""
        if not ok:
            self.failed.append(what)
        return "OK" if ok else "FAILED"

    def exit(self) -> None:
        """Exit 1 naming each failed check on stderr; return when all passed."""
        if not self.failed:
            return
        for what in self.failed:
            print(f"{Path(sys.argv[0]).name}: check FAILED: {what}", file=sys.stderr)
        raise SystemExit(1)
