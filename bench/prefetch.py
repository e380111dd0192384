"""Prefetching benchmark: `vlmbatch run` with each group prepared in the main thread before
it is scored (``--preprocess-threads 0``) vs N preprocessing threads preparing the next groups
while the model scores the current one, side by side in one process.

Images: ``--images`` synthetic photos-like JPEGs (smooth noise and shapes, quality 90), half
1920x1080 and half 4000x3000 — large enough that decoding and tiling cost as much as the
built-in model. Every row answers the same manifest (2 questions per image) with the
built-in model; the rows' result lines must be identical (the script checks it: exit 1), and each
row's time is the best of ``--rounds`` interleaved rounds.

    python bench/prefetch.py                       # CPU: 0 vs 1 vs 2 threads
    python bench/prefetch.py --device cuda --dtype bfloat16 --threads-list 0,2,4,8

Not a test: timings on shared machines are noisy; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.checks import Checks  # noqa: E402
from vlmbatch.cli.run import run  # noqa: E402
from vlmbatch.engine.config import EngineConfig, ModelConfig
from vlmbatch.jobs.config import RunConfig  # noqa: E402
from vlmbatch.pipeline.config import PrepareConfig  # noqa: E402


def make_images(folder: Path, n: int) -> Path:
    """n JPEGs (half 1920x1080, half 4000x3000) and a manifest asking 2 questions of each."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        w, h = (1920, 1080) if i % 2 == 0 else (4000, 3000)
        small = rng.integers(0, 256, (h // 40, w // 40, 3), dtype=np.uint8)
        img = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
        for _ in range(3):
            centre = (int(rng.integers(0, w)), int(rng.integers(0, h)))
            colour = tuple(int(c) for c in rng.integers(0, 256, 3))
            cv2.circle(img, centre, int(rng.integers(h // 10, h // 3)), colour, -1)
        cv2.imwrite(str(folder / f"{i}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 90])
        lines.append({"id": f"img{i}", "image": f"{i}.jpg",
                      "questions": ["Is there a red shape?", "Is there a circle?"]})
    (folder / "m.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder / "m.jsonl"


def answer(manifest: Path, threads: int, args: argparse.Namespace) -> tuple[float, str]:
    cfg = RunConfig(manifest=manifest, images_per_batch=args.images_per_batch,
                    prepare=PrepareConfig(preprocess_threads=threads), progress=False,
                    model=ModelConfig(device=args.device, dtype=args.dtype),
                    engine=EngineConfig())
    out = io.StringIO()
    summary = run(cfg, out)  # its seconds: the answering loop, model loading excluded
    if summary.failed_images:  # generated images: none may fail
        raise SystemExit(f"{summary.failed_images} images failed: {out.getvalue()[:2000]}")
    return summary.seconds, out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--images-per-batch", type=int, default=8)
    ap.add_argument("--threads-list", default="0,1,2", help="preprocess threads per row")
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    rows = [int(t) for t in args.threads_list.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        manifest = make_images(Path(tmp), args.images)
        answer(manifest, rows[-1], args)  # warm-up: model load, first calls
        best: dict[int, float] = {}
        outputs: dict[int, str] = {}
        for _ in range(args.rounds):
            for t in rows:
                secs, out = answer(manifest, t, args)
                best[t] = min(best.get(t, secs), secs)
                outputs[t] = out
    same = len(set(outputs.values())) == 1
    q = 2 * args.images
    print(f"\n{args.images} JPEGs (1920x1080 and 4000x3000), {q} questions, built-in model, "
          f"{args.device} {args.dtype}, {args.torch_threads} torch threads, "
          f"{args.images_per_batch} images per group, best of {args.rounds} rounds "
          f"(seconds of the answering loop: model loading excluded)\n")
    print("| preprocess threads | seconds | QPM | vs 0 |")
    print("|---|---|---|---|")
    for t in rows:
        print(f"| {t} | {best[t]:.2f} | {60 * q / best[t]:,.0f} | {best[rows[0]] / best[t]:.2f}x |")
    checks = Checks()
    print(f"\ncheck: result lines identical across rows: "
          f"{checks.verdict(same, 'result lines identical across rows (preprocess threads)')}")
    checks.exit()


if __name__ == "__main__":
    main()
