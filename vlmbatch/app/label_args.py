"""The parsers of the labelled-data commands: ``calibrate`` and ``report`` (``eval
MANIFEST``'s options are ``eval``'s, in ``args.py``). Light, as every parser module is:
each option's ``dest`` is its field of ``app/config.py``'s ``CalibrateConfig`` /
``ReportConfig``; the commands run in ``label_commands.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmbatch.app.config import ReportConfig
from vlmbatch.engine.config import default_of

LABELS_HELP = ('labels: a JSONL file, one line per (image id, question id): {"id": "a1", '
               '"question_id": "red", "expected": "yes"} (other keys ignored); or the '
               'manifest itself, its questions carrying "expected" ("yes"/"no", or one of a '
               "label-set question's choices). Told apart by the first line (a manifest's "
               'has "image")')


def probability(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {v}")
    return v


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "calibrate", help="thresholds from your labels: per yes/no question, the P(yes) "
        "threshold meeting a precision, recall or false-positive target",
        description="Join result lines with your labels and choose, per yes/no question, the "
        "threshold (yes when p_yes >= it) that meets the target with the best other side: "
        "--precision P the highest recall at precision >= P, --recall R the highest "
        "precision at recall >= R, --max-fpr F the highest recall at a false-positive rate "
        "<= F, --f1 the best F1. Prints a table (threshold, precision, recall, support, "
        "whether the target is reachable; an unreachable one gets the closest point); "
        "--plots DIR writes PR and ROC curves, --write-policy a policy with the thresholds.")
    c.add_argument("results", type=Path, help="result lines: a results .jsonl (`vlmbatch run "
                   "-o`, `vlmbatch results JOB`) or a job folder")
    c.add_argument("--labels", type=Path, required=True, help=LABELS_HELP)
    t = c.add_mutually_exclusive_group(required=True)
    t.add_argument("--precision", type=probability, help="target: precision >= P")
    t.add_argument("--recall", type=probability, help="target: recall >= R")
    t.add_argument("--max-fpr", type=probability, help="target: false-positive rate <= F")
    t.add_argument("--f1", action="store_true", help="target: the best F1")
    c.add_argument("--plots", type=Path, help="folder for pr.png and roc.png, each question "
                   "in its own colour, line style and marker, its AUROC in the legend, the "
                   "target as a line (matplotlib: pip install 'vlmbatch[plots]')")
    c.add_argument("--write-policy", type=Path, metavar="P.yaml",
                   help="write a policy asking each calibrated question with its threshold")
    c.add_argument("--json", action="store_true", help="the table as one JSON object")


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "report", help="one self-contained HTML page about a job: counts, errors, P(yes) "
        "histograms, borderline images, right and wrong answers",
        description="Write one HTML file (no outside resources: thumbnails embedded) with the "
        "job's counts, QPM and failed images by error kind; per question its yes-rate and "
        "P(yes) histogram on a log-odds axis (a label-set question: its label distribution), "
        "a contact sheet of its borderline images (log-odds within 1 of the threshold's; "
        "a label set: its top two choices within a factor e), or a line saying none is near; "
        "when the manifest's questions carried \"expected\", each answer shown marked right "
        "or wrong, the counts of each and a sheet of the most confident wrong answers.")
    r.add_argument("job", type=Path, help="a job folder (`vlmbatch submit`)")
    r.add_argument("--out", "-o", type=Path, required=True, help="the .html file to write")
    r.add_argument("--borderline", type=int, default=default_of(ReportConfig, "borderline"),
                   help="images per question's contact sheet (default %(default)s)")
    r.add_argument("--thumb-size", type=int, default=default_of(ReportConfig, "thumb_size"),
                   help="thumbnail size in pixels, the longer side (default %(default)s)")

