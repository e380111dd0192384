"""A labelled evaluation: result lines joined with the user's labels, scored per question
(``vlmbatch eval MANIFEST``; the maths in ``metrics.py``).

``join`` pairs each labelled result line with its label (validated: yes/no for a yes/no
line, one of its choices for a label-set line); ``evaluate`` scores them:

- accuracy: answered lines whose answer (yes/no at the question's threshold, or the label)
  equals the label, over answered lines; failed lines are counted apart, never as wrong;
- a yes/no question: precision, recall and F1 of "yes", AUROC of P(yes), ECE of P(yes);
- a label-set question: precision, recall and F1 macro-averaged over its classes (each
  class's are in ``per_class``), AUROC macro one-vs-rest over the classes that have both
  outcomes, top-label ECE, and the confusion matrix (rows expected, columns predicted).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vlmbatch.labels.metrics import auroc, confusion, ece, precision_recall_f1
from vlmbatch.labels.read import Key, Label, Scored
from vlmbatch.pipeline.questions import YES_NO, ManifestError


@dataclass(frozen=True)
class Joined:
    pairs: list[tuple[Scored, str]]  # (result line, its expected answer), in results order
    missing: int  # labels without a result line (an image not answered yet, a wrong id)
    unlabelled: int  # result lines without a label


def join(results: Iterable[Scored], labels: Mapping[Key, Label]) -> Joined:
    pairs: list[tuple[Scored, str]] = []
    seen: set[Key] = set()
    unlabelled = 0
    for s in results:
        label = labels.get((s.image_id, s.question_id))
        if label is None:
            unlabelled += 1
            continue
        seen.add((s.image_id, s.question_id))
        if s.error is None:
            allowed = s.choices if s.is_label_set else YES_NO
            if label.expected not in allowed:
                kind = "label-set" if s.is_label_set else "yes/no"
                raise ManifestError(f"{label.where}: expected {label.expected!r} for image "
                                    f"{s.image_id!r} question {s.question_id!r}, a {kind} "
                                    f"question: one of {list(allowed)}")
        pairs.append((s, label.expected))
    return Joined(pairs, len(labels.keys() - seen), unlabelled)


@dataclass(frozen=True)
class ClassMetrics:
    label: str
    support: int  # answered lines expecting it
    precision: float | None
    recall: float | None
    f1: float | None


@dataclass(frozen=True)
class QuestionMetrics:
    question_id: str
    kind: str  # "yes/no" or "labels"
    labelled: int  # labelled lines, failed ones included
    answered: int
    correct: int
    precision: float | None  # yes/no: of "yes"; labels: macro over the classes
    recall: float | None
    f1: float | None
    auroc: float | None
    ece: float | None
    classes: tuple[str, ...]  # the confusion matrix's order ("yes", "no" for yes/no)
    confusion: tuple[tuple[int, ...], ...]
    per_class: tuple[ClassMetrics, ...] = ()  # labels only

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.answered if self.answered else None

    def as_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": self.kind, "labelled": self.labelled, "answered": self.answered,
            "failed": self.labelled - self.answered, "accuracy": self.accuracy,
            "precision": self.precision, "recall": self.recall, "f1": self.f1,
            "auroc": self.auroc, "ece": self.ece, "classes": list(self.classes),
            "confusion": [list(r) for r in self.confusion]}
        if self.per_class:
            d["per_class"] = {c.label: {"support": c.support, "precision": c.precision,
                                        "recall": c.recall, "f1": c.f1} for c in self.per_class}
        return d


@dataclass(frozen=True)
class EvalReport:
    questions: tuple[QuestionMetrics, ...]
    missing: int
    unlabelled: int

    @property
    def labelled(self) -> int:
        return sum(q.labelled for q in self.questions)

    @property
    def answered(self) -> int:
        return sum(q.answered for q in self.questions)

    @property
    def accuracy(self) -> float | None:
        correct = sum(q.correct for q in self.questions)
        return correct / self.answered if self.answered else None

    def as_json(self) -> dict[str, Any]:
        return {"labelled": self.labelled, "answered": self.answered,
                "failed": self.labelled - self.answered, "missing": self.missing,
                "accuracy": self.accuracy,
                "questions": {q.question_id: q.as_json() for q in self.questions}}


def evaluate(joined: Joined) -> EvalReport:
    per_q: dict[str, list[tuple[Scored, str]]] = {}
    for s, expected in joined.pairs:
        per_q.setdefault(s.question_id, []).append((s, expected))
    return EvalReport(tuple(question_metrics(q, p) for q, p in per_q.items()),
                      joined.missing, joined.unlabelled)


def question_metrics(qid: str, pairs: list[tuple[Scored, str]]) -> QuestionMetrics:
    """One question's metrics; its answered lines must be all yes/no or all label sets."""
    ok = [(s, e) for s, e in pairs if s.error is None]
    kinds = {s.is_label_set for s, _ in ok}
    if len(kinds) > 1:
        raise ManifestError(f"question {qid!r} is a yes/no question on some lines and a "
                            f"label-set one on others (e.g. {ok[0][0].where}); give them "
                            "different ids")
    expected = [e for _, e in ok]
    predicted = [str(s.answer) for s, _ in ok]
    correct = sum(p == e for p, e in zip(predicted, expected))
    if kinds == {True}:
        return _label_set(qid, len(pairs), ok, expected, predicted, correct)
    actual = np.array([e == "yes" for e in expected], dtype=bool)
    p_yes = np.array([float(s.p_yes or 0.0) for s, _ in ok])
    prec, rec, f1 = precision_recall_f1(np.array([p == "yes" for p in predicted], bool),
                                        actual)
    cm = confusion(expected, predicted, YES_NO)
    return QuestionMetrics(qid, "yes/no", len(pairs), len(ok), correct, prec, rec, f1,
                           auroc(p_yes, actual), ece(p_yes, actual), YES_NO, _rows(cm))


def _label_set(qid: str, labelled: int, ok: list[tuple[Scored, str]], expected: list[str],
               predicted: list[str], correct: int) -> QuestionMetrics:
    classes = tuple(dict.fromkeys(c for s, _ in ok for c in s.choices))  # first-seen order
    exp, pred = np.array(expected, dtype=object), np.array(predicted, dtype=object)
    per_class, aucs = [], []
    for c in classes:
        actual = exp == c
        per_class.append(ClassMetrics(c, int(actual.sum()),
                                      *precision_recall_f1(pred == c, actual)))
        score = np.array([dict(s.probs or ()).get(c, 0.0) for s, _ in ok])
        if (a := auroc(score, actual)) is not None:
            aucs.append(a)
    conf = np.array([float(s.confidence or 0.0) for s, _ in ok])
    return QuestionMetrics(
        qid, "labels", labelled, len(ok), correct, _macro(per_class, "precision"),
        _macro(per_class, "recall"), _macro(per_class, "f1"),
        float(np.mean(aucs)) if aucs else None, ece(conf, exp == pred), classes,
        _rows(confusion(expected, predicted, classes)), tuple(per_class))


def _macro(per_class: list[ClassMetrics], name: str) -> float | None:
    """The mean over the classes where it is defined (sklearn's ``zero_division`` aside:
    an undefined value is left out, not counted as 0)."""
    vals = [v for c in per_class if (v := getattr(c, name)) is not None]
    return float(np.mean(vals)) if vals else None


def _rows(m: np.ndarray) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(x) for x in row) for row in m)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def report_text(r: EvalReport) -> str:
    """The table ``vlmbatch eval MANIFEST`` prints: a summary line, a row per question, and
    each label-set question's confusion matrix."""
    failed = r.labelled - r.answered
    lines = [f"labelled evaluation: {r.answered} answered of {r.labelled} labelled lines "
             f"({failed} failed, {r.missing} labels without a result); accuracy "
             f"{_f(r.accuracy)}",
             f"{'question':<16} {'kind':<7} {'n':>5} {'accuracy':>8} {'precision':>9} "
             f"{'recall':>7} {'f1':>7} {'auroc':>7} {'ece':>7}"]
    for q in r.questions:
        lines.append(f"{q.question_id:<16} {q.kind:<7} {q.answered:>5} {_f(q.accuracy):>8} "
                     f"{_f(q.precision):>9} {_f(q.recall):>7} {_f(q.f1):>7} "
                     f"{_f(q.auroc):>7} {_f(q.ece):>7}")
    for q in (q for q in r.questions if q.kind == "labels"):
        width = max(6, *(len(c) for c in q.classes))
        lines.append(f"{q.question_id}: confusion (rows expected, columns predicted)")
        lines.append(" " * (width + 2) + " ".join(f"{c:>{width}}" for c in q.classes))
        for c, row in zip(q.classes, q.confusion):
            lines.append(f"  {c:<{width}}" + " ".join(f"{n:>{width}}" for n in row))
    return "\n".join(lines)
