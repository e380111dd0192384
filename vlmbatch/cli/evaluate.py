"""Accuracy on easy-vqa's *test* split: its yes/no questions (``vlmbatch eval``), or its
open ones asked as label-set questions (``vlmbatch eval --open``: "what is the red shape?"
with the 3 shapes as choices, "what color is the triangle?" with the 8 colours; 2,537 in the
test split).

The built-in model never saw this split (training reads only easy-vqa's train split and our
own shape scenes). Items go through the same path as ``vlmbatch run`` (read, decode, tile,
engine: ``pipeline.drive``), so the figure is the accuracy a user gets.

``evaluate_labelled`` (``vlmbatch eval MANIFEST``) runs a labelled manifest's questions as
``vlmbatch run`` does and scores the lines against the labels (``labels/evaluation.py``).
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from pathlib import Path

import easy_vqa
from tqdm import tqdm

from vlmbatch.cli.embed_eval import COLOURS, SHAPES
from vlmbatch.cli.run import RunSummary, run
from vlmbatch.engine.build import build_engine
from vlmbatch.engine.config import EngineConfig, ModelConfig
from vlmbatch.inputs.manifest import read_policy
from vlmbatch.jobs.config import RunConfig
from vlmbatch.jobs.tasks import prompt_limits
from vlmbatch.labels.evaluation import EvalReport, join
from vlmbatch.labels.evaluation import evaluate as evaluate_lines
from vlmbatch.labels.read import labelled_manifest, scored
from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.drive import drive, groups_of
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.questions import Question
from vlmbatch.pipeline.records import ImageItem
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
    # (image id, question id) -> "yes" | "no" (an open question: its colour or shape)
    expected: dict[tuple[str, str], str]


def label_set(question: str) -> tuple[str, ...]:
    """The choices of an open easy-vqa question, from its text: the 8 colours for a question
    about colour ("what color is the triangle?"), else the 3 shapes ("what is the red
    shape?")."""
    return COLOURS if "color" in question else SHAPES


def easy_vqa_set(split: str = "test", limit: int | None = None,
                 open_questions: bool = False) -> EvalSet:
    """easy-vqa yes/no questions grouped per image, with their answers; ``limit`` caps the
    number of questions. A question's id is its index in easy-vqa's list. With
    ``open_questions``, the other questions instead, each a label set (``label_set``)."""
    if split == "test":
        texts, answers, ids = easy_vqa.get_test_questions()
        paths = easy_vqa.get_test_image_paths()
    else:
        texts, answers, ids = easy_vqa.get_train_questions()
        paths = easy_vqa.get_train_image_paths()
    per_image: dict[int, list[Question]] = {}
    expected: dict[tuple[str, str], str] = {}
    for k, (t, a, i) in enumerate(zip(texts, answers, ids)):
        if (a in ("yes", "no")) == open_questions or (limit is not None
                                                        and len(expected) >= limit):
            continue
        per_image.setdefault(i, []).append(Question(
            id=str(k), text=t, choices=label_set(t) if open_questions else ()))
        expected[(str(i), str(k))] = a
    items = [ImageItem(str(i), str(paths[i]), tuple(qs), Path(paths[i]).parent)
             for i, qs in sorted(per_image.items())]
    return EvalSet(items, expected)


def easy_vqa_items(split: str = "test", limit: int | None = None) -> list[ImageItem]:
    """The items of ``easy_vqa_set`` (benchmarks that need no answers)."""
    return easy_vqa_set(split, limit).items


def evaluate_easy_vqa(model_cfg: ModelConfig, engine_cfg: EngineConfig, split: str = "test",
             limit: int | None = None, images_per_batch: int = 16,
             progress: bool = True, opts: PrepareOptions = PrepareOptions(),
             hooks: FaultHooks = NO_HOOKS, threads: int | None = None,
             open_questions: bool = False) -> EvalResult:
    """Accuracy of the model on easy-vqa's ``split`` (its open questions as label sets with
    ``open_questions``); items through the drive loop (each image in a decoder process under
    ``opts.decode_timeout``, as ``vlmbatch run``)."""
    data = easy_vqa_set(split, limit, open_questions)
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


def evaluate_labelled(cfg: RunConfig, hooks: FaultHooks = NO_HOOKS
                      ) -> tuple[RunSummary, EvalReport]:
    """``vlmbatch eval MANIFEST``: the manifest's labelled questions (``expected``; the
    others are not asked) answered as ``run`` answers them, their result lines scored
    against the labels (``labels/evaluation.py``). With ``cfg.policy``, a policy question
    with the id of a line's is that question at the policy's threshold (a calibration
    checked on another labelled set: ``labels/read.py`` ``labelled_manifest``)."""
    assert cfg.manifest is not None
    items, labels = labelled_manifest(cfg.manifest, cfg.policy)
    limits = prompt_limits(cfg)  # each question's length, as `run` checks it: before any work
    for it in items:
        for q in it.questions:
            limits.check(q, f"{cfg.manifest}: image {it.id!r}")
    buf = io.StringIO()
    summary = run(cfg, buf, hooks, items)
    lines = (scored(json.loads(text), f"result line {n}")
             for n, text in enumerate(buf.getvalue().splitlines(), 1))
    return summary, evaluate_lines(join(lines, labels))


def policy_note(policy: Path, report: EvalReport) -> str:
    """What ``eval MANIFEST --policy`` says on stderr: the thresholds its yes/no questions
    were evaluated at, and its questions that had no label here (not evaluated)."""
    qs = read_policy(policy)
    scored_ids = {q.question_id for q in report.questions}
    at = [f"{q.id} {q.threshold}" for q in qs if q.id in scored_ids and not q.choices]
    out = f"at the thresholds of {policy}: {', '.join(at) or 'none (label sets only)'}"
    if missing := [q.id for q in qs if q.id not in scored_ids]:
        out += f"; not evaluated (no label in this manifest): {', '.join(missing)}"
    return out
