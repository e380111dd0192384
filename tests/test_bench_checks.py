"""A benchmark whose check fails exits 1 after printing its table, naming the check on stderr
(``bench/checks.py``); with a bound it meets it exits 0. ``bench/attention.py`` is the
cheapest benchmark with a check (a few seconds on 2 cores); ``bench/qpm.py``, ``serve.py``,
``embed.py``, ``prefetch.py``, ``store.py`` and ``tiling_accuracy.py`` share the same
``Checks``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def attention(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/attention.py", "--reps", "1", "--threads",
                           "1", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_failed_check_exits_1_after_its_table_and_says_why() -> None:
    ok = attention()
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "check: the two forms agree within 1e-05 on every shape: OK" in ok.stdout
    bad = attention("--check-tol", "-1")  # a bound no difference can meet
    assert bad.returncode == 1, bad.stderr[-2000:]
    assert "| decode 64 x 1 after 600 |" in bad.stdout  # the whole table came first
    assert "on every shape: FAILED" in bad.stdout
    failed = [ln for ln in bad.stderr.splitlines() if ln.startswith("attention.py: check FAILED")]
    assert len(failed) == 3 and "prefill 4 x 1024: enable_gqa = expanded K/V within -1" in \
        bad.stderr, bad.stderr
