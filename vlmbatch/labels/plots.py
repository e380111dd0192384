"""PR and ROC curves of ``vlmbatch calibrate`` as PNG files (matplotlib, the optional
``plots`` extra).

Drawn on matplotlib's Agg canvas through its object API (``Figure``, never ``pyplot``): no
display, no global figure state. The only module that imports matplotlib, and nothing the
parser imports imports it: ``vlmbatch --help`` never pays for it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.labels.calibration import Curve, Operating, Target

try:  # optional dependency: the plots extra
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
except ModuleNotFoundError:  # --plots says how to install it
    Figure = None  # type: ignore[assignment,misc]


def curve_plots(curves: list[tuple[Operating, Curve]], target: Target, out_dir: Path
                ) -> list[Path]:
    """``out_dir/pr.png`` (precision against recall) and ``out_dir/roc.png`` (true- against
    false-positive rate), a line per question and its chosen point marked; returns both."""
    if Figure is None:
        raise ImportError("--plots needs matplotlib: pip install 'vlmbatch[plots]'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shown = [(o, c) for o, c in curves if c.positives]
    paths = []
    for name, x_label, y_label in (("pr", "recall", "precision"),
                                   ("roc", "false-positive rate", "true-positive rate")):
        fig = Figure(figsize=(6, 5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for o, c in shown:
            xs, ys = ((c.recall, c.precision) if name == "pr"  # from (0, 0): nothing yes
                      else (np.r_[0.0, c.fpr], np.r_[0.0, c.recall]))
            (line,) = ax.plot(xs, ys, drawstyle="steps-post" if name == "pr" else "default",
                              label=o.question_id)
            point = (o.recall, o.precision) if name == "pr" else (o.fpr or 0.0, o.recall)
            ax.plot([float(point[0] or 0.0)], [float(point[1] or 0.0)], "o",
                    color=line.get_color(), markersize=7)
        ax.set(xlim=(-0.02, 1.02), ylim=(-0.02, 1.02), xlabel=x_label, ylabel=y_label,
               title=f"{name.upper()} curves, points chosen for {target.text()}")
        ax.grid(alpha=0.3)
        if shown:
            ax.legend(loc="lower right" if name == "roc" else "lower left", fontsize=8)
        path = out_dir / f"{name}.png"
        with replaced_on_success(path) as part:
            fig.savefig(part, format="png")
        paths.append(path)
    return paths
