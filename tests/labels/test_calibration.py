"""Thresholds from labels (``labels/calibration.py``) against an exhaustive search written
here: every distinct P(yes) tried as the threshold, precision / recall / FPR counted from the
lines at or above it, the target's rule applied by sorting all candidates. Fresh random data
with ties; exact (the same counts), floats to 1e-12. The policy written reads back through
``read_policy`` with those thresholds, and answers the labelled lines as the chosen point
does."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from vlmbatch.engine.config import ConfigError
from vlmbatch.inputs.manifest import read_policy
from vlmbatch.labels.calibration import Target, calibrate, choose, curve, write_policy
from vlmbatch.labels.read import scored

TOL = 1e-12


def counts_at(p: np.ndarray, actual: np.ndarray, t: float) -> dict:
    yes = [bool(x >= t) for x in p]
    tp = sum(y and a for y, a in zip(yes, actual))
    fp = sum(y and not a for y, a in zip(yes, actual))
    pos, neg = int(sum(actual)), len(actual) - int(sum(actual))
    return {"t": t, "precision": tp / (tp + fp), "recall": tp / pos,
            "fpr": fp / neg if neg else 0.0, "f1": 2 * tp / (tp + fp + pos)}


def exhaustive(p: np.ndarray, actual: np.ndarray, target: Target) -> tuple[float, bool]:
    """The rule of the module's docstring, by trying every threshold."""
    pts = [counts_at(p, actual, float(t)) for t in sorted(set(p.tolist()))]
    v = target.value
    rules = {"precision": (lambda c: c["precision"] >= v, ("recall", "precision"),
                           ("precision", "recall")),
             "recall": (lambda c: c["recall"] >= v, ("precision", "recall"),
                        ("recall", "precision")),
             "max_fpr": (lambda c: c["fpr"] <= v, ("recall", "-fpr"), ("-fpr", "recall")),
             "f1": (lambda c: True, ("f1", "precision"), ("f1", "precision"))}
    ok, keys, fallback = rules[target.kind]
    feasible = [c for c in pts if ok(c)]
    pool, by = (feasible, keys) if feasible else (pts, fallback)

    def key(c: dict) -> tuple:
        return (*(-c[k[1:]] if k.startswith("-") else c[k] for k in by), c["t"])
    return max(pool, key=key)["t"], bool(feasible)


TARGETS = [Target("precision", 0.9), Target("precision", 0.99), Target("recall", 0.8),
           Target("recall", 1.0), Target("max_fpr", 0.05), Target("max_fpr", 0.0),
           Target("f1")]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.text())
def test_the_chosen_point_is_the_exhaustive_search_s(seed: int, target: Target) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 150))
    actual = rng.random(n) < rng.uniform(0.2, 0.8)
    actual[0], actual[1] = True, False  # both classes
    p = np.clip(actual * rng.uniform(0.1, 0.5) + rng.random(n) * 0.7, 0, 1).round(2)
    c = curve(p, actual)
    for k, t in enumerate(c.thresholds):
        want = counts_at(p, actual, float(t))
        assert abs(c.precision[k] - want["precision"]) < TOL
        assert abs(c.recall[k] - want["recall"]) < TOL and abs(c.fpr[k] - want["fpr"]) < TOL
        assert abs(c.f1[k] - want["f1"]) < TOL
    assert c.thresholds.tolist() == sorted(set(p.tolist()), reverse=True)
    i, reachable = choose(c, target)
    assert (float(c.thresholds[i]), reachable) == exhaustive(p, actual, target)


def lines_for(p: np.ndarray, actual: np.ndarray, qid: str) -> list[tuple]:
    return [(scored({"id": f"im{i}", "question_id": qid, "question": f"Is it {qid}?",
                     "answer": "yes" if x >= 0.5 else "no", "p_yes": float(x), "error": None},
                    f"r:{i}"), "yes" if a else "no") for i, (x, a) in enumerate(zip(p, actual))]


def test_the_threshold_answers_the_labelled_lines_as_the_point_does(tmp_path) -> None:
    rng = np.random.default_rng(7)
    pairs, data = [], {}
    for qid in ("red", "circle", "three"):
        actual = rng.random(80) < 0.4
        p = np.clip(actual * 0.35 + rng.random(80) * 0.65, 0, 1).round(4)
        data[qid] = (p, actual)
        pairs += lines_for(p, actual, qid)
    target = Target("precision", 0.9)
    chosen = calibrate(pairs, target)
    assert [o.question_id for o, _ in chosen] == ["red", "circle", "three"]
    for o, c in chosen:
        p, actual = data[o.question_id]
        at = counts_at(p, actual, o.threshold)  # the written threshold, not the point
        assert abs(at["precision"] - o.precision) < TOL and abs(at["recall"] - o.recall) < TOL
        i, _ = choose(c, target)
        lower = c.thresholds[i + 1] if i + 1 < len(c.thresholds) else c.thresholds[i]
        assert lower < o.threshold <= c.thresholds[i] or o.threshold == c.thresholds[i]
        assert o.positives == int(actual.sum()) and o.labelled == 80
    path = tmp_path / "p.yaml"
    texts = {qid: {f"Is it {qid}?"} for qid in data}
    assert write_policy(path, [o for o, _ in chosen], target, texts) == 3
    qs = read_policy(path)
    assert [(q.id, q.text, q.threshold) for q in qs] == [
        (o.question_id, o.question, o.threshold) for o, _ in chosen]
    assert path.read_text().startswith("# Written by `vlmbatch calibrate` for precision >= 0.9")


def test_unreachable_and_uncalibratable_questions(tmp_path) -> None:
    p = np.array([0.9, 0.8, 0.7, 0.2])
    actual = np.array([False, True, False, True])  # the top score is a "no"
    none_yes = np.array([False, False])
    pairs = lines_for(p, actual, "hard") + lines_for(np.array([0.3, 0.6]), none_yes, "never")
    (hard, _), (never, _) = calibrate(pairs, Target("max_fpr", 0.0))
    assert not hard.reachable and hard.fpr == 0.5  # the lowest FPR there is: 1 of 2 "no"s
    assert (never.threshold, never.reachable, never.positives) == (None, False, 0)
    path = tmp_path / "p.yaml"
    write_policy(path, [hard, never], Target("max_fpr", 0.0),
                 {"hard": {"Is it hard?"}, "never": {"Is it never?"}})
    text = path.read_text()
    assert "# hard: target not reached" in text and "# never: left out" in text
    assert [q.id for q in read_policy(path)] == ["hard"]
    assert yaml.safe_load(text)["questions"][0]["threshold"] == hard.threshold


def test_write_policy_refusals(tmp_path) -> None:
    (o, _), = calibrate(lines_for(np.array([0.9, 0.1]), np.array([True, False]), "q"),
                        Target("f1"))
    with pytest.raises(ConfigError, match=r"question\(s\) \['q'\] were asked in several"):
        write_policy(tmp_path / "p.yaml", [o], Target("f1"), {"q": {"A?", "B?"}})
    assert not (tmp_path / "p.yaml").exists()
    with pytest.raises(ConfigError, match="needs a value"):
        Target("precision")
    with pytest.raises(ConfigError, match=r"--max-fpr must be in \[0, 1\]"):
        Target("max_fpr", 1.5)
