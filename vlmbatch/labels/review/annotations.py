"""``vlmbatch review import``: what people decided in Label Studio, as the labels file that
``calibrate --labels`` and ``eval`` read (``labels/read.py``).

Two export formats, told apart by their records:

- **JSON** (Label Studio's own): a list of tasks, each ``{"id", "data": {"image_id", ...},
  "annotations": [{"id", "completed_by", "was_cancelled", "created_at", "updated_at",
  "result": [{"from_name": QUESTION_ID, "type": "choices", "value": {"choices": [V]}}]}]}``;
- **JSON_MIN**: one flat record per annotation, the task's data and ``id`` with each control's
  value under its name (``"red": "yes"``), ``annotator``, ``annotation_id``, ``created_at``,
  ``updated_at`` (Label Studio leaves cancelled annotations out of it).

The rules: a cancelled annotation (``was_cancelled``, a skipped task) says nothing and is
skipped; per (task, question) the latest annotation (``updated_at``, else ``created_at``,
then the higher annotation id) is the label; where two annotators' latest annotations of one
(task, question) differ, that is a **disagreement**: counted and named, the latest still
taken. A task carries its image's id in ``data.image_id`` (``export.py`` puts it there).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmbatch.labels.review.export import IMAGE_ID, RESERVED
from vlmbatch.pipeline.questions import ManifestError, brief


@dataclass(frozen=True)
class Decision:
    """One annotator's answer to one question of one task."""
    task: int | str
    image_id: str
    question_id: str
    value: str
    annotator: str
    annotation: int | str
    when: str  # ISO time; compared as text (Label Studio writes one format)

    @property
    def order(self) -> tuple[str, str]:
        return self.when, f"{self.annotation:>20}" if isinstance(self.annotation, int) \
            else str(self.annotation)


@dataclass
class Imported:
    """The labels kept (one per image and question), and what was left aside."""
    labels: list[Decision]
    cancelled: int = 0
    replaced: int = 0  # earlier annotations of a (task, question) superseded by a later one
    disagreements: list[tuple[str, str]] = field(default_factory=list)  # (image, question)

    def lines(self) -> str:
        """The labels file: one JSON line per (image id, question id)."""
        return "".join(json.dumps({"id": d.image_id, "question_id": d.question_id,
                                   "expected": d.value, "annotator": d.annotator,
                                   "task": d.task, "annotated_at": d.when}) + "\n"
                       for d in self.labels)


def read_export(path: Path) -> list[dict[str, Any]]:
    """The records of an export file (a JSON list; JSONL accepted too)."""
    text = Path(path).read_text(encoding="utf-8-sig")
    try:
        data = json.loads(text)
    except ValueError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as e:
            raise ManifestError(f"{path}: not a Label Studio JSON or JSON_MIN export "
                                f"({str(e)[:120]})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ManifestError(f"{path}: a Label Studio export is a JSON list of tasks, got "
                            f"{brief(data)}")
    return data


def decisions(records: list[dict[str, Any]], where: str = "export") -> tuple[list[Decision],
                                                                              int]:
    """Every annotation's answers in either format, and how many annotations were
    cancelled (skipped)."""
    if any("annotations" in r or "data" in r for r in records):
        return _from_json(records, where)
    return list(_from_min(records, where)), 0


def _image_id(data: dict[str, Any], task: object, where: str) -> str:
    v = data.get(IMAGE_ID)
    if not isinstance(v, str) or not v:
        raise ManifestError(f"{where}: task {task} has no data.{IMAGE_ID} (tasks made by "
                            "`vlmbatch review export` carry their image's id there)")
    return v


def _from_json(tasks: list[dict[str, Any]], where: str) -> tuple[list[Decision], int]:
    out: list[Decision] = []
    cancelled = 0
    for t in tasks:
        image = _image_id(t.get("data") or {}, t.get("id"), where)
        for a in t.get("annotations") or []:
            if a.get("was_cancelled") or a.get("skipped"):
                cancelled += 1
                continue
            who = a.get("completed_by")
            who = who.get("email", who.get("id")) if isinstance(who, dict) else who
            when = str(a.get("updated_at") or a.get("created_at") or "")
            for r in a.get("result") or []:
                value = _choice(r.get("value", {}).get("choices"), where, t.get("id"))
                if value is not None and r.get("from_name"):
                    out.append(Decision(t.get("id", image), image, str(r["from_name"]), value,
                                        str(who), a.get("id", 0), when))
    return out, cancelled


def _from_min(records: list[dict[str, Any]], where: str) -> Iterator[Decision]:
    for r in records:
        image = _image_id(r, r.get("id"), where)
        when = str(r.get("updated_at") or r.get("created_at") or "")
        for name, v in r.items():
            if name in RESERVED:
                continue
            value = _choice(v.get("choices") if isinstance(v, dict) else v, where, r.get("id"))
            if value is not None:
                yield Decision(r.get("id", image), image, name, value,
                               str(r.get("annotator")), r.get("annotation_id", 0), when)


def _choice(v: object, where: str, task: object) -> str | None:
    """A single choice's value (a one-element list, or JSON_MIN's plain string)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        return v[0]
    if v in (None, []):
        return None
    raise ManifestError(f"{where}: task {task}: a question takes one choice, got {brief(v)}")


def keep_latest(found: Iterable[Decision], cancelled: int = 0) -> Imported:
    """Per (task, question) the latest decision; disagreements between annotators named."""
    by_key: dict[tuple[str, str], dict[str, Decision]] = {}  # -> annotator -> latest
    total = 0
    for d in found:
        total += 1
        mine = by_key.setdefault((d.image_id, d.question_id), {})
        if d.annotator not in mine or d.order > mine[d.annotator].order:
            mine[d.annotator] = d
    out = Imported([], cancelled)
    for key, mine in by_key.items():
        latest = max(mine.values(), key=lambda d: d.order)
        out.labels.append(latest)
        if len({d.value for d in mine.values()}) > 1:
            out.disagreements.append(key)
    out.replaced = total - len(out.labels)
    return out
