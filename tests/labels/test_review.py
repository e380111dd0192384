"""``labels/review``: a job's answers as Label Studio tasks (the score's order, the filters,
the configuration, image URLs) and Label Studio's JSON / JSON_MIN exports read back as labels
(cancelled annotations, several annotations, annotators who disagree). The expected values
are computed here from the recorded lines, not by the code under test."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.labels.report_job import CHOICES, make_job
from vlmbatch.labels.read import read_labels
from vlmbatch.labels.review import export_tasks, import_labels
from vlmbatch.labels.review.annotations import decisions, keep_latest
from vlmbatch.labels.review.export import build_tasks, image_url, label_config
from vlmbatch.pipeline.questions import ManifestError
from vlmbatch.pipeline.records import ImageItem

THRESHOLDS = {"red": 0.3, "odd": 0.5, "far": 0.5}


def _distance(d: dict) -> float:
    """A recorded line's distance from changing, written out: log-odds for yes/no, log p1/p2
    of the top two for a label set."""
    if d["p_yes"] is None:
        top = sorted(d["probs"].values(), reverse=True)
        return math.log(top[0] / top[1])
    p = min(max(d["p_yes"], 1e-6), 1 - 1e-6)
    t = THRESHOLDS[d["question_id"]]
    return abs(math.log(p / (1 - p)) - math.log(t / (1 - t)))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict]]]:
    return make_job(tmp_path_factory.mktemp("review"))


def test_tasks_most_borderline_first(job: tuple[Path, dict[str, list[dict]]]) -> None:
    path, recorded = job
    ex = build_tasks(path)
    answered = {k: v for k, v in recorded.items() if not v[0]["error"]}
    assert ex.skipped == {"no answer": 2}  # the missing and the broken image
    want = sorted(answered, key=lambda k: min(_distance(d) for d in answered[k]))
    assert [t["data"]["image_id"] for t in ex.tasks] == want
    for t in ex.tasks:
        lines = answered[t["data"]["image_id"]]
        (pred,) = t["predictions"]
        assert pred["score"] == pytest.approx(min(map(_distance, lines)), abs=1e-5)
        assert pred["model_version"] == ex.model_version
        got = {r["from_name"]: r["value"]["choices"] for r in pred["result"]}
        assert got == {d["question_id"]: [d["label"] if d["p_yes"] is None else d["answer"]]
                       for d in lines}
        assert t["data"]["image"].startswith("/data/local-files/?d=")
    name, rest = ex.model_version.split("@")
    assert name == "default_model" and rest.endswith("/float32/none")


def test_filters(job: tuple[Path, dict[str, list[dict]]]) -> None:
    path, recorded = job
    red = {k: v[0] for k, v in recorded.items() if not v[0]["error"]}
    ex = build_tasks(path, questions=("red",), borderline=1.0)
    near = sorted((k for k, d in red.items() if _distance(d) <= 1.0),
                  key=lambda k: _distance(red[k]))
    assert near and [t["data"]["image_id"] for t in ex.tasks] == near
    assert [c.name for c in ex.controls] == ["red"]
    assert all(len(t["predictions"][0]["result"]) == 1 for t in ex.tasks)
    assert len(build_tasks(path, limit=3).tasks) == 3
    with pytest.raises(ManifestError, match="--questions nope"):
        build_tasks(path, questions=("nope",))
    with pytest.raises(ManifestError, match="no task to export within log-odds 0"):
        build_tasks(path, questions=("far",), borderline=0.0)


def test_label_config_has_each_question_and_its_choices(job: tuple[Path, dict]) -> None:
    ex = build_tasks(job[0])
    root = ET.fromstring(label_config(ex.controls))
    (image,) = root.iter("Image")
    assert image.get("value") == "$image"
    controls = {c.get("name"): [x.get("value") for x in c.iter("Choice")]
                for c in root.iter("Choices")}
    assert controls == {"red": ["yes", "no"], "odd": ["yes", "no"],
                        "category": list(CHOICES), "far": ["yes", "no"]}
    headers = [h.get("value") for h in root.iter("Header")]
    assert 'Is it <b>bold</b> & "quoted"?' in headers  # escaped in the XML, read back whole


def test_image_urls(tmp_path: Path) -> None:
    (tmp_path / "a b").mkdir()
    local = ImageItem("a", "a b/x.png", ["Red?"], tmp_path)
    assert image_url(local, tmp_path) == "/data/local-files/?d=a%20b/x.png"
    assert image_url(local, tmp_path / "elsewhere") is None
    web = ImageItem("w", "https://example.com/x.png", ["Red?"], tmp_path)
    assert image_url(web, tmp_path) == "https://example.com/x.png"


def _annotation(aid: int, who: int, when: str, red: str | None, cancelled: bool = False
                ) -> dict:
    result = [] if red is None else [{"from_name": "red", "to_name": "image",
                                      "type": "choices", "value": {"choices": [red]}}]
    return {"id": aid, "completed_by": who, "was_cancelled": cancelled, "result": result,
            "created_at": when, "updated_at": when}


# task 1: one annotator changed their mind (the later "no" counts); task 2: a cancelled
# annotation and a kept one; task 3: two annotators disagree (the later one counts, and it
# is reported); task 4: only a cancelled annotation (no label)
JSON_EXPORT = [
    {"id": 1, "data": {"image": "x", "image_id": "i1"}, "annotations": [
        _annotation(11, 1, "2026-01-01T10:00:00Z", "yes"),
        _annotation(12, 1, "2026-01-01T11:00:00Z", "no")]},
    {"id": 2, "data": {"image": "x", "image_id": "i2"}, "annotations": [
        _annotation(21, 1, "2026-01-01T12:00:00Z", "no", cancelled=True),
        _annotation(22, 1, "2026-01-01T09:00:00Z", "yes")]},
    {"id": 3, "data": {"image": "x", "image_id": "i3"}, "annotations": [
        _annotation(31, 1, "2026-01-01T10:00:00Z", "yes"),
        _annotation(32, 2, "2026-01-01T10:30:00Z", "no")]},
    {"id": 4, "data": {"image": "x", "image_id": "i4"}, "annotations": [
        _annotation(41, 2, "2026-01-01T10:00:00Z", "yes", cancelled=True)]},
]
# the same decisions as Label Studio's JSON_MIN writes them (cancelled ones left out)
JSON_MIN_EXPORT = [
    {"image": "x", "image_id": "i1", "id": 1, "red": "yes", "annotator": 1, "annotation_id": 11,
     "created_at": "2026-01-01T10:00:00Z", "updated_at": "2026-01-01T10:00:00Z"},
    {"image": "x", "image_id": "i1", "id": 1, "red": "no", "annotator": 1, "annotation_id": 12,
     "created_at": "2026-01-01T11:00:00Z", "updated_at": "2026-01-01T11:00:00Z"},
    {"image": "x", "image_id": "i2", "id": 2, "red": "yes", "annotator": 1, "annotation_id": 22,
     "created_at": "2026-01-01T09:00:00Z", "updated_at": "2026-01-01T09:00:00Z"},
    {"image": "x", "image_id": "i3", "id": 3, "red": "yes", "annotator": 1, "annotation_id": 31,
     "created_at": "2026-01-01T10:00:00Z", "updated_at": "2026-01-01T10:00:00Z"},
    {"image": "x", "image_id": "i3", "id": 3, "red": "no", "annotator": 2, "annotation_id": 32,
     "created_at": "2026-01-01T10:30:00Z", "updated_at": "2026-01-01T10:30:00Z"},
]
WANT = {("i1", "red"): "no", ("i2", "red"): "yes", ("i3", "red"): "no"}


@pytest.mark.parametrize("records, cancelled", [(JSON_EXPORT, 2), (JSON_MIN_EXPORT, 0)],
                         ids=["json", "json_min"])
def test_import_keeps_the_latest_and_reports_disagreements(records: list, cancelled: int
                                                           ) -> None:
    got = keep_latest(*decisions(records))
    assert {(d.image_id, d.question_id): d.value for d in got.labels} == WANT
    assert got.cancelled == cancelled
    assert got.replaced == 2  # i1's first answer, i3's earlier annotator
    assert got.disagreements == [("i3", "red")]


def test_import_writes_a_labels_file_calibrate_reads(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    export = tmp_path / "export.json"
    export.write_text(json.dumps(JSON_EXPORT))
    assert import_labels(export, tmp_path / "labels.jsonl") == 3
    labels = read_labels(tmp_path / "labels.jsonl")
    assert {k: v.expected for k, v in labels.items()} == WANT
    err = capsys.readouterr().err
    assert "2 cancelled annotations skipped" in err
    assert "1 disagreements between annotators (the latest annotation kept): i3/red" in err


def test_import_refuses_a_foreign_export(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no data.image_id"):
        decisions([{"id": 1, "data": {"image": "x"}, "annotations": []}])
    with pytest.raises(ManifestError, match="takes one choice"):
        decisions([{"id": 1, "image_id": "a", "red": {"choices": ["yes", "no"]}}])


def test_export_writes_tasks_and_config(job: tuple[Path, dict], tmp_path: Path) -> None:
    n = export_tasks(job[0], tmp_path / "t.json", tmp_path / "c.xml", limit=5)
    tasks = json.loads((tmp_path / "t.json").read_text())
    assert n == len(tasks) == 5
    scores = [t["predictions"][0]["score"] for t in tasks]
    assert scores == sorted(scores)
    ET.parse(tmp_path / "c.xml")


def test_report_counts_what_was_reviewed(job: tuple[Path, dict[str, list[dict]]],
                                         tmp_path: Path) -> None:
    from vlmbatch.labels.report import write_report
    path, recorded = job
    reds = {k: v[0] for k, v in recorded.items() if not v[0]["error"]}
    chosen = sorted(reds)[:7]
    # the reviewer keeps the model's answer on the first 4, changes it on the other 3
    lines = [{"id": k, "question_id": "red", "expected": reds[k]["answer"] if n < 4 else
              ("no" if reds[k]["answer"] == "yes" else "yes")} for n, k in enumerate(chosen)]
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    write_report(path, tmp_path / "r.html", labels=tmp_path / "l.jsonl")
    page = (tmp_path / "r.html").read_text()
    assert "vlmbatch review export" in page and "7 answers reviewed." in page
    assert ('<tr><td>red</td><td class="num">7</td><td class="num">4</td>'
            '<td class="num">3</td></tr>') in page
