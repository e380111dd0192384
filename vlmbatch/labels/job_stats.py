"""What ``vlmbatch report`` shows of a job (the page: ``report.py``), counted in one pass over
its store in bounded memory: per question, its yes-rate, a histogram of P(yes), its label
counts (a label set), right and wrong answers where the manifest carried labels (the store
keeps them), and heaps of the ``borderline`` closest and most confidently wrong answers.

Borderline, the rule: an answer is borderline when its log-odds are within ``NEAR`` (1, a
factor e ~ 2.7 in odds) of the threshold's: ``|logit(p_yes) - logit(threshold)| <= 1``, so
P(yes) in 0.27-0.73 around 0.5, 0.0034-0.025 around 0.0093 (a distance in probability
would call 0.09 near 0.0093, ten times its odds). A label set's answer is borderline when
its two most probable choices are within a factor e: ``log(p1 / p2) <= 1``. A question with
no borderline answer gets no contact sheet but the line "nothing is near the threshold",
with the closest answer and its distance.

The histogram's bins are 1 wide in log-odds over [-12, 12] (P(yes) 6e-6 to 0.999994; the
outer bins hold what lies beyond), its ticks labelled in probability: a threshold of 0.0093
(log-odds -4.7) has bins of its own on either side, where 20 linear bins put it in the
first, with everything below 0.05.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from vlmbatch.jobs.folder import (
    STORE_FILE,
    JobStatus,
    job_task_name,
    load_config,
    require_job,
    status,
)
from vlmbatch.jobs.store import JobStore, image_item_from_json
from vlmbatch.labels.read import Scored, scored
from vlmbatch.pipeline.media_inputs import ImageList, VideoInput
from vlmbatch.pipeline.questions import ManifestError
from vlmbatch.pipeline.records import ImageItem

LOGITS = 12  # the histogram spans log-odds [-LOGITS, LOGITS]
BINS = 2 * LOGITS  # 1 wide each
NEAR = 1.0  # borderline: within this of the threshold's log-odds (a factor e in odds)
EDGE = 1e-6  # result lines hold P(yes) in 6 decimals: 0 and 1 are this close to them


@dataclass(frozen=True)
class Shown:
    """An answer the page shows: its line, where its image is, its label (None: none), and
    the item's media when it is a list of images or a clip (``thumbnails.py``)."""
    s: Scored
    image: tuple[str, Path]  # (source, base folder): where the thumbnail is read from
    expected: str | None
    media: ImageList | VideoInput | None = None


Kept = tuple[float, int, Shown]  # a heap entry: (key, -order, answer); orders are distinct


def logit(p: float) -> float:
    """log(p / (1 - p)), P clipped to [EDGE, 1 - EDGE]."""
    p = min(max(p, EDGE), 1.0 - EDGE)
    return math.log(p / (1.0 - p))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def bin_of(p: float) -> int:
    """The histogram bin of P(yes) ``p``: ``floor(logit(p)) + LOGITS``, clamped."""
    return min(max(math.floor(logit(p)) + LOGITS, 0), BINS - 1)


def distance(s: Scored, threshold: float) -> float:
    """How far an answer is from changing: ``|logit(p_yes) - logit(threshold)|``, or a label
    set's ``log(p1 / p2)`` of its two most probable choices (0: a tie)."""
    if s.probs is None:
        return abs(logit(float(s.p_yes or 0.0)) - logit(threshold))
    top = sorted((p for _, p in s.probs), reverse=True) + [0.0]
    return math.log(max(top[0], EDGE) / max(top[1], EDGE))


def _keep(heap: list[Kept], entry: Kept, keep: int) -> None:
    """``heap`` holds the ``keep`` largest entries (a min-heap on the key)."""
    if len(heap) < keep:
        heapq.heappush(heap, entry)
    elif keep and entry > heap[0]:
        heapq.heapreplace(heap, entry)


def _sorted(heap: list[Kept]) -> list[Shown]:
    return [a for _, _, a in sorted(heap, key=lambda e: (-e[0], -e[1]))]


@dataclass
class QuestionStats:
    """What the page shows of one question, gathered line by line."""
    question_id: str
    text: str
    threshold: float
    answered: int = 0
    failed: int = 0
    yes: int = 0
    hist: list[int] = field(default_factory=lambda: [0] * BINS)
    labels: Counter[str] = field(default_factory=Counter)  # label-set questions
    near_count: int = 0  # borderline answers (distance <= NEAR)
    labelled: int = 0  # answered lines with a label
    right: int = 0
    closest: tuple[float, Scored] | None = None  # the smallest distance, its answer
    # heaps of the kept answers: borderline ones by -distance (closest kept), wrong ones by
    # distance (most confident kept); ties: the earlier line stays
    near: list[Kept] = field(default_factory=list)
    wrong: list[Kept] = field(default_factory=list)

    @property
    def is_label_set(self) -> bool:
        return bool(self.labels)

    def add(self, s: Scored, expected: str | None, image: tuple[str, Path], keep: int,
            order: int, media: ImageList | VideoInput | None = None) -> None:
        if s.error is not None:
            self.failed += 1
            return
        self.answered += 1
        if s.probs is not None:
            self.labels[str(s.answer)] += 1
        else:
            self.yes += s.answer == "yes"
            self.hist[bin_of(float(s.p_yes or 0.0))] += 1
        d = distance(s, self.threshold)
        if self.closest is None or d < self.closest[0]:
            self.closest = (d, s)
        shown = Shown(s, image, expected, media)
        if d <= NEAR:
            self.near_count += 1
            _keep(self.near, (-d, -order, shown), keep)
        if expected is not None:
            self.labelled += 1
            self.right += s.answer == expected
            if s.answer != expected:
                _keep(self.wrong, (d, -order, shown), keep)

    def borderline(self) -> list[Shown]:
        """The kept borderline answers, closest first."""
        return _sorted(self.near)

    def wrong_answers(self) -> list[Shown]:
        """The kept wrong answers, most confident first."""
        return _sorted(self.wrong)


@dataclass(frozen=True)
class JobReport:
    job: Path
    status: JobStatus
    model: str
    questions: list[QuestionStats]
    errors: Counter[str]  # error kind -> failed images
    error_example: dict[str, str]  # error kind -> one message


def gather(job: Path, borderline: int = 8) -> JobReport:
    """One pass over the job's store."""
    require_job(job)  # a folder that is no job is said so, as `status` says it
    if job_task_name(job) != "answer":
        raise ManifestError(f"{job} is an embedding job: a report covers jobs that answer "
                            "questions")
    st, cfg = status(job), load_config(job)
    per_q: dict[str, QuestionStats] = {}
    errors: Counter[str] = Counter()
    example: dict[str, str] = {}
    store = JobStore(Path(job) / STORE_FILE)
    try:
        for n, (item, lines) in enumerate(store.recorded_items(image_item_from_json)):
            _add_item(item, lines, per_q, borderline, n)
            failed = next((d for d in lines if d.get("error")), None)
            if failed is not None:
                kind = str(failed.get("error_kind") or "unknown")
                errors[kind] += 1
                example.setdefault(kind, str(failed["error"]))
    finally:
        store.close()
    model = str(cfg.model.path) if cfg.model.path is not None else "the built-in model"
    return JobReport(Path(job), st, model, list(per_q.values()), errors, example)


def _add_item(item: ImageItem, lines: list[dict], per_q: dict[str, QuestionStats],
              keep: int, order: int) -> None:
    asked = {q.id: q for q in item.questions}
    for d in lines:
        s = scored(d, f"item {item.id!r}")
        q = per_q.get(s.question_id)
        given = asked.get(s.question_id)
        if q is None:
            q = per_q[s.question_id] = QuestionStats(
                s.question_id, s.question, given.threshold if given else 0.5)
        media = item.image if isinstance(item.image, (ImageList, VideoInput)) else None
        q.add(s, given.expected if given else None, (item.source, item.base_dir), keep, order,
              media)
