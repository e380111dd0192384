"""``vlmbatch review export`` and ``review import``: the files (or the running Label Studio)
each reads and writes, and what it says on stderr."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from vlmbatch.labels.read import read_labels, read_results
from vlmbatch.labels.review.annotations import decisions, keep_latest, read_export
from vlmbatch.labels.review.export import build_tasks, label_config, tasks_json, write_text
from vlmbatch.labels.review.studio import Studio, pull_export, push_tasks

SHOWN_IDS = 20  # disagreements named on stderr (the labels file has them all)


def _say(text: str) -> None:
    print(f"vlmbatch: {text}", file=sys.stderr)


def export_tasks(job: Path, out: Path | None, config_out: Path | None,
                 questions: Sequence[str] = (), borderline: float | None = None,
                 limit: int | None = None, document_root: Path = Path("/"),
                 studio: Studio | None = None) -> int:
    """Write (or import into ``studio``) the job's tasks; the number of tasks."""
    ex = build_tasks(job, document_root, questions, borderline, limit)
    xml = label_config(ex.controls)
    if config_out is not None:
        write_text(xml, config_out)
    if out is not None:
        write_text(tasks_json(ex.tasks), out)
    elif studio is None:
        sys.stdout.write(tasks_json(ex.tasks))
    skipped = "".join(f", {n} images skipped ({why})" for why, n in ex.skipped.items())
    _say(f"{len(ex.tasks)} tasks, {len(ex.controls)} questions, model_version "
         f"{ex.model_version}{skipped}")
    if studio is not None:
        project, title = push_tasks(studio, studio.project or Path(job).resolve().name, xml,
                                    ex.tasks, ex.folders)
        _say(f"imported {len(ex.tasks)} tasks into project {project} ({title!r}) at "
             f"{studio.url}")
    return len(ex.tasks)


def import_labels(source: Path | None, out: Path | None, studio: Studio | None = None) -> int:
    """Write the labels of a Label Studio export (a file, or pulled from ``studio``); the
    number of labels."""
    if source is not None:
        records, where = read_export(source), str(source)
    else:
        assert studio is not None  # ReviewConfig's check
        records, where = pull_export(studio), f"{studio.url} project {studio.project}"
    found, cancelled = decisions(records, where)
    got = keep_latest(found, cancelled)
    if out is not None:
        write_text(got.lines(), out)
    else:
        sys.stdout.write(got.lines())
    _say(f"{len(got.labels)} labels ({len({d.image_id for d in got.labels})} images) from "
         f"{where}; {got.cancelled} cancelled annotations skipped, {got.replaced} earlier "
         "annotations replaced by a later one")
    if got.disagreements:
        ids = ", ".join(f"{i}/{q}" for i, q in got.disagreements[:SHOWN_IDS])
        more = f" and {len(got.disagreements) - SHOWN_IDS} more" if len(
            got.disagreements) > SHOWN_IDS else ""
        _say(f"{len(got.disagreements)} disagreements between annotators (the latest "
             f"annotation kept): {ids}{more}")
    return len(got.labels)


def reviewed(results: Path, labels: Path) -> dict[str, tuple[int, int]]:
    """Per question id: (answers reviewed, of them where the reviewer agreed with the model),
    from a job's (or a results file's) lines and a labels file (``review import``'s)."""
    given = read_labels(labels)
    out: dict[str, tuple[int, int]] = {}
    for s in read_results(results):
        label = given.get((s.image_id, s.question_id))
        if label is not None and s.error is None:
            n, agreed = out.get(s.question_id, (0, 0))
            out[s.question_id] = (n + 1, agreed + (s.answer == label.expected))
    return out


def export_command(job: Path) -> str:
    """The command that exports a job's borderline answers for review."""
    return (f"vlmbatch review export {job} -o tasks.json --config-out config.xml "
            "--borderline 1")
