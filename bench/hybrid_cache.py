"""Qwen3.5's image prefix in the prefix cache: QPM with and without it, K questions per image.

A random-weight Qwen3.5 of a small shape (``SMALL``: 8 decoder layers, three Gated DeltaNet
layers to each gated full-attention one as in the released models, a 4-layer Qwen3-VL tower
without DeepStack; sizes ours, not a released checkpoint's) answers K = 1, 4, 16 questions
about each of ``--images`` random 448 x 448 images through ``TorchEngine.score``:

- "off": ``--no-prefix-cache``: every question prefills its whole prompt (image included);
- "on": the default cache: each image's first question prefills its whole prompt, caching
  the prefix's full-layer K/V as blocks and the linear layers' conv and recurrent states at
  the prefix's end as one snapshot, taken inside that same forward; every other question
  resumes from there (``docs/hybrid_cache.md``).

Both encode each image once per call (the vision tower is not what differs). Images are
prepared before timing (preprocessing excluded from both). One untimed warm-up call per
cache setting (one image, two questions), then ``--rounds`` timed rounds with a fresh
engine (empty cache) each, interleaved; the best is kept. The figures of merit are
QPM(on) / QPM(off) per K (issue 36's targets: K = 1 >= 1.0, K = 4 >= 2.5, K = 16 >= 5) and
the answers' agreement (max |margin on - off|, 1e-5). Not a test: timings on a shared
machine are noisy; compare rows of one run. What does not depend on the load is printed
too, per question: decoder forwards (``prefill`` calls), tokens prefilled, and the linear
layers' chunk passes (rows x chunks of the chunked delta rule, per linear layer) and the
positions those chunks hold (rows x chunks x chunk size: the rule's work, padding
included), counted by wrapping the decoder's ``prefill`` and ``linear_attention.chunk_rule``.

    python bench/hybrid_cache.py --images 8 --rounds 2
    python bench/hybrid_cache.py --images 64 --device cuda --dtype bfloat16 --rounds 3
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmbatch.engine.config import EngineConfig  # noqa: E402
from vlmbatch.engine.loading import load_model  # noqa: E402
from vlmbatch.engine.records import Request  # noqa: E402
from vlmbatch.engine.torch_engine import TorchEngine  # noqa: E402
from vlmbatch.models import linear_attention  # noqa: E402
from vlmbatch.models.base import ImageOptions, LoadedModel  # noqa: E402
from vlmbatch.models.qwen_vl.random import save_random_qwen_vl  # noqa: E402
from vlmbatch.preprocessing.prepare import PreparedImage  # noqa: E402

KS = (1, 4, 16)
SMALL = dict(
    kind="qwen3_5", pixels=(64 * 64, 448 * 448),
    vision=dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4,
                out_hidden_size=768, patch_size=16, spatial_merge_size=2,
                temporal_patch_size=2, num_position_embeddings=256,
                hidden_act="gelu_pytorch_tanh"),
    text=dict(hidden_size=768, intermediate_size=2304, num_hidden_layers=8,
              num_attention_heads=12, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
              layer_types=["linear_attention"] * 3 + ["full_attention"]
              + ["linear_attention"] * 3 + ["full_attention"],
              linear_conv_kernel_dim=4, linear_num_key_heads=4, linear_num_value_heads=8,
              linear_key_head_dim=64, linear_value_head_dim=64,
              rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                               "mrope_section": [4, 2, 2], "mrope_interleaved": True,
                               "partial_rotary_factor": 0.25}))
QUESTION_WORDS = ["red", "blue", "round", "square", "large", "small", "bright", "dark"]


def questions(k: int) -> list[str]:
    """``k`` distinct questions of a few tokens each."""
    return [f"is there a {QUESTION_WORDS[i % 8]} shape number {i}?" for i in range(k)]


def images(model: LoadedModel, n: int, seed: int) -> list[PreparedImage]:
    plan = model.family.image_plan(model.spec, ImageOptions("reduced", None, 1.0, None))
    rng = np.random.default_rng(seed)
    return [plan.prepare(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8))
            for _ in range(n)]


class Counts:
    """Decoder forwards and chunk passes, counted by wrapping (module docstring)."""

    def __init__(self, model: LoadedModel) -> None:
        self.forwards = self.chunks = self.positions = 0
        prefill, rule = model.llm.prefill, linear_attention.chunk_rule

        def counted_prefill(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            self.forwards += 1
            return prefill(*args, **kw)

        def counted_rule(q: torch.Tensor, *args, **kw):  # noqa: ANN002, ANN003, ANN202
            size = kw.get("chunk", linear_attention.CHUNK)
            self.chunks += q.shape[0] * math.ceil(q.shape[2] / size)
            self.positions += q.shape[0] * math.ceil(q.shape[2] / size) * size
            return rule(q, *args, **kw)

        model.llm.prefill = counted_prefill  # type: ignore[method-assign]
        linear_attention.chunk_rule = counted_rule  # type: ignore[assignment]
        self.linear = model.llm.kinds.count("linear")


def timed(model: LoadedModel, cache: bool, ims: list[PreparedImage], k: int,
          batch_tokens: int, counts: Counts) -> tuple[float, TorchEngine, list[float], tuple]:
    """Seconds of one ``score`` call on a fresh engine, the engine, the margins, and the
    call's (forwards, chunk passes and rule positions per linear layer)."""
    engine = TorchEngine(model, EngineConfig(prefix_cache=cache, max_new_tokens=0,
                                             max_batch_tokens=batch_tokens))
    reqs = [Request(i, q) for i in range(len(ims)) for q in questions(k)]
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    f0, c0, p0 = counts.forwards, counts.chunks, counts.positions
    t0 = time.perf_counter()
    scores = engine.score(ims, reqs)
    sync()
    secs = time.perf_counter() - t0
    n = max(counts.linear, 1)
    used = (counts.forwards - f0, (counts.chunks - c0) / n, (counts.positions - p0) / n)
    return secs, engine, [s.margin for s in scores], used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="vlmbatch-qwen3_5-") as tmp:
        path = save_random_qwen_vl(Path(tmp), dtype=dtype, **SMALL)  # type: ignore[arg-type]
        model = load_model(path, args.device, dtype)
    ims = images(model, args.images, seed=0)
    warm = images(model, 1, seed=1)
    prompt = model.prompts.build(questions(1)[0], ims[0])
    print(f"Qwen3.5 small random, {args.device} {args.dtype}, {args.images} images, prompt "
          f"{len(prompt.ids)} tokens (shared prefix {prompt.prefix_len}), "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} "
          "at the start")
    counts = Counts(model)
    best: dict[tuple[int, bool], float] = {}
    stats: dict[tuple[int, bool], tuple] = {}
    for cache in (False, True):  # allocator and kernel choice; not the timed shapes' cost
        timed(model, cache, warm, 2, args.max_batch_tokens, counts)
    for r in range(args.rounds):
        rows = [(k, c) for k in KS for c in (False, True)]
        for k, cache in rows[r % len(rows):] + rows[: r % len(rows)]:
            secs, engine, margins, used = timed(model, cache, ims, k, args.max_batch_tokens,
                                                counts)
            if secs < best.get((k, cache), float("inf")):
                best[k, cache], stats[k, cache] = secs, (engine, margins, used)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'K':>3} {'cache':>5} {'QPM':>10} {'x off':>6} {'forwards/q':>10} "
          f"{'tokens/q':>9} {'chunks/q':>9} {'rule pos/q':>10} {'snap in/hit':>11} "
          f"{'|dmargin|':>9}")
    for k in KS:
        for cache in (False, True):
            n = args.images * k
            qpm = 60 * n / best[k, cache]
            e, margins, (forwards, chunks, positions) = stats[k, cache]
            c = e.cache.stats if e.cache is not None else None
            snaps = "-" if c is None else f"{c.state_inserts}/{c.state_hits}"
            ratio = best[k, False] / best[k, cache]
            diff = max(abs(a - b) for a, b in zip(margins, stats[k, False][1]))
            print(f"{k:>3} {'on' if cache else 'off':>5} {qpm:>10.1f} {ratio:>6.2f} "
                  f"{forwards / n:>10.3f} {e.stats.prefill_tokens / n:>9.1f} "
                  f"{chunks / n:>9.2f} {positions / n:>10.1f} {snaps:>11} {diff:>9.1e}")


if __name__ == "__main__":
    main()
