"""One vlmbatch row of ``bench/qpm.py`` served from a subprocess, so that another checkout of
the code (``qpm.py --before DIR``: this file run with ``PYTHONPATH=DIR``) is timed beside
this one, round for round. It imports only ``vlmbatch`` (whichever the path gives) and
names both trees have.

Protocol (one JSON line each way): the worker builds the model and engine config, answers
the warm-up group, prints ``{"ready": true}``; each ``round`` line on stdin times one round
over the items with a fresh engine (empty cache) and prints ``{"seconds": s}``; ``quit``
prints ``{"p_yes": [...], "prefill_tokens": n, "hit_rate": r}`` of the last round.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import torch

from vlmbatch.cli.evaluate import easy_vqa_set
from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model, torch_dtype, vision_model
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.pipeline.drive import answer_group
from vlmbatch.vit_trt.base import RunnerOptions, make_runner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--images", type=int, required=True)
    ap.add_argument("--images-per-batch", type=int, default=16)
    ap.add_argument("--cache", type=int, choices=[0, 1], required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # as `run` loads it: fused where this tree can fuse
    kw = {"fuse": True} if "fuse" in inspect.signature(load_model).parameters else {}
    model = load_model(args.model, args.device, torch_dtype(args.dtype), **kw)
    runner = make_runner("torch", vision_model(model), RunnerOptions(
        args.device, True, stream_ordered=True))
    cfg = EngineConfig(prefix_cache=bool(args.cache))
    items = easy_vqa_set("test").items[: args.images]
    warm = easy_vqa_set("train").items[: args.images_per_batch]
    step = args.images_per_batch

    def answer(its: list) -> tuple[list[float], TorchEngine]:
        engine = TorchEngine(model, cfg, runner)
        out = [a.p_yes for g in range(0, len(its), step)
               for a in answer_group(engine, its[g: g + step])]
        return out, engine

    answer(warm)
    print(json.dumps({"ready": True}), flush=True)
    p_yes: list[float] = []
    engine = None
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        start = time.perf_counter()
        p_yes, engine = answer(items)
        print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)
    hit = engine.cache.stats.hit_rate() if engine is not None and engine.cache else None
    print(json.dumps({"p_yes": p_yes, "hit_rate": hit,
                      "prefill_tokens": engine.stats.prefill_tokens if engine else 0}),
          flush=True)


if __name__ == "__main__":
    main()
