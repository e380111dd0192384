"""The labelled evaluation's metrics (``labels/metrics.py``, ``labels/evaluation.py``) against
their definitions, computed here by brute force on fresh random data: AUROC as the
Mann-Whitney pair count (every positive-negative pair, ties half), ECE bin by bin, precision,
recall and F1 from counted cases, the confusion matrix by counting. Tolerance 1e-12 (the same
sums in another order)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vlmbatch.labels.evaluation import evaluate, join, report_text
from vlmbatch.labels.metrics import auroc, average_ranks, confusion, ece, precision_recall_f1
from vlmbatch.labels.read import Label, Scored, scored
from vlmbatch.pipeline.questions import ManifestError

TOL = 1e-12


def pair_auroc(scores: list[float], actual: list[bool]) -> float | None:
    pos = [s for s, a in zip(scores, actual) if a]
    neg = [s for s, a in zip(scores, actual) if not a]
    if not pos or not neg:
        return None
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def binned_ece(conf: list[float], outcome: list[bool], bins: int = 10) -> float:
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = [(c, o) for c, o in zip(conf, outcome)
                  if lo <= c < hi or (b == bins - 1 and c == 1.0)]
        if inside:
            gap = abs(sum(c for c, _ in inside) / len(inside)
                      - sum(o for _, o in inside) / len(inside))
            total += len(inside) / len(conf) * gap
    return total


def counted_prf(pred: list[bool], actual: list[bool]) -> tuple:
    tp = sum(p and a for p, a in zip(pred, actual))
    fp = sum(p and not a for p, a in zip(pred, actual))
    fn = sum(a and not p for p, a in zip(pred, actual))
    precision = tp / (tp + fp) if tp + fp else None
    recall = tp / (tp + fn) if tp + fn else None
    if precision and recall:  # the harmonic mean where both are defined and not 0
        f1: float | None = 2 * precision * recall / (precision + recall)
    else:  # no true positive: 0 if anything was predicted or expected positive
        f1 = 0.0 if tp + fp + fn else None
    return precision, recall, f1


def close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and abs(a - b) < TOL)


@pytest.mark.parametrize("seed", range(8))
def test_auroc_ece_and_prf_equal_their_definitions(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 120))
    actual = rng.random(n) < rng.uniform(0.1, 0.9)
    # scores that lean towards the truth, rounded so that ties happen
    scores = np.clip(actual * rng.uniform(0, 0.6) + rng.random(n) * 0.7, 0, 1).round(
        int(rng.integers(1, 4)))
    assert close(auroc(scores, actual), pair_auroc(list(scores), list(actual)))
    assert abs(ece(scores, actual) - binned_ece(list(scores), list(actual))) < TOL
    pred = scores >= rng.uniform(0.2, 0.8)
    got, want = precision_recall_f1(pred, actual), counted_prf(list(pred), list(actual))
    assert all(close(g, w) for g, w in zip(got, want)), (got, want)


def test_edge_cases_are_none_not_zero() -> None:
    yes = np.array([True, True])
    assert auroc(np.array([0.3, 0.9]), yes) is None  # no negative
    assert ece(np.array([]), np.array([], bool)) is None
    assert precision_recall_f1(np.array([False, False]), yes) == (None, 0.0, 0.0)
    assert precision_recall_f1(np.zeros(2, bool), np.zeros(2, bool)) == (None, None, None)
    assert ece(np.array([1.0, 0.0]), np.array([True, False])) == 0.0  # 1.0: the last bin
    assert auroc(np.full(4, 0.5), np.array([True, False, True, False])) == 0.5  # all tied


def test_average_ranks_share_ties() -> None:
    assert average_ranks(np.array([0.2, 0.1, 0.2, 0.9, 0.1])).tolist() == [3.5, 1.5, 3.5,
                                                                           5.0, 1.5]


def test_confusion_counts_pairs() -> None:
    rng = np.random.default_rng(3)
    classes = ["a", "b", "c"]
    exp = list(rng.choice(classes, 50))
    pred = list(rng.choice(classes, 50))
    m = confusion(exp, pred, classes)
    for (i, e), (j, p) in itertools.product(enumerate(classes), enumerate(classes)):
        assert m[i, j] == sum(x == e and y == p for x, y in zip(exp, pred))


# --- the evaluation over result lines ------------------------------------------------------

def yes_no_line(i: int, qid: str, p: float, threshold: float = 0.5) -> dict:
    return {"id": f"im{i}", "question_id": qid, "question": f"{qid}?",
            "answer": "yes" if p >= threshold else "no", "p_yes": p, "margin": 0.0,
            "image_tokens": 10, "error": None, "error_kind": None}


def label_line(i: int, qid: str, probs: dict[str, float]) -> dict:
    """A label-set line in the issue's shape: label, probs, logprobs, p_yes null."""
    return {"id": f"im{i}", "question_id": qid, "question": f"{qid}?", "answer": None,
            "label": max(probs, key=lambda c: probs[c]), "probs": probs,
            "logprobs": {c: float(np.log(p)) for c, p in probs.items()}, "p_yes": None,
            "margin": None, "image_tokens": 10, "error": None, "error_kind": None}


def failed_line(i: int, qid: str) -> dict:
    return {"id": f"im{i}", "question_id": qid, "question": f"{qid}?", "answer": None,
            "p_yes": None, "margin": None, "image_tokens": None, "error": "not decodable",
            "error_kind": "decode"}


def parsed(lines: list[dict]) -> list[Scored]:
    return [scored(d, f"r:{n}") for n, d in enumerate(lines, 1)]


def test_yes_no_and_label_set_questions_against_brute_force() -> None:
    rng = np.random.default_rng(11)
    n, classes = 60, ["safe", "sexual", "violence", "hate"]
    truth = rng.random(n) < 0.4
    p_yes = np.clip(truth * 0.5 + rng.random(n) * 0.6, 0, 1).round(3)
    logits = rng.normal(size=(n, 4))
    exp_cls = rng.integers(0, 4, n)
    logits[np.arange(n), exp_cls] += 1.5  # the model leans right
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    lines, labels = [], {}
    for i in range(n):
        lines.append(yes_no_line(i, "red", float(p_yes[i]), threshold=0.6))
        lines.append(label_line(i, "category", dict(zip(classes, map(float, probs[i])))))
        labels[(f"im{i}", "red")] = Label("yes" if truth[i] else "no", f"l:{i}")
        labels[(f"im{i}", "category")] = Label(classes[exp_cls[i]], f"l:{i}")
    lines.append(failed_line(n, "red"))
    labels[(f"im{n}", "red")] = Label("maybe", "l:failed")  # a failed line is not validated
    labels[("gone", "red")] = Label("yes", "l:gone")
    r = evaluate(join(parsed(lines), labels))
    red, cat = r.questions
    assert (red.kind, red.labelled, red.answered, r.missing) == ("yes/no", n + 1, n, 1)
    pred = p_yes >= 0.6
    assert red.correct == int(np.sum(pred == truth))
    assert all(close(g, w) for g, w in zip((red.precision, red.recall, red.f1),
                                           counted_prf(list(pred), list(truth))))
    assert close(red.auroc, pair_auroc(list(p_yes), list(truth)))
    assert abs(red.ece - binned_ece(list(p_yes), list(truth))) < TOL
    assert red.confusion == ((int(np.sum(pred & truth)), int(np.sum(~pred & truth))),
                             (int(np.sum(pred & ~truth)), int(np.sum(~pred & ~truth))))
    top = probs.argmax(1)
    assert cat.kind == "labels" and cat.classes == tuple(classes)
    assert cat.correct == int(np.sum(top == exp_cls))
    for i, j in itertools.product(range(4), range(4)):
        assert cat.confusion[i][j] == int(np.sum((exp_cls == i) & (top == j)))
    per_class = [counted_prf(list(top == c), list(exp_cls == c)) for c in range(4)]
    for k, name in enumerate(("precision", "recall", "f1")):
        vals = [pc[k] for pc in per_class if pc[k] is not None]
        assert close(getattr(cat, name), sum(vals) / len(vals))
    aucs = [pair_auroc(list(probs[:, c]), list(exp_cls == c)) for c in range(4)]
    assert close(cat.auroc, sum(a for a in aucs if a is not None) / 4)
    conf = probs.max(1)
    assert abs(cat.ece - binned_ece(list(conf), list(top == exp_cls))) < TOL
    assert close(r.accuracy, (red.correct + cat.correct) / (2 * n))
    js = r.as_json()
    assert js["questions"]["category"]["per_class"]["hate"]["support"] == int(
        np.sum(exp_cls == 3))
    text = report_text(r)
    assert "category: confusion (rows expected, columns predicted)" in text
    assert text.splitlines()[0].startswith(f"labelled evaluation: {2 * n} answered of "
                                           f"{2 * n + 1} labelled lines (1 failed, 1 labels")


def test_a_label_that_does_not_fit_its_line_names_the_label_line() -> None:
    yn = parsed([yes_no_line(0, "red", 0.9)])
    with pytest.raises(ManifestError, match=r"labels.jsonl:7: expected 'Yes' for image 'im0' "
                       r"question 'red', a yes/no question: one of \['yes', 'no'\]"):
        join(yn, {("im0", "red"): Label("Yes", "labels.jsonl:7")})
    ls = parsed([label_line(0, "cat", {"safe": 0.7, "hate": 0.3})])
    with pytest.raises(ManifestError, match=r"m.jsonl:2: expected 'violence' .* a label-set "
                       r"question: one of \['safe', 'hate'\]"):
        join(ls, {("im0", "cat"): Label("violence", "m.jsonl:2")})


def test_result_lines_are_checked() -> None:
    with pytest.raises(ManifestError, match="r:3: not a vlmbatch result line .*OpenAI"):
        scored({"custom_id": "x", "response": {}}, "r:3")
    with pytest.raises(ManifestError, match="r:4: p_yes must be a probability"):
        scored({**yes_no_line(0, "q", 0.5), "p_yes": 1.5}, "r:4")
    with pytest.raises(ManifestError, match="r:5: label 'x' is not one of its probs"):
        scored({**label_line(0, "q", {"a": 0.6, "b": 0.4}), "label": "x"}, "r:5")
    s = scored(label_line(0, "q", {"a": 0.25, "b": 0.75}), "r:6")
    assert (s.answer, s.choices, s.confidence, s.is_label_set) == ("b", ("a", "b"), 0.75, True)
    assert scored(yes_no_line(0, "q", 0.2), "r:7").confidence == pytest.approx(0.8)
