"""Accuracy on easy-vqa's *test* split (yes/no questions): ``vlmbatch eval``.

The built-in model never saw this split (training reads only easy-vqa's train split and our
own shape scenes). Items go through the same path as ``vlmbatch run`` (read, decode, tile,
engine: ``pipeline.drive``), so the figure is the accuracy a user gets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import easy_vqa
from tqdm import tqdm

from vlmbatch.pipeline.build import build_engine
from vlmbatch.pipeline.config import EngineConfig, ModelConfig, PrepareOptions
from vlmbatch.pipeline.drive import drive, groups_of
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.records import ImageItem, Question
from vlmbatch.pipeline.task import AnswerTask


@dataclass(frozen=True)
class EvalResult:
    questions: int
    correct: int
    seconds: float

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.questions, 1)


@dataclass(frozen=True)
class EvalSet:
    items: list[ImageItem]
    expected: dict[tuple[str, str], str]  # (image id, question id) -> "yes" | "no"


def easy_vqa_set(split: str = "test", limit: int | None = None) -> EvalSet:
    """easy-vqa yes/no questions grouped per image, with their answers; ``limit`` caps the
    number of questions. A question's id is its index in easy-vqa's list."""
    if split == "test":
        texts, answers, ids = easy_vqa.get_test_questions()
        paths = easy_vqa.get_test_image_paths()
    else:
        texts, answers, ids = easy_vqa.get_train_questions()
        paths = easy_vqa.get_train_image_paths()
    per_image: dict[int, list[Question]] = {}
    expected: dict[tuple[str, str], str] = {}
    for k, (t, a, i) in enumerate(zip(texts, answers, ids)):
        if a not in ("yes", "no") or (limit is not None and len(expected) >= limit):
            continue
        per_image.setdefault(i, []).append(Question(id=str(k), text=t))
        expected[(str(i), str(k))] = a
    items = [ImageItem(str(i), str(paths[i]), tuple(qs), Path(paths[i]).parent)
             for i, qs in sorted(per_image.items())]
    return EvalSet(items, expected)


def easy_vqa_items(split: str = "test", limit: int | None = None) -> list[ImageItem]:
    """The items of ``easy_vqa_set`` (benchmarks that need no answers)."""
    return easy_vqa_set(split, limit).items


def evaluate(model_cfg: ModelConfig, engine_cfg: EngineConfig, split: str = "test",
             limit: int | None = None, images_per_batch: int = 16,
             progress: bool = True, opts: PrepareOptions = PrepareOptions(),
             hooks: FaultHooks = NO_HOOKS, threads: int | None = None) -> EvalResult:
    """Accuracy of the model on easy-vqa's ``split``; items through the drive loop (each
    image in a decoder process under ``opts.decode_timeout``, as ``vlmbatch run``)."""
    data = easy_vqa_set(split, limit)
    engine = build_engine(model_cfg, engine_cfg, threads)
    total = correct = 0
    start = time.perf_counter()
    bar = tqdm(total=len(data.expected), unit="q", disable=not progress,
               desc=f"easy-vqa {split}")
    for _, results in drive(AnswerTask(), engine, groups_of(data.items, images_per_batch),
                            opts, hooks=hooks):
        for a in (a for per_item in results for a in per_item):
            total += 1
            correct += a.answer == data.expected[(a.image_id, a.question_id)]
            bar.update(1)
    bar.close()
    return EvalResult(total, correct, time.perf_counter() - start)
