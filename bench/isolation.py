"""What decoding in worker processes costs (``preprocessing/isolated.py``), side by side in one
process: how a worker starts, and how tiles come back.

Start-up, from a parent that has imported torch and run a threaded torch op (as a run has
by the time it decodes): our exec'd worker (an interpreter importing only preprocessing),
``multiprocessing`` fork, and forkserver (its first start, then a worker from the running
server; each of its children imports the parent's ``__main__``, here this script and
torch, as ``vlmbatch``'s would). Transfer: one image at a time through a one-worker
``DecoderPool``, tiles back through its shared-memory slot or, with a slot too small for
them, pickled through the pipe; and the same image prepared by a thread of this process
(threads, no isolation).
Wall time per image and this process's CPU time per image (what the model's process pays).

    python bench/isolation.py

Not a test: timings on shared machines are noisy; compare rows of one run.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlmbatch.preprocessing.isolated import SLOT_BYTES, DecoderPool, _Worker  # noqa: E402
from vlmbatch.preprocessing.prepare import TilingConfig, prepare_bytes  # noqa: E402


def _ready(conn) -> None:  # noqa: ANN001
    import vlmbatch.preprocessing.prepare  # noqa: F401  (what a worker needs; imported in the server)

    conn.send("ready")


def start_ms(how: str, rounds: int = 5) -> list[float]:
    """Milliseconds from asking for a worker to its first message, ``rounds`` times."""
    out = []
    ctx = None if how == "exec" else mp.get_context(how)
    if how == "forkserver":
        ctx.set_forkserver_preload(["vlmbatch.preprocessing.prepare"])  # type: ignore[union-attr]
    for _ in range(rounds):
        t = time.perf_counter()
        if ctx is None:
            _Worker((TilingConfig(), 10**8, None), SLOT_BYTES).kill()
        else:
            a, b = ctx.Pipe()
            p = ctx.Process(target=_ready, args=(b,))
            p.start()
            a.recv()
            p.join()
        out.append(1e3 * (time.perf_counter() - t))
    return out


def per_image(data: bytes, plan: TilingConfig, mode: str, n: int) -> tuple[float, float]:
    """(wall ms, this process's CPU ms) per image, ``n`` images one after another."""
    if mode == "thread":
        pool = ThreadPoolExecutor(1)
        call = lambda: pool.submit(prepare_bytes, data, plan, 10**8).result()  # noqa: E731
    else:
        slot = SLOT_BYTES if mode == "shared memory" else 4096  # too small: pickled
        dp = DecoderPool(1, plan, 10**8, 60.0, slot_bytes=slot)
        call = lambda: dp.submit(data, Path(".")).result()  # noqa: E731
    call()  # warm-up (the worker's start)
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        call()
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    if mode == "thread":
        pool.shutdown()
    else:
        dp.stop()
    return 1e3 * wall / n, 1e3 * cpu / n


def main() -> None:
    rng = np.random.default_rng(0)
    cases = [("64x48 PNG, 1 tile of 112 (the built-in model)", (48, 64), TilingConfig(112)),
             ("1792x1344 JPEG, 13 tiles of 448 (InternVL)", (1344, 1792),
              TilingConfig(448, max_tiles=12))]
    print("| image | tiles back by | wall per image | this process's CPU per image |")
    print("|---|---|---|---|")
    for name, (h, w), plan in cases:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        ext = ".png" if w < 100 else ".jpg"
        data = cv2.imencode(ext, img)[1].tobytes()
        n = 400 if w < 100 else 40
        for mode in ("thread", "shared memory", "pickle"):
            wall, cpu = per_image(data, plan, mode, n)
            print(f"| {name} | {mode} | {wall:.2f} ms | {cpu:.2f} ms |", flush=True)
    # after the transfer rows: idle OpenMP threads spin for a while after a torch op, and
    # process_time would count them
    torch.ones(512, 512) @ torch.ones(512, 512)  # torch's thread pool exists, as in a run
    print("\n| start a worker | first | then (median of 4) |\n|---|---|---|")
    for how in ("exec", "fork", "forkserver"):
        ms = start_ms(how)
        print(f"| {how} | {ms[0]:.0f} ms | {sorted(ms[1:])[len(ms) // 2 - 1]:.0f} ms |")


if __name__ == "__main__":
    main()
