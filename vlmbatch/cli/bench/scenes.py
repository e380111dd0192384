"""Shape scenes at chosen sizes, with K yes/no questions each and their answers: the
default workload of ``vlmbatch bench`` and of ``bench/qpm.py --scene-sizes`` (photos of
448-1344 px make 1-12 tiles, and a moderation policy asks several questions of each image,
which is where the prefix cache should pay). Drawn by ``shapes.py`` (easy-vqa's palette),
written as PNGs so that every path, the Pillow baselines included, reads the same files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np

from vlmbatch.cli.bench.shapes import make_questions, make_scene
from vlmbatch.cli.evaluate import EvalSet
from vlmbatch.pipeline.questions import Question
from vlmbatch.pipeline.records import ImageItem


def scene_set(sizes: Sequence[tuple[int, int]], per_size: int, questions: int, folder: Path,
              seed: int = 123) -> EvalSet:
    """``per_size`` scenes of each size, ``questions`` questions each, saved under
    ``folder``; ids ``s{i}``, question ids ``0..K-1``."""
    rng = np.random.default_rng(seed)
    items, expected = [], {}
    for i in range(len(sizes) * per_size):
        size = sizes[i % len(sizes)]
        scene = make_scene(rng, size=size)
        path = folder / f"s{i}.png"
        cv2.imwrite(str(path), cv2.cvtColor(scene.image, cv2.COLOR_RGB2BGR))
        qa = make_questions(scene, rng, questions)
        items.append(ImageItem(f"s{i}", str(path),
                               tuple(Question(str(k), q) for k, (q, _) in enumerate(qa)),
                               folder))
        expected.update({(f"s{i}", str(k)): a for k, (_, a) in enumerate(qa)})
    return EvalSet(items, expected)
