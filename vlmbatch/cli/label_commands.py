"""The commands over labels and recorded results, which load no model: ``calibrate``,
``report`` and ``review`` (the command line -> its config root -> ``labels/calibration.py``,
``labels/plots.py``, ``labels/report.py`` or ``labels/review/``, and the exit code).
Imported only when one of them runs (``commands.HANDLERS``); ``report`` imports Pillow,
``calibrate --plots`` matplotlib.
"""

from __future__ import annotations

import json
import sys

from vlmbatch.cli.args import CommandLine
from vlmbatch.cli.commands import EXIT_OK
from vlmbatch.cli.config import CalibrateConfig, ReportConfig, ReviewConfig
from vlmbatch.common.options import build
from vlmbatch.labels.calibration import Target, calibrate, table, write_policy
from vlmbatch.labels.evaluation import join
from vlmbatch.labels.plots import curve_plots
from vlmbatch.labels.read import read_labels, read_results
from vlmbatch.labels.report import write_report
from vlmbatch.labels.review import Studio, export_tasks, import_labels
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.questions import ManifestError


def cmd_calibrate(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    cfg = build(CalibrateConfig, line.typed)
    target = Target(*cfg.target)
    joined = join(read_results(cfg.results), read_labels(cfg.labels))
    if not joined.pairs:
        raise ManifestError(f"{cfg.labels}: none of its {joined.missing} label(s) matches a "
                            f"result line of {cfg.results} ({joined.unlabelled} lines) by image id "
                            "and question id: were the labels written for these results?")
    chosen = calibrate(joined.pairs, target)
    ops = [o for o, _ in chosen]
    if cfg.json:
        print(json.dumps({"target": {"kind": target.kind, "value": target.value},
                          "missing": joined.missing,
                          "questions": {o.question_id: o.as_json() for o in ops}}))
    else:
        print(table(ops, target))
    if joined.missing:
        print(f"vlmbatch: {joined.missing} labels have no result line (not answered, or "
              "another id)", file=sys.stderr)
    if cfg.plots is not None:
        paths = curve_plots(chosen, target, cfg.plots)
        print(f"vlmbatch: wrote {', '.join(map(str, paths))}", file=sys.stderr)
    if cfg.write_policy is not None:
        texts: dict[str, set[str]] = {}
        label_sets: dict[str, tuple[str, tuple[str, ...]]] = {}
        for s, _ in joined.pairs:
            texts.setdefault(s.question_id, set()).add(s.question)
            if s.is_label_set:
                label_sets.setdefault(s.question_id, (s.question, s.choices))
        n = write_policy(cfg.write_policy, ops, target, texts, label_sets)
        carried = f", {len(label_sets)} of them label sets carried over uncalibrated" \
            if label_sets else ""
        print(f"vlmbatch: wrote {cfg.write_policy} ({n} questions{carried})", file=sys.stderr)
    return EXIT_OK


def cmd_report(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    cfg = build(ReportConfig, line.typed)
    r = write_report(cfg.job, cfg.out, cfg.borderline, cfg.thumb_size, cfg.labels)
    print(f"vlmbatch: wrote {cfg.out} ({len(r.questions)} questions, "
          f"{sum(r.errors.values())} failed images)", file=sys.stderr)
    return EXIT_OK


def cmd_review(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    cfg = build(ReviewConfig, line.typed)
    studio = None if cfg.url is None else Studio(cfg.url, cfg.api_key, cfg.project)
    if cfg.action == "export":
        assert cfg.source is not None  # ReviewConfig's check
        export_tasks(cfg.source, cfg.out, cfg.config_out, cfg.questions, cfg.borderline,
                     cfg.limit, cfg.document_root, studio)
    else:
        import_labels(cfg.source, cfg.out, studio)
    return EXIT_OK
