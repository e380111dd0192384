"""Thresholds from the user's labels: per yes/no question, the P(yes) threshold that meets a
target with the best other side (``vlmbatch calibrate``), and the policy that carries them.

A question answers yes when ``p_yes >= threshold`` (``pipeline/records.py``), so the
operating points are the distinct P(yes) values of its labelled lines: at threshold ``t``,
``tp(t)`` / ``fp(t)`` count the lines with ``p_yes >= t`` expected yes / no. Targets:

    precision >= v   the highest recall among the points that reach it
    recall >= v      the highest precision among those
    fpr <= v         (--max-fpr) the highest recall (true-positive rate) among those
    f1               the highest F1

Ties go to the better target side, then the higher threshold (fewer yes answers). The
threshold written is midway between the chosen point's P(yes) and the next lower one among
the labelled lines (the chosen value itself at the lowest point): the labelled lines answer
exactly as at the point, and an unseen P(yes) between the two falls on the nearer side. A target
that no point reaches gives the point closest to it (the highest precision, the lowest
false-positive rate), flagged ``reachable=False``; a question with no "yes" label has no
threshold (``None``) and is left out of a written policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.engine.config import ConfigError
from vlmbatch.labels.read import Scored

TARGETS = ("precision", "recall", "max_fpr", "f1")


@dataclass(frozen=True)
class Target:
    kind: str  # one of TARGETS
    value: float | None = None  # None for f1

    def __post_init__(self) -> None:
        if self.kind not in TARGETS:
            raise ConfigError(f"target {self.kind!r} not one of {TARGETS}")
        if (self.value is None) != (self.kind == "f1"):
            need = "takes no" if self.kind == "f1" else "needs a"
            raise ConfigError(f"a {self.kind} target {need} value")
        if self.value is not None and not 0.0 <= self.value <= 1.0:
            raise ConfigError(f"--{self.kind.replace('_', '-')} must be in [0, 1], got "
                              f"{self.value}")

    def text(self) -> str:
        return {"precision": f"precision >= {self.value}", "recall": f"recall >= {self.value}",
                "max_fpr": f"false-positive rate <= {self.value}", "f1": "best F1"}[self.kind]


@dataclass(frozen=True)
class Curve:
    """One question's operating points, thresholds descending (all ``[K]``)."""
    thresholds: np.ndarray  # float64, the distinct P(yes) values
    tp: np.ndarray  # int64: lines with p_yes >= threshold expected yes
    fp: np.ndarray  # int64: ... expected no
    positives: int
    negatives: int

    @property
    def precision(self) -> np.ndarray:
        return self.tp / np.maximum(self.tp + self.fp, 1)  # >= 1 line at every threshold

    @property
    def recall(self) -> np.ndarray:
        return self.tp / max(self.positives, 1)

    @property
    def fpr(self) -> np.ndarray:
        return self.fp / max(self.negatives, 1)

    @property
    def f1(self) -> np.ndarray:
        return 2 * self.tp / np.maximum(self.tp + self.fp + self.positives, 1)

    @property
    def auroc(self) -> float | None:
        """The area under the ROC curve from (0, 0) through every point, trapezoids between
        them: the Mann-Whitney statistic, a tie counting 1/2 (``metrics.auroc``); None
        without both classes."""
        if not self.positives or not self.negatives:
            return None
        x, y = np.r_[0.0, self.fpr], np.r_[0.0, self.recall]
        return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1])) / 2)


def curve(p_yes: np.ndarray, actual: np.ndarray) -> Curve:
    """``p_yes`` float ``[N]``, ``actual`` bool ``[N]`` (expected yes)."""
    order = np.argsort(-p_yes, kind="mergesort")
    s, a = p_yes[order], actual[order]
    last = np.r_[s[1:] != s[:-1], True]  # the last line of each run of equal scores
    tp, fp = np.cumsum(a)[last], np.cumsum(~a)[last]
    return Curve(s[last].astype(np.float64), tp.astype(np.int64), fp.astype(np.int64),
                 int(a.sum()), int((~a).sum()))


@dataclass(frozen=True)
class Operating:
    """The chosen point of one question (metrics at its threshold; None without one)."""
    question_id: str
    question: str
    threshold: float | None
    precision: float | None
    recall: float | None
    fpr: float | None
    f1: float | None
    positives: int  # labelled yes (the support of "yes")
    labelled: int  # answered labelled lines
    reachable: bool

    def as_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("threshold", "precision", "recall", "fpr", "f1",
                                              "positives", "labelled", "reachable")}


Key = Callable[[Curve], tuple[np.ndarray, ...]]
# (feasible mask, ranking keys when feasible, ranking keys when nothing is): keys maximised
# in order, the threshold last
_RULES: dict[str, tuple[Callable[[Curve, float], np.ndarray], Key, Key]] = {
    "precision": (lambda c, v: c.precision >= v, lambda c: (c.recall, c.precision),
                  lambda c: (c.precision, c.recall)),
    "recall": (lambda c, v: c.recall >= v, lambda c: (c.precision, c.recall),
               lambda c: (c.recall, c.precision)),
    "max_fpr": (lambda c, v: c.fpr <= v, lambda c: (c.recall, -c.fpr),
                lambda c: (-c.fpr, c.recall)),
    "f1": (lambda c, v: np.ones(len(c.thresholds), bool), lambda c: (c.f1, c.precision),
           lambda c: (c.f1, c.precision)),
}


def choose(c: Curve, target: Target) -> tuple[int, bool]:
    """(index into ``c``'s points, whether the target is reached)."""
    feasible_of, key, fallback = _RULES[target.kind]
    ok = feasible_of(c, target.value if target.value is not None else 0.0)
    reachable = bool(ok.any())
    keys = key(c) if reachable else fallback(c)
    # np.lexsort sorts by its last key first: the threshold is the final tie-break
    order = np.lexsort((c.thresholds, *reversed(keys)))
    ranked = order[ok[order]] if reachable else order
    return int(ranked[-1]), reachable


def calibrate(pairs: list[tuple[Scored, str]], target: Target
              ) -> list[tuple[Operating, Curve]]:
    """The chosen point and the curve of each yes/no question among ``pairs`` (labelled
    answered lines and their expected answers; label-set and failed lines are skipped),
    questions in first-seen order."""
    per_q: dict[str, list[tuple[Scored, str]]] = {}
    for s, e in pairs:
        if s.error is None and not s.is_label_set:
            per_q.setdefault(s.question_id, []).append((s, e))
    out = []
    for qid, qp in per_q.items():
        p = np.array([float(s.p_yes or 0.0) for s, _ in qp])
        c = curve(p, np.array([e == "yes" for _, e in qp], dtype=bool))
        out.append((_operating(qid, qp[0][0].question, c, target), c))
    return out


def _operating(qid: str, text: str, c: Curve, target: Target) -> Operating:
    n = c.positives + c.negatives
    if not c.positives:
        return Operating(qid, text, None, None, None, None, None, 0, n, False)
    i, reachable = choose(c, target)
    threshold = _between(c.thresholds, i)
    return Operating(qid, text, threshold, float(c.precision[i]),
                     float(c.recall[i]), float(c.fpr[i]) if c.negatives else None,
                     float(c.f1[i]), c.positives, n, reachable)


def _between(t: np.ndarray, i: int) -> float:
    """Midway between point ``i``'s P(yes) and the next lower one, in 7 decimals when that
    stays strictly between them (result lines hold P(yes) in 6)."""
    if i + 1 == len(t):
        return float(t[i])
    mid = float((t[i] + t[i + 1]) / 2)
    short = round(mid, 7)
    return short if t[i + 1] < short <= t[i] else mid


def _f(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.4f}"


def table(ops: list[Operating], target: Target) -> str:
    """What ``vlmbatch calibrate`` prints: one row per question."""
    lines = [f"target: {target.text()} (yes when p_yes >= threshold)",
             f"{'question':<16} {'threshold':>9} {'precision':>9} {'recall':>7} "
             f"{'fpr':>7} {'f1':>7} {'support':>9} {'reachable':>9}"]
    for o in ops:
        support = f"{o.positives}/{o.labelled}"
        lines.append(f"{o.question_id:<16} {_f(o.threshold):>9} {_f(o.precision):>9} "
                     f"{_f(o.recall):>7} {_f(o.fpr):>7} {_f(o.f1):>7} {support:>9} "
                     f"{'yes' if o.reachable else 'no':>9}")
    lines.append("support: labelled yes / labelled answered lines")
    return "\n".join(lines)


def write_policy(path: Path, ops: list[Operating], target: Target, texts: dict[str, set[str]],
                 label_sets: Mapping[str, tuple[str, tuple[str, ...]]] | None = None) -> int:
    """A policy (``inputs/manifest.py``'s format) asking each calibrated question with its
    threshold, then each label-set question of ``label_sets`` (id -> (text, choices)) as it
    was asked, uncalibrated (a comment says so: its answer is its most probable choice, no
    threshold applies), written whole or not at all; returns how many questions it holds.
    ``texts``: each question id's texts among the results (a policy asks one text of every
    image, so an id asked in several wordings is refused)."""
    label_sets = label_sets or {}
    several = sorted(q for q, t in texts.items() if len(t) > 1)
    if several:
        raise ConfigError(f"--write-policy: question(s) {several} were asked in several "
                          "wordings; a policy asks one text of every image")
    kept = [o for o in ops if o.threshold is not None]
    if not kept:
        raise ConfigError("--write-policy: no question could be calibrated (none has a "
                          "'yes' label)")
    head = [f"# Written by `vlmbatch calibrate` for {target.text()}: a question answers yes "
            "when p_yes >= its threshold."]
    head += [f"# {o.question_id}: target not reached; the threshold is the closest point"
             for o in kept if not o.reachable]
    head += [f"# {o.question_id}: left out (no 'yes' label to calibrate on)"
             for o in ops if o.threshold is None]
    head += [f"# {q}: a label set, carried over as asked and not calibrated (its answer is "
             "its most probable choice; no threshold applies)" for q in label_sets]
    questions: list[dict[str, Any]] = [
        {"id": o.question_id, "text": o.question, "threshold": o.threshold} for o in kept]
    questions += [{"id": q, "text": text, "choices": list(choices)}
                  for q, (text, choices) in label_sets.items()]
    body = yaml.safe_dump({"questions": questions}, sort_keys=False, allow_unicode=True,
                          width=100)
    with replaced_on_success(Path(path)) as part:
        Path(part).write_text("\n".join(head) + "\n" + body, encoding="utf-8")
    return len(questions)
