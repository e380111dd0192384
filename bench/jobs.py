"""Jobs benchmark: the same job in-process vs on Ray (1 and 2 preprocessing workers), and
peak memory of a large job.

Generates ``--items`` distinct tiny PNG images (a disc on noise, 48-96 px a side) and a
manifest asking ``--questions`` questions of each, submits one job per row and runs it with
``vlmbatch run JOB`` in a subprocess: in-process with decoder processes (the default) and
with threads (``--decode-timeout 0``, no isolation), and on Ray. For each: wall time
(start-up included), the job's own QPM (from its store: first to last recorded group,
start-up excluded), and the peak RSS of the whole process tree (driver, decoder processes,
Ray's processes), sampled from /proc every 0.2 s.

    python bench/jobs.py --items 2000                  # QPM: in-process vs Ray
    python bench/jobs.py --items 2000 --rows local,threads --rounds 3   # decoder isolation
    python bench/jobs.py --items 100000 --questions 1 --min-size 32 --max-size 48 --rss-only

Not a test: timings on shared machines are noisy; compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.rss import tree_rss_mib  # noqa: E402


def make_images(folder: Path, n: int, questions: int, sizes: tuple[int, int]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    qs = ["Is there a red shape?", "Is there a circle?", "Is there a blue shape?",
          "Is there a triangle?"][:questions]
    with open(folder / "manifest.jsonl", "w") as f:
        for i in range(n):
            h, w = int(rng.integers(*sizes)), int(rng.integers(*sizes))
            img = rng.integers(0, 60, (h, w, 3), dtype=np.uint8)
            color = tuple(int(c) for c in rng.integers(0, 256, 3))
            cv2.circle(img, (w // 2, h // 2), min(h, w) // 3, color, -1)
            cv2.imwrite(str(folder / f"{i}.png"), img)
            f.write(json.dumps({"id": f"img{i}", "image": f"{i}.png", "questions": qs}) + "\n")
    return folder / "manifest.jsonl"


def run(job: Path, extra: list[str], threads: int) -> tuple[float, float]:
    """(wall seconds, peak tree RSS MiB) of `vlmbatch run JOB extra...`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "vlmbatch", "run", str(job), "--no-progress",
                          *extra], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    peak = [0.0]

    def sample() -> None:
        while p.poll() is None:
            peak[0] = max(peak[0], tree_rss_mib(p.pid))
            time.sleep(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, err = p.communicate()
    th.join()
    if p.returncode not in (0, 3):
        raise SystemExit(f"run failed ({p.returncode}): {err[-2000:]}")
    return time.perf_counter() - t0, peak[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--questions", type=int, default=2)
    ap.add_argument("--min-size", type=int, default=48, help="image side, pixels")
    ap.add_argument("--max-size", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the model")
    ap.add_argument("--cache-mib", type=int, default=64, help="prefix-cache budget")
    ap.add_argument("--work", type=Path, default=Path("/tmp/vlmbatch-bench-jobs"))
    ap.add_argument("--rss-only", action="store_true",
                    help="one in-process and one Ray (2 workers) run, for peak memory")
    ap.add_argument("--rows", default="local,threads,ray1,ray2",
                    help="which rows, of local, threads, ray1, ray2")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds over the rows, interleaved; the best of each row is shown")
    args = ap.parse_args()

    t0 = time.perf_counter()
    manifest = make_images(args.work / f"data{args.items}_{args.min_size}_{args.max_size}",
                           args.items, args.questions, (args.min_size, args.max_size + 1))
    print(f"generated {args.items} images in {time.perf_counter() - t0:.0f}s", flush=True)
    rows = {"local": ("in-process, decoder processes (default)", ["--executor", "local"]),
            "threads": ("in-process, threads (--decode-timeout 0)",
                        ["--executor", "local", "--decode-timeout", "0"]),
            "ray1": ("ray, 1 preprocessing worker",
                     ["--executor", "ray", "--preprocess-workers", "1"]),
            "ray2": ("ray, 2 preprocessing workers",
                     ["--executor", "ray", "--preprocess-workers", "2"])}
    keys = ["local", "ray2"] if args.rss_only else args.rows.split(",")
    print(f"\n{args.items} images x {args.questions} questions, built-in model, "
          f"{args.threads} model thread(s), prefix cache {args.cache_mib} MiB, "
          f"best of {args.rounds} interleaved round(s)\n")
    best: dict[str, tuple[float, float, float]] = {}  # key -> (wall, qpm, peak RSS)
    for r in range(args.rounds):
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:  # order rotated per round
            wall, qpm, peak = one_row(args, manifest, k, rows[k][1])
            old = best.get(k, (float("inf"), 0.0, 0.0))
            best[k] = (min(old[0], wall), max(old[1], qpm), max(old[2], peak))
            print(f"  round {r + 1} {k}: {wall:.1f}s, {qpm:,.0f} QPM", flush=True)
    base = best.get("threads", best[keys[0]])
    print("\n| executor | wall (start-up incl.) | job QPM (store) | wall vs threads | "
          "QPM vs threads | peak RSS, process tree |\n|---|---|---|---|---|---|")
    for k in keys:
        wall, qpm, peak = best[k]
        print(f"| {rows[k][0]} | {wall:.1f}s | {qpm:,.0f} | {wall / base[0]:.2f}x | "
              f"{qpm / base[1]:.2f}x | {peak:,.0f} MiB |")


def one_row(args: argparse.Namespace, manifest: Path, key: str,
            extra: list[str]) -> tuple[float, float, float]:
    """(wall, job QPM, peak tree RSS) of a fresh job over ``manifest`` run with ``extra``."""
    import shutil

    from vlmbatch.engine.config import EngineConfig, ModelConfig
    from vlmbatch.jobs.config import RunConfig
    from vlmbatch.jobs.folder import status
    from vlmbatch.jobs.job import submit

    job = args.work / f"job{args.items}_{key}"
    if job.exists():
        shutil.rmtree(job)
    cfg = RunConfig(manifest=manifest, images=None, policy=None, out=None,
                    images_per_batch=16, threads=args.threads, progress=False,
                    model=ModelConfig(), engine=EngineConfig(cache_bytes=args.cache_mib << 20))
    submit(cfg, job)
    wall, peak = run(job, extra + (["--model-cpus", str(args.threads)]
                                   if "ray" in extra else []), args.threads)
    return wall, status(job).qpm or 0.0, peak


if __name__ == "__main__":
    main()
