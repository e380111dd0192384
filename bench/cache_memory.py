"""Prefix-cache memory benchmark: resident memory of the torch engine over many distinct
images, against what the cache holds.

Scores ``--images`` generated images (a disc on noise, 32-48 px, one question each) in
groups of 16 with a ``--cache-mib`` budget, one torch thread, and prints the process's RSS,
the cache's bytes and blocks every ``--every`` groups. Once the cache is full its bytes stop
growing; RSS should stop too, at about the cacheless size plus the budget. ``--trim`` calls
glibc's ``malloc_trim(0)`` after each group: RSS that it gives back was heap the allocator
kept, not memory in use.

    python bench/cache_memory.py --images 8000 --cache-mib 64
    python bench/cache_memory.py --images 8000 --cache-mib 64 --trim

Not a test; memory, not time, so one run suffices (RSS varies by a few MiB between runs).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmbatch.engine.build import build_engine  # noqa: E402
from vlmbatch.engine.config import EngineConfig, ModelConfig  # noqa: E402
from vlmbatch.engine.records import Request  # noqa: E402
from vlmbatch.preprocessing.prepare import prepare  # noqa: E402


def rss_mib() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024


def image(rng: np.random.Generator) -> np.ndarray:
    h, w = (int(x) for x in rng.integers(32, 48, 2))
    img = rng.integers(0, 60, (h, w, 3), dtype=np.uint8)
    cv2.circle(img, (w // 2, h // 2), min(h, w) // 3,
               tuple(int(c) for c in rng.integers(0, 256, 3)), -1)
    return img


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=8000)
    ap.add_argument("--cache-mib", type=int, default=64)
    ap.add_argument("--every", type=int, default=100, help="report every N groups")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after each group")
    a = ap.parse_args()
    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6") if a.trim else None
    engine = build_engine(ModelConfig(), EngineConfig(cache_bytes=a.cache_mib << 20))
    rng = np.random.default_rng(0)
    print(f"{a.images} images, 16 per group, 1 question each, --cache-mib {a.cache_mib}"
          f"{', malloc_trim after each group' if a.trim else ''}")
    print(f"{'group':>6} {'RSS MiB':>8} {'cache MiB':>10} {'blocks':>7} {'evictions':>10}")
    for g in range(a.images // 16):
        ims = [prepare(image(rng), engine.image_plan) for _ in range(16)]
        engine.score(ims, [Request(i, "Is there a red shape?") for i in range(16)])
        if libc is not None:
            libc.malloc_trim(0)
        if g % a.every == 0 or g == a.images // 16 - 1:
            c = engine.cache
            assert c is not None
            print(f"{g:>6} {rss_mib():>8} {c.bytes >> 20:>10} {len(c):>7} "
                  f"{c.stats.evictions:>10}", flush=True)


if __name__ == "__main__":
    main()
