"""A benchmark whose check fails exits 1 after printing its table, naming the check on stderr
(``bench/checks.py``); with a bound it meets it exits 0. ``bench/attention.py`` is the
cheapest benchmark with a check (a few seconds on 2 cores); ``bench/qpm.py``, ``serve.py``,
``embed.py``, ``prefetch.py``, ``store.py`` and ``tiling_accuracy.py`` share the same
``Checks``; ``bench/video.py --quick`` is run here too, once as it is and once with a fault
injected (a clip's frames reversed on the transformers side)."""

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


def video(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/video.py", "--quick", "--threads", "1",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_video_bench_runs_small_and_its_agreement_check_catches_reversed_frames() -> None:
    """``bench/video.py --quick`` (1 clip, 4 frames, 2 questions, both built-in models) runs
    every section but decoding and passes its checks; with the clip's frames reversed on the
    transformers side its P(yes)/margin agreement check fails, naming the model."""
    ok = video()
    assert ok.returncode == 0, ok.stderr[-2000:]
    for name in ("internvl", "qwen2.5-vl"):
        assert f"[3] windows, {name}" in ok.stdout
    assert ok.stdout.count("  OK\n") == 2  # the agreement rows, one per model
    assert ok.stdout.count("distinct 8; without the cache 12: OK") == 1  # InternVL: frames
    assert ok.stdout.count("distinct 4; without the cache 6: OK") == 1  # Qwen: 2-frame groups
    bad = video("--fault", "reverse-frames")
    assert bad.returncode == 1, bad.stderr[-2000:]
    failed = [ln for ln in bad.stderr.splitlines() if ln.startswith("video.py: check FAILED")]
    assert len(failed) == 2, bad.stderr[-2000:]
    assert "internvl, 4 frames: ours = batched transformers within 0.0001" in failed[0]
    assert "qwen2.5-vl, 4 frames" in failed[1]
