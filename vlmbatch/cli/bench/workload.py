"""What ``vlmbatch bench`` answers: the user's manifest or folder, or generated shape scenes
(``scenes.py``), each image asked K questions; and the untimed warm-up group (other scenes of
the same sizes, or the first images of the user's set)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from vlmbatch.cli.bench.config import BenchConfig
from vlmbatch.cli.bench.scenes import scene_set
from vlmbatch.inputs.manifest import items_from_folder, read_manifest, read_policy
from vlmbatch.pipeline.questions import Question
from vlmbatch.pipeline.records import ImageItem

SCENES = 32  # images per round when none are given
# asked of a folder's images when no --policy says what to ask (timing does not depend on
# what a yes/no question says, only on its length)
FOLDER_QUESTIONS = ("Is there a person in the image?", "Is this image a photograph?",
                    "Is there any text in the image?", "Is the image taken outdoors?",
                    "Is there an animal in the image?", "Is there a vehicle in the image?",
                    "Does the image show food?", "Is the image mostly dark?")


@dataclass(frozen=True)
class Workload:
    items: list[ImageItem]
    warm: list[ImageItem]
    source: str  # what the items are, as the table's heading says it

    @property
    def questions(self) -> int:
        return sum(len(it.questions) for it in self.items)


def workload(cfg: BenchConfig, scratch: Path, warm_size: int) -> Workload:
    """The timed items and ``warm_size`` warm-up items; generated scenes are written under
    ``scratch``."""
    k = cfg.questions
    if cfg.images is None:
        sizes = cfg.scene_sizes
        n = cfg.count or SCENES
        items = scene_set(list(sizes), -(-n // len(sizes)), k, scratch).items[:n]
        (scratch / "warm").mkdir(exist_ok=True)
        warm = scene_set(list(sizes), -(-warm_size // len(sizes)), k, scratch / "warm",
                         seed=7).items[:warm_size]
        shown = ",".join(f"{w}x{h}" for w, h in sizes)
        return Workload(items, warm, f"{len(items)} shape scenes ({shown})")
    policy = read_policy(cfg.policy) if cfg.policy else ()
    if cfg.images.is_dir():
        asked = policy or tuple(Question(f"q{i}", t) for i, t in
                                enumerate(FOLDER_QUESTIONS * (1 + k // len(FOLDER_QUESTIONS))))
        found = items_from_folder(cfg.images, asked)
    else:
        found = read_manifest(cfg.images, policy)
    items = [dataclasses.replace(it, questions=it.questions[:k])
             for it in found[: cfg.count]]
    return Workload(items, items[:warm_size], f"{len(items)} images of {cfg.images}")
