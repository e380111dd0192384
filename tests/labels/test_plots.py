"""``calibrate --plots``' PR and ROC curves as matplotlib objects (``labels/plots.py``), not
pixels: one question never hidden under another (each its own colour, line style, width and
marker), no colour that contradicts a question's name, the target's line, each question's
AUROC in the legend (equal to ``metrics.auroc``)."""

from __future__ import annotations

import numpy as np
import pytest

from vlmbatch.labels.calibration import Curve, Target, _operating, curve
from vlmbatch.labels.metrics import auroc
from vlmbatch.labels.plots import COLOURS, colours, curve_figures

pytest.importorskip("matplotlib")


def _curves(scores: dict[str, tuple[np.ndarray, np.ndarray]], target: Target
            ) -> list[tuple]:
    out = []
    for qid, (p, actual) in scores.items():
        c = curve(p, actual)
        out.append((_operating(qid, f"{qid}?", c, target), c))
    return out


def test_curve_auroc_is_the_mann_whitney_statistic() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(2, 40))
        p = rng.integers(0, 6, n) / 5  # many ties
        actual = rng.random(n) < 0.5
        c: Curve = curve(p, actual)
        want = auroc(p, actual)
        assert (c.auroc is None) == (want is None)
        if want is not None:
            assert c.auroc == pytest.approx(want, abs=1e-12)


def test_no_question_hides_another_and_none_contradicts_its_name() -> None:
    """``red`` and ``circle`` ranked perfectly draw the same PR and ROC line: before, the
    second covered the first in one style (and ``red`` was drawn in blue)."""
    rng = np.random.default_rng(1)
    actual = rng.random(40) < 0.4
    perfect = np.where(actual, 0.9, 0.1) + rng.random(40) * 0.01
    noisy = np.clip(actual * 0.3 + rng.random(40) * 0.7, 0, 1)
    target = Target("precision", 0.95)
    data = {"red": (perfect, actual), "circle": (perfect.copy(), actual),
            "three": (noisy, actual), "blue_sky": (noisy.copy(), actual)}
    figs = curve_figures(_curves(data, target), target)
    for name, fig in figs.items():
        ax = fig.axes[0]
        lines = [ln for ln in ax.get_lines() if ln.get_label() and
                 not ln.get_label().startswith(("_", "target"))]
        assert [ln.get_label().split(":")[0] for ln in lines] == list(data)
        styles = [ln.get_linestyle() for ln in lines]
        widths = [ln.get_linewidth() for ln in lines]
        assert len(set(styles)) == 4 and widths == sorted(widths, reverse=True)
        assert len(set(widths)) == 4  # the first drawn widest: those on top leave it seen
        colour = {ln.get_label().split(":")[0]: ln.get_color() for ln in lines}
        assert colour["red"] == COLOURS["red"] and colour["blue_sky"] == COLOURS["blue"]
        assert len(set(colour.values())) == 4
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        for qid, (p, a) in data.items():
            assert f"{qid}: AUROC {auroc(p, a):.3f}" in legend
        markers = [ln for ln in ax.get_lines() if ln.get_label().startswith("_")
                   and len(ln.get_xdata()) == 1]  # the chosen points
        assert len({m.get_marker() for m in markers}) == 4
        assert [m.get_color() for m in markers] == [colour[q] for q in data]
        if name == "pr":  # precision >= 0.95: a horizontal line at 0.95
            (t,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("target")]
            assert list(t.get_ydata()) == [0.95, 0.95]
            assert "target: precision >= 0.95" in legend
        else:  # not a straight line on ROC axes: none drawn
            assert not [ln for ln in ax.get_lines() if ln.get_label().startswith("target")]


@pytest.mark.parametrize("kind,plot,vertical", [("recall", "pr", True),
                                                ("recall", "roc", False),
                                                ("max_fpr", "roc", True)])
def test_the_target_line(kind: str, plot: str, vertical: bool) -> None:
    rng = np.random.default_rng(2)
    actual = rng.random(30) < 0.5
    target = Target(kind, 0.3)
    fig = curve_figures(_curves({"q": (rng.random(30), actual)}, target), target)[plot]
    (t,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("target")]
    xs, ys = list(t.get_xdata()), list(t.get_ydata())
    assert (xs if vertical else ys) == [0.3, 0.3]


def test_colours() -> None:
    """A colour word in an id gives that colour; the palette skips the colours so named."""
    got = colours(["q1", "Red_flag", "grey", "q2"])
    assert got[1] == COLOURS["red"] and got[2] == COLOURS["gray"]
    assert got[0] != got[3] and not {got[0], got[3]} & {COLOURS["red"], COLOURS["gray"],
                                                        "#d55e00", "#7f7f7f"}
