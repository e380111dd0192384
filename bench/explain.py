"""Per-question text answers: what it costs when only a few questions want an explanation.

The workload of the 58.com write-up this project starts from (docs/engine.md): >98% of
answers are a few tokens, ~2% run to hundreds. Three ways to run the same requests through
the torch engine, in one process, interleaved, best of ``--rounds``:

- P(yes) only (no text);
- every request decodes ``--tokens`` tokens (``--max-new-tokens`` for the whole run);
- only every ``--every``-th request decodes them (its question's own ``max_new_tokens``).

Decoding is forced to the full length (``ignore_eos``) so the rows compare like for like;
the built-in model would otherwise stop after "yes"/"no". Generated images, built-in model.

    python bench/explain.py
    python bench/explain.py --images 64 --tokens 64 --every 50

Not a test: timings on shared machines are noisy; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cache_memory import image  # noqa: E402
from vlmbatch.engine.build import build_engine  # noqa: E402
from vlmbatch.engine.config import EngineConfig, ModelConfig  # noqa: E402
from vlmbatch.engine.records import Request  # noqa: E402
from vlmbatch.preprocessing.prepare import prepare  # noqa: E402

QUESTIONS = ["Is there a red shape?", "Is there a circle?", "Is there a blue shape?",
             "Is there a triangle?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per text answer")
    ap.add_argument("--every", type=int, default=50, help="1 request in N wants text")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    engine = build_engine(ModelConfig(), EngineConfig(max_new_tokens=a.tokens,
                                                              ignore_eos=True))
    rng = np.random.default_rng(0)
    ims = [prepare(image(rng), engine.image_plan) for _ in range(a.images)]
    pairs = [(i, q) for i in range(len(ims)) for q in QUESTIONS]
    rows = {
        "P(yes) only": [Request(i, q, 0) for i, q in pairs],
        f"every request decodes {a.tokens}": [Request(i, q) for i, q in pairs],
        f"1 in {a.every} decodes {a.tokens}": [Request(i, q, None if k % a.every == 0 else 0)
                                               for k, (i, q) in enumerate(pairs)],
    }
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(a.rounds):
        for name, reqs in rows.items():
            assert engine.cache is not None
            engine.cache.clear()  # every row starts cold
            t0 = time.perf_counter()
            engine.score(ims, reqs)
            best[name] = min(best[name], time.perf_counter() - t0)
    n = len(pairs)
    base = best[f"every request decodes {a.tokens}"]
    print(f"{a.images} generated images x {len(QUESTIONS)} questions = {n} requests, "
          f"{a.threads} threads, best of {a.rounds}")
    print(f"{'row':<28} {'seconds':>8} {'QPM':>9} {'vs all decode':>14}")
    for name, s in best.items():
        print(f"{name:<28} {s:>8.2f} {60 * n / s:>9.0f} {base / s:>13.2f}x")


if __name__ == "__main__":
    main()
