"""Reference vs reduced-token tiling with the built-in model: accuracy, tokens, QPM.

Two sets: easy-vqa's test split (yes/no questions; 64x64 images, so both modes give one tile
and should agree exactly: the script checks that every answer is the same, and exits 1 after
its table if not) and held-out shape scenes from ``vlmbatch/cli/bench/shapes.py`` with a seed
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

from bench.checks import Checks  # noqa: E402
from vlmbatch.cli.bench.shapes import make_questions, make_scene  # noqa: E402
from vlmbatch.cli.evaluate import EvalSet, easy_vqa_set  # noqa: E402
from vlmbatch.engine.build import build_engine  # noqa: E402
from vlmbatch.engine.config import EngineConfig, ModelConfig  # noqa: E402
from vlmbatch.models.paths import DEFAULT_MODEL  # noqa: E402
from vlmbatch.pipeline.drive import answer_group  # noqa: E402
from vlmbatch.pipeline.questions import Question  # noqa: E402
from vlmbatch.pipeline.records import ImageItem  # noqa: E402

HELD_OUT_SEED = 987_654  # training draws scenes from seed 0


def scene_items(n: int, folder: Path) -> EvalSet:
    rng = np.random.default_rng(HELD_OUT_SEED)
    items, expected = [], {}
    for i in range(n):
        scene = make_scene(rng)
        path = folder / f"s{i}.png"
        cv2.imwrite(str(path), cv2.cvtColor(scene.image, cv2.COLOR_RGB2BGR))
        qa = make_questions(scene, rng, 6)
        items.append(ImageItem(str(i), str(path),
                               tuple(Question(str(k), q) for k, (q, _) in enumerate(qa)),
                               folder))
        expected.update({(str(i), str(k)): a for k, (_, a) in enumerate(qa)})
    return EvalSet(items, expected)


def run(data: EvalSet, model: Path, tiling: str) -> tuple[float, float, float, list[str]]:
    """Accuracy, image tokens per question, QPM and the answers, in order."""
    engine = build_engine(ModelConfig(model, tiling=tiling), EngineConfig())
    right = total = tokens = 0
    answers = []
    start = time.perf_counter()
    for g in range(0, len(data.items), 16):
        for a in answer_group(engine, data.items[g: g + 16]):
            total += 1
            right += a.answer == data.expected[(a.image_id, a.question_id)]
            tokens += a.image_tokens
            answers.append(a.answer)
    secs = time.perf_counter() - start
    return right / total, tokens / total, 60 * total / secs, answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--scenes", type=int, default=400)
    ap.add_argument("--easy-limit", type=int, default=None, help="first N easy-vqa questions")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    easy = "easy-vqa test (yes/no)"
    answers = {}
    with tempfile.TemporaryDirectory() as tmp:
        sets = {easy: easy_vqa_set("test", args.easy_limit),
                f"held-out scenes ({args.scenes})": scene_items(args.scenes, Path(tmp))}
        print(f"{'set':<28}{'tiling':<11}{'accuracy':>10}{'img tok/q':>11}{'QPM':>9}")
        for name, items in sets.items():
            for tiling in ("reference", "reduced"):
                acc, tok, qpm, answers[name, tiling] = run(items, args.model, tiling)
                print(f"{name:<28}{tiling:<11}{acc:>10.4f}{tok:>11.1f}{qpm:>9.0f}")
    checks = Checks()
    differ = sum(a != b for a, b in zip(answers[easy, "reference"], answers[easy, "reduced"]))
    what = f"easy-vqa (one 64 px tile either way): the two tilings' answers differ on {differ}"
    print(f"\ncheck: {what} {checks.verdict(differ == 0, what)}")
    checks.exit()


if __name__ == "__main__":
    main()
