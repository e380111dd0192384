"""Reference vs reduced-token tiling with the built-in model: accuracy, tokens, QPM.

Two sets: easy-vqa's test split (yes/no questions; 64x64 images, so both modes give one tile
and should agree exactly) and held-out shape scenes from ``scripts/shapes.py`` with a seed
the training never used (many sizes and aspect ratios, 1-7 tiles: where the modes differ).

    python bench/tiling_accuracy.py --scenes 400
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs.manifest import ImageItem, Question  # noqa: E402
from jobs.runner import answer_group  # noqa: E402
from pipeline.config import EngineConfig, ModelConfig  # noqa: E402
from pipeline.engines import build_engine  # noqa: E402
from pipeline.evaluate import easy_vqa_items  # noqa: E402
from pipeline.model import DEFAULT_MODEL  # noqa: E402
from scripts.shapes import make_questions, make_scene  # noqa: E402

HELD_OUT_SEED = 987_654  # training draws scenes from seed 0


def scene_items(n: int, folder: Path) -> list[ImageItem]:
    rng = np.random.default_rng(HELD_OUT_SEED)
    items = []
    for i in range(n):
        scene = make_scene(rng)
        path = folder / f"s{i}.png"
        cv2.imwrite(str(path), cv2.cvtColor(scene.image, cv2.COLOR_RGB2BGR))
        qs = tuple(Question(f"{k}:{a}", q) for k, (q, a) in
                   enumerate(make_questions(scene, rng, 6)))
        items.append(ImageItem(str(i), str(path), qs, folder))
    return items


def run(items: list[ImageItem], model: Path, tiling: str) -> tuple[float, float, float]:
    engine, t = build_engine(ModelConfig(model, tiling=tiling), EngineConfig())
    right = total = tokens = 0
    start = time.perf_counter()
    for g in range(0, len(items), 16):
        for ln in answer_group(engine, t, items[g: g + 16]):
            total += 1
            right += ln["answer"] == ln["question_id"].split(":")[1]
            tokens += ln["image_tokens"]
    secs = time.perf_counter() - start
    return right / total, tokens / total, 60 * total / secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--scenes", type=int, default=400)
    ap.add_argument("--easy-limit", type=int, default=None, help="first N easy-vqa questions")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        sets = {"easy-vqa test (yes/no)": easy_vqa_items("test", args.easy_limit),
                f"held-out scenes ({args.scenes})": scene_items(args.scenes, Path(tmp))}
        print(f"{'set':<28}{'tiling':<11}{'accuracy':>10}{'img tok/q':>11}{'QPM':>9}")
        for name, items in sets.items():
            for tiling in ("reference", "reduced"):
                acc, tok, qpm = run(items, args.model, tiling)
                print(f"{name:<28}{tiling:<11}{acc:>10.4f}{tok:>11.1f}{qpm:>9.0f}")


if __name__ == "__main__":
    main()
