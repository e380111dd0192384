"""PR and ROC curves of ``vlmbatch calibrate`` as PNG files (matplotlib, the optional
``plots`` extra).

Each question is told apart by three things, so none hides another where their curves
coincide (two questions ranked perfectly draw the same line): its colour, its line style
(solid, dashed, dash-dot, dotted, in turn) and its width (the first drawn widest, each next
one narrower on top of it); its chosen point has a marker of its own. A question whose id
names a colour (``red``, ``blue_sky``: ``COLOURS``) is drawn in that colour, the others in
a colour-blind-safe palette skipping the colours so named, so no legend entry contradicts
its colour. The legend gives each question's AUROC (``Curve.auroc``, the same on both
plots), and the target is a line where it is one on the plot's axes (precision: PR's
horizontal line; recall: PR's vertical, ROC's horizontal; a false-positive rate: ROC's
vertical).

Drawn on matplotlib's Agg canvas through its object API (``Figure``, never ``pyplot``): no
display, no global figure state. The only module that imports matplotlib, and nothing the
parser imports imports it: ``vlmbatch --help`` never pays for it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.labels.calibration import Curve, Operating, Target

try:  # optional dependency: the plots extra
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
except ModuleNotFoundError:  # --plots says how to install it
    Figure = None  # type: ignore[assignment,misc]

# a colour word in a question's id -> the colour it is drawn in
COLOURS = {"red": "#d62728", "green": "#2ca02c", "blue": "#1f77b4", "orange": "#ff7f0e",
           "purple": "#9467bd", "brown": "#8c564b", "pink": "#e377c2", "gray": "#7f7f7f",
           "grey": "#7f7f7f", "black": "#000000", "teal": "#008080", "yellow": "#bcbd22"}
# the others', in turn (Okabe-Ito's colour-blind-safe set), each named for the skip
PALETTE = [("blue", "#0072b2"), ("orange", "#e69f00"), ("green", "#009e73"),
           ("pink", "#cc79a7"), ("blue", "#56b4e9"), ("red", "#d55e00"), ("black", "#000000"),
           ("purple", "#6a3d9a"), ("brown", "#8c564b"), ("gray", "#7f7f7f")]
STYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
PLOTS = {"pr": ("recall", "precision"), "roc": ("false-positive rate", "true-positive rate")}


def colours(ids: list[str]) -> list[str]:
    """Each question's colour: the one its id names, else the palette's next whose name no
    id uses (the palette again from its start when every one is used)."""
    named = [next((w for w in re.findall(r"[a-z]+", qid.lower()) if w in COLOURS), None)
             for qid in ids]
    taken = {"gray" if n == "grey" else n for n in named if n is not None}
    free = iter([c for name, c in PALETTE if name not in taken] or [c for _, c in PALETTE])
    return [COLOURS[n] if n is not None else next(free, "#444444") for n in named]


def curve_figures(curves: list[tuple[Operating, Curve]], target: Target) -> dict[str, Any]:
    """``{"pr": Figure, "roc": Figure}``: a line per question with a "yes" label, its chosen
    point marked, the target's line, AUROC in the legend."""
    if Figure is None:
        raise ImportError("--plots needs matplotlib: pip install 'vlmbatch[plots]'")
    shown = [(o, c) for o, c in curves if c.positives]
    colour = colours([o.question_id for o, _ in shown])
    widths = np.linspace(4.0, 1.5, len(shown)) if len(shown) > 1 else np.array([2.0])
    sizes = widths * 3.0  # markers, as lines: the first drawn largest
    figs = {}
    for name, (x_label, y_label) in PLOTS.items():
        fig = Figure(figsize=(6, 5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for i, (o, c) in enumerate(shown):
            auc = c.auroc
            xs, ys = ((c.recall, c.precision) if name == "pr"  # from (0, 0): nothing yes
                      else (np.r_[0.0, c.fpr], np.r_[0.0, c.recall]))
            ax.plot(xs, ys, drawstyle="steps-post" if name == "pr" else "default",
                    color=colour[i], linestyle=STYLES[i % len(STYLES)],
                    linewidth=float(widths[i]), zorder=2 + i,
                    label=f"{o.question_id}: AUROC {'-' if auc is None else f'{auc:.3f}'}")
            point = (o.recall, o.precision) if name == "pr" else (o.fpr or 0.0, o.recall)
            ax.plot([float(point[0] or 0.0)], [float(point[1] or 0.0)],
                    MARKERS[i % len(MARKERS)], color=colour[i], markeredgecolor="black",
                    markersize=float(sizes[i]), zorder=20 + i)
        _target_line(ax, name, target)
        ax.set(xlim=(-0.02, 1.02), ylim=(-0.02, 1.02), xlabel=x_label, ylabel=y_label,
               title=f"{name.upper()} curves, points chosen for {target.text()}")
        ax.grid(alpha=0.3)
        if shown:
            ax.legend(loc="lower right" if name == "roc" else "lower left", fontsize=8)
        figs[name] = fig
    return figs


def _target_line(ax: Any, plot: str, target: Target) -> None:
    """The target as a line where it is one on ``plot``'s axes (module docstring)."""
    v, label = target.value, f"target: {target.text()}"
    style = {"color": "#555555", "linestyle": (0, (1, 3)), "linewidth": 1.2, "zorder": 1,
             "label": label}
    if v is None:
        return
    if (plot, target.kind) in (("pr", "precision"), ("roc", "recall")):
        ax.axhline(v, **style)
    elif (plot, target.kind) in (("pr", "recall"), ("roc", "max_fpr")):
        ax.axvline(v, **style)


def curve_plots(curves: list[tuple[Operating, Curve]], target: Target, out_dir: Path
                ) -> list[Path]:
    """``out_dir/pr.png`` (precision against recall) and ``out_dir/roc.png`` (true- against
    false-positive rate), as ``curve_figures`` draws them; returns both paths."""
    figs = curve_figures(curves, target)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figs.items():
        path = out_dir / f"{name}.png"
        with replaced_on_success(path) as part:
            fig.savefig(part, format="png")
        paths.append(path)
    return paths
