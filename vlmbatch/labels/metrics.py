"""Classification metrics over labelled answers: pure numpy, no model.

Every function takes flat arrays of one question's answered lines (failed lines are the
caller's to count apart). Undefined values are None (JSON null), never 0 or NaN: a
precision with nothing predicted positive, a recall with no positive label, an AUROC with a
class missing.

- ``auroc``: the Mann-Whitney statistic, P(score of a random positive > that of a random
  negative) + 1/2 P(tie), from average ranks (ties share their mean rank).
- ``ece``: expected calibration error, ``sum_b n_b / n * |mean(confidence in b) -
  mean(outcome in b)|`` over ``bins`` equal-width bins of [0, 1] (bin ``b`` holds
  ``[b/B, (b+1)/B)``, the last one 1.0 as well). A yes/no question's is P(yes) against
  "expected yes" (the reliability diagram of P(yes)); a label set's the top label's
  probability against "the label is right" (top-label ECE).
- ``precision_recall_f1``: of one class, the positive one.
- ``confusion``: counts, rows the expected class, columns the predicted one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ECE_BINS = 10


def _ratio(num: float, den: float) -> float | None:
    return float(num) / float(den) if den else None


def precision_recall_f1(predicted: np.ndarray, actual: np.ndarray
                        ) -> tuple[float | None, float | None, float | None]:
    """``predicted``, ``actual``: bool ``[N]`` (the positive class predicted / expected)."""
    tp = int(np.sum(predicted & actual))
    fp = int(np.sum(predicted & ~actual))
    fn = int(np.sum(~predicted & actual))
    return _ratio(tp, tp + fp), _ratio(tp, tp + fn), _ratio(2 * tp, 2 * tp + fp + fn)


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of ``x`` ``[N]``, tied values sharing the mean of their ranks."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])  # first index of each run
    ends = np.r_[starts[1:], len(xs)]
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def auroc(scores: np.ndarray, actual: np.ndarray) -> float | None:
    """``scores`` float ``[N]``, ``actual`` bool ``[N]``; None without both classes."""
    pos, neg = int(actual.sum()), int((~actual).sum())
    if not pos or not neg:
        return None
    rank_sum = float(average_ranks(np.asarray(scores, dtype=np.float64))[actual].sum())
    return (rank_sum - pos * (pos + 1) / 2.0) / (pos * neg)


def ece(confidence: np.ndarray, outcome: np.ndarray, bins: int = ECE_BINS) -> float | None:
    """``confidence`` in [0, 1] ``[N]``, ``outcome`` bool ``[N]``; None for N = 0."""
    n = len(confidence)
    if not n:
        return None
    b = np.minimum((np.asarray(confidence, dtype=np.float64) * bins).astype(np.int64),
                   bins - 1)
    conf_sum = np.bincount(b, weights=confidence, minlength=bins)
    hit_sum = np.bincount(b, weights=outcome.astype(np.float64), minlength=bins)
    return float(np.abs(conf_sum - hit_sum).sum() / n)  # n_b/n * |mean - mean| summed


def confusion(expected: Sequence[str], predicted: Sequence[str],
              classes: Sequence[str]) -> np.ndarray:
    """int64 ``[C, C]``: row ``i`` = expected ``classes[i]``, column ``j`` = predicted
    ``classes[j]``."""
    at = {c: i for i, c in enumerate(classes)}
    m = np.zeros((len(classes), len(classes)), dtype=np.int64)
    np.add.at(m, ([at[e] for e in expected], [at[p] for p in predicted]), 1)
    return m
