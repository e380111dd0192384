"""A 1,000,000-line job (slow: ``pytest --run-slow tests/jobs/test_scale.py -s``; not in CI).

2,000 generated tiny PNGs (32-48 px), each named by 500 lines; one question a line. Submit
in a subprocess (time, peak RSS, store size), then a run of ``VLMBATCH_SCALE_RUN_S``
seconds (default 60; ``VLMBATCH_SCALE_FULL=1``: to the end) while its process tree's RSS is
sampled and ``status`` is timed from this process every 2 s; then SIGTERM, and the store's
counts against a recount. The figures are printed, and bounded by the asserts below."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from bench.rss import tree_rss_mib
from tests.jobs.test_job import ROOT
from vlmbatch.jobs.folder import STORE_FILE, status
from vlmbatch.jobs.store import JobStore

N = 1_000_000


def manifest(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    for i in range(2000):
        h, w = (int(x) for x in rng.integers(32, 49, 2))
        cv2.imwrite(str(folder / f"{i}.png"), rng.integers(0, 60, (h, w, 3), dtype=np.uint8))
    with open(folder / "m.jsonl", "w") as f:
        for i in range(N):
            f.write(json.dumps({"id": f"img{i}", "image": f"{i % 2000}.png",
                                "questions": ["Is there a red shape?"]}) + "\n")
    return folder / "m.jsonl"


def vlmbatch(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vlmbatch", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_million_line_job(tmp_path: Path, random_model_dir: Path) -> None:
    m, job = manifest(tmp_path), tmp_path / "job"
    t0 = time.perf_counter()
    p = vlmbatch("submit", str(m), "--job", str(job), "--model", str(random_model_dir))
    submit_mib = 0.0
    while p.poll() is None:
        submit_mib = max(submit_mib, tree_rss_mib(p.pid))
        time.sleep(0.2)
    _, err = p.communicate()
    submit_s = time.perf_counter() - t0
    assert p.returncode == 0, err
    store_mib = (job / STORE_FILE).stat().st_size / 2**20

    run_s = float(os.environ.get("VLMBATCH_SCALE_RUN_S", "60"))
    full = os.environ.get("VLMBATCH_SCALE_FULL") == "1"
    p = vlmbatch("run", str(job), "--no-progress")
    t0, peak, status_s, next_status = time.perf_counter(), 0.0, [], 0.0
    while p.poll() is None and (full or time.perf_counter() - t0 < run_s):
        peak = max(peak, tree_rss_mib(p.pid))
        if time.perf_counter() >= next_status:
            t = time.perf_counter()
            status(job)
            status_s.append(time.perf_counter() - t)
            next_status = time.perf_counter() + 2
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    t = time.perf_counter()
    cli_status = subprocess.run([sys.executable, "-m", "vlmbatch", "status", str(job)],
                                cwd=ROOT, capture_output=True, text=True)
    cli_s = time.perf_counter() - t
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == (0 if full else 143), err[-2000:]
    st = status(job)
    store = JobStore(job / STORE_FILE)
    t = time.perf_counter()
    recount = dict(store.db.execute("SELECT state, COUNT(*) FROM items GROUP BY state"))
    recount_s = time.perf_counter() - t
    store.close()
    assert st.done + st.failed + st.pending == N and st.failed == 0
    assert recount.get("done", 0) == st.done and recount.get("pending", 0) == st.pending
    print(f"\n{N:,} lines: submit {submit_s:.1f}s, peak RSS {submit_mib:.0f} MiB, store "
          f"{store_mib:.0f} MiB; run {wall:.0f}s: {st.done:,} done ({st.qpm or 0:,.0f} QPM), "
          f"peak tree RSS {peak:.0f} MiB; status() max {max(status_s):.3f}s over "
          f"{len(status_s)} calls mid-run (a recount: {recount_s:.2f}s); `vlmbatch status` "
          f"{cli_s:.1f}s wall ({cli_status.stdout.strip()})")
    assert submit_mib < 512 and peak < 1024 and max(status_s) < 1.0
